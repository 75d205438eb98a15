"""SD3 / SD3.5 (MMDiT): joint attention over CLIP-L + CLIP-G + T5 tokens and the pooled CLIP projections, flow
matching with a fixed shift of 3 and preconditioned outputs as diffusers' SD3 trainers; `SD3ControlNetModel`
beside it (`StableDiffusion3ControlNetPipeline`)."""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from shards import LatentSpec, TextSpec
from train.families.base import ATTENTION, TEXT_STREAM, ControlNet, Family, ModelPreset, TextInput, TokenRoute

# SD3.5-medium's features at CPU size: QK RMS-norm and one dual-attention (MMDiT-X) block.
TINY = dict(
    sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=24, pos_embed_max_size=48, qk_norm="rms_norm",
    dual_attention_layers=(0,),
)
# Parameter counts of the published encoder configs (diffusers 0.42.1 / transformers 5.23.0 modules).
ENCODERS = {"SD3 VAE (AutoencoderKL)": 83_819_683, "CLIP-L": 123_650_304, "CLIP-G": 694_659_840,
            "T5-v1.1-XXL encoder": 4_762_310_656}
CLIP_TOKENS = 77


class JointText(TextInput):
    """"sd3_joint": per caption `clip` (CLIP-L and CLIP-G tokens), `pooled` and, unless the cache dropped T5, `text`
    (T5 tokens); the batch adds `t5_zeros`, the zero tokens standing in for a dropped T5."""

    layout = "sd3_joint"
    description = "CLIP-L/G tokens, their pooled vector and T5 tokens"

    def caption(self, spec, fields, pick=0):
        out = super().caption(spec, fields, pick)
        tokens = fields["clip"].shape[0] // self.captions(fields)
        out["clip"] = fields["clip"][pick * tokens : (pick + 1) * tokens]
        out["pooled"] = fields["pooled"][pick]
        return out

    def collate(self, spec, conds):
        """`text` and `text_mask` as masked captions, `clip` (B, 77, D_clip), `pooled` (B, D_pooled), `t5_zeros`."""
        return {**super().collate(spec, conds), "clip": torch.stack([c["clip"] for c in conds]),
                "pooled": torch.stack([c["pooled"] for c in conds]), "t5_zeros": spec.t5_zeros}

    def problems(self, spec: TextSpec, config, family):
        joint, problems = config.get("joint_attention_dim"), []
        if spec.clip_width is None or joint is None or spec.clip_width > joint:
            problems.append(f"CLIP width: cache {spec.clip_width}, over the model's joint width {joint}")
        if spec.pooled_width != config.get("pooled_projection_dim"):
            problems.append(f"pooled width: cache {spec.pooled_width}, model pooled_projection_dim {config.get('pooled_projection_dim')}")
        if spec.t5_width not in (None, joint):
            problems.append(f"T5 width: cache {spec.t5_width}, model joint_attention_dim {joint}")
        return problems

    def example(self, config, family, batch, tokens, dtype, device="meta"):
        clip, width = min(CLIP_TOKENS, tokens), family.text_width(config)  # CLIP's tokens, the rest T5's; the joint width
        return {"clip": torch.zeros(batch, clip, width, device=device, dtype=dtype),
                "text": torch.zeros(batch, tokens - clip, width, device=device, dtype=dtype),
                "pooled": torch.zeros(batch, config["pooled_projection_dim"], device=device, dtype=dtype)}


def joint_tokens(batch: dict, width: int, dtype: torch.dtype) -> torch.Tensor:
    """SD3's text input as StableDiffusion3Pipeline.encode_prompt builds it: CLIP-L and CLIP-G tokens
    zero-padded to the joint width, then the T5 tokens (zeros when the cache dropped T5). (B, 77 + L, width)"""
    clip = batch["clip"].to(dtype)
    clip = torch.nn.functional.pad(clip, (0, width - clip.shape[-1]))
    if "text" in batch:
        t5 = batch["text"].to(dtype)
    else:
        t5 = clip.new_zeros(clip.shape[0], batch["t5_zeros"], width)
    return torch.cat([clip, t5], dim=1)


