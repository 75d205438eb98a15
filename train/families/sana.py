"""Sana: a linear-attention DiT over the DC-AE's 32x latents, cross-attention over Gemma-2 tokens with a mask, flow
matching with a fixed shift of 3; `SanaControlNetModel` beside it (`SanaControlNetPipeline`)."""

from __future__ import annotations

import inspect

from train.families.base import ControlNet, Family, ModelPreset

TINY = dict(
    in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, num_layers=2, num_cross_attention_heads=2,
    cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32, mlp_ratio=2.5, patch_size=1, sample_size=32,
)
# Parameter counts of the published encoder configs (diffusers 0.42.1 / transformers 5.23.0 modules).
ENCODERS = {"DC-AE f32c32 (AutoencoderDC)": 312_250_275, "Gemma-2-2B": 2_614_341_888}


class SanaControl(ControlNet):
    """Sana's ControlNet (7 blocks of Sana's 20, SanaControlNetModel's default), new from the transformer's patch,
    timestep and caption embeddings and its first N blocks, as Sana's ControlNet was built from Sana."""

    model = "SanaControlNetModel"
    pipeline = "SanaControlNetPipeline"
    default_layers = 7
    shared_config = ("in_channels", "patch_size", "num_attention_heads", "attention_head_dim", "caption_channels",
                     "cross_attention_dim", "num_cross_attention_heads", "cross_attention_head_dim", "mlp_ratio")

    def max_layers(self, transformer_layers: int) -> int:
        # residual k is added after block k + 1, so the last block takes none
        return transformer_layers - 1

    def new(self, cls, transformer, layers):
        from train.controlnet import copy_weights

        cfg = transformer.config
        unsupported = {k: cfg.get(k) for k, plain in (("guidance_embeds", False), ("qk_norm", None)) if cfg.get(k, plain) != plain}
        if unsupported:  # SanaControlNetModel's blocks and timestep embedding have neither
            raise ValueError(f"SanaControlNetModel cannot mirror this transformer ({unsupported}): its blocks and timestep "
                             f"embedding are Sana 1.0's")
        keys = set(inspect.signature(cls.__init__).parameters) - {"self"}  # the ControlNet's config entries
        controlnet = cls.from_config({**{k: v for k, v in cfg.items() if k in keys}, "num_layers": layers})
        for name in ("patch_embed", "time_embed", "caption_projection", "caption_norm"):
            copy_weights(getattr(transformer, name), getattr(controlnet, name), name)
        for i in range(layers):
            copy_weights(transformer.transformer_blocks[i], controlnet.transformer_blocks[i], f"transformer_blocks.{i}")
        return controlnet

    def forward(self, transformer, controlnet, config, xt, t, batch, control, scale):
        text, mask = batch["text"].to(xt.dtype), batch["text_mask"].to(xt.dtype)
        residuals = controlnet(hidden_states=xt, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=t,
                               controlnet_cond=control, conditioning_scale=scale, return_dict=False)[0]
        return transformer(hidden_states=xt, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=t,
                           controlnet_block_samples=tuple(residuals), return_dict=False)[0]


class Sana(Family):
    name = "sana"
    title = "Sana"
    transformer = "SanaTransformer2DModel"
    pipeline = "SanaPipeline"
    controlnet = SanaControl()
    no_tread = ("--tread: Sana's blocks cannot route tokens: their Mix-FFN convolves each token with its neighbours in "
                "the 2D latent grid (a depthwise 3 x 3 convolution), which a sequence with tokens taken out no longer is; "
                "train Sana without --tread")

    def presets(self):
        return {
            "sana-600m": lambda: ModelPreset(
                "sana-600m", self.name, "Efficient-Large-Model/Sana_600M_1024px_diffusers", "sana_600m_transformer.json", "flow",
                "flow", flow_shift=3.0, released_dtype="fp16", latent_downsample=32, encoder_parameters=ENCODERS),
            "sana-1600m": lambda: ModelPreset(
                "sana-1600m", self.name, "Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers", "sana_1600m_transformer.json",
                "flow", "flow", flow_shift=3.0, released_dtype="bf16", latent_downsample=32, encoder_parameters=ENCODERS),
            "tiny-sana": lambda: ModelPreset("tiny-sana", self.name, None, TINY, "flow", "flow", flow_shift=3.0, base_resolution=256,
                                             text_tokens=64),
        }


FAMILY = Sana()