class SD3Control(ControlNet):
    """SD3's ControlNet: new from the transformer's embeddings and first N blocks (diffusers' train_controlnet_sd3.py,
    SD3ControlNetModel.from_transformer's default of 12)."""

    model = "SD3ControlNetModel"
    pipeline = "StableDiffusion3ControlNetPipeline"
    default_layers = 12
    shared_config = ("in_channels", "patch_size", "num_attention_heads", "attention_head_dim", "joint_attention_dim",
                     "caption_projection_dim", "pooled_projection_dim")
    # the ControlNet's last block computes a text stream that nothing reads, so some of its parameters get no gradient
    find_unused = True

    def max_layers(self, transformer_layers: int) -> int:
        # residual int(i * N / L) goes to block i but the last (its text stream ends there): all are taken when N <= L / 2
        return transformer_layers // 2

    def new(self, cls, transformer, layers):
        # from_transformer writes num_layers into the config it is given: hand it a copy, not the transformer's.
        # force_zeros_for_pooled_projection False: the stock pipeline then feeds the ControlNet the pooled prompt and
        # the control latent with the VAE's shift, as the cache stores it and training feeds them.
        from diffusers.configuration_utils import FrozenDict

        config = {**transformer.config, "force_zeros_for_pooled_projection": False}
        source = types.SimpleNamespace(config=FrozenDict(config), **{name: getattr(transformer, name) for name in (
            "pos_embed", "time_text_embed", "context_embedder", "transformer_blocks")})
        return cls.from_transformer(source, num_layers=layers, num_extra_conditioning_channels=0)

    def problems(self, controlnet_config, transformer_config):
        problems = []
        if not controlnet_config.get("use_pos_embed", True) or controlnet_config.get("joint_attention_dim") is None:
            problems.append("it shares the transformer's patch embedding and reads no text (as SD3.5 Large's released "
                            "ControlNets do); only ControlNets with their own are trained here")
        if controlnet_config.get("extra_conditioning_channels", 0):
            problems.append(f"it takes {controlnet_config['extra_conditioning_channels']} extra conditioning channel(s) "
                            f"beside the latent (e.g. an inpainting mask); the cache holds the control latent alone")
        return problems

    def control_input(self, controlnet_config, control, latent: LatentSpec | None):
        """A ControlNet with `force_zeros_for_pooled_projection` (InstantX's) was trained on z * scaling, which is
        what its pipeline feeds it: the cached latent plus shift * scaling."""
        if controlnet_config.get("force_zeros_for_pooled_projection", True):
            if latent is None:
                raise ValueError("this ControlNet takes the control latent without the VAE's shift: pass the cache's LatentSpec")
            return control + latent.shift_factor * latent.scaling_factor
        return control

    def forward(self, transformer, controlnet, config, xt, t, batch, control, scale):
        width = getattr(transformer, "module", transformer).config.get("joint_attention_dim")
        text = joint_tokens(batch, width, xt.dtype)
        pooled = batch["pooled"].to(xt.dtype)
        # a ControlNet with force_zeros_for_pooled_projection gets zeros for the pooled prompt, as in its pipeline
        own_pooled = torch.zeros_like(pooled) if config.get("force_zeros_for_pooled_projection", True) else pooled
        residuals = controlnet(hidden_states=xt, controlnet_cond=control, conditioning_scale=scale, encoder_hidden_states=text,
                               pooled_projections=own_pooled, timestep=t, return_dict=False)[0]
        return transformer(hidden_states=xt, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                           block_controlnet_hidden_states=residuals, return_dict=False)[0]


def preset(name: str, family: str, repo: str, config: str, released_dtype: str) -> ModelPreset:
    return ModelPreset(name, family, repo, config, "flow", "flow", flow_shift=3.0, encoder_parameters=ENCODERS,
                       released_dtype=released_dtype, text_tokens=CLIP_TOKENS + 256)


class SD3(Family):
    name = "sd3"
    title = "SD3"
    transformer = "SD3Transformer2DModel"
    pipeline = "StableDiffusion3Pipeline"
    text = JointText()
    lora_targets = ATTENTION + TEXT_STREAM  # names match by suffix, so SD3.5's second attention (attn2) is included
    null_caption = "zeros"  # SD3 was trained with zeroed embeddings for a dropped caption
    precondition_outputs = True  # as diffusers' SD3 trainers
    controlnet = SD3Control()

    def presets(self):
        return {
            "sd3-medium": lambda: preset("sd3-medium", self.name, "stabilityai/stable-diffusion-3-medium-diffusers",
                                         "sd3_medium_transformer.json", "fp16"),
            "sd35-medium": lambda: preset("sd35-medium", self.name, "stabilityai/stable-diffusion-3.5-medium",
                                          "sd35_medium_transformer.json", "bf16"),
            "sd35-large": lambda: preset("sd35-large", self.name, "stabilityai/stable-diffusion-3.5-large",
                                         "sd35_large_transformer.json", "bf16"),
            "tiny-sd3": lambda: ModelPreset("tiny-sd3", self.name, None, TINY, "flow", "flow", flow_shift=3.0, base_resolution=256,
                                            text_tokens=CLIP_TOKENS + 32),
        }

    def text_width(self, config: Mapping) -> int:
        return config["joint_attention_dim"]

    def tread_route(self, model):
        """The image stream of the joint blocks (returned second, after the text stream, which is never routed; SD3.5's
        second attention is over the image tokens alone): their absolute position embedding was added by the patch
        embedding, before the first block."""
        return TokenRoute(self.blocks(model), output=1)

    def forward(self, model, config, xt, t, batch, guidance):
        # joint attention over all tokens, no mask; pooled CLIP projections
        return model(hidden_states=xt, encoder_hidden_states=joint_tokens(batch, config["joint_attention_dim"], xt.dtype),
                     pooled_projections=batch["pooled"].to(xt.dtype), timestep=t, return_dict=False)[0]


FAMILY = SD3()
