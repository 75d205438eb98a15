"""LoRA files other tools load at the strength the adapters trained with: diffusers' layout with alpha / rank folded
into lora_B (for loaders that ignore the file's alpha), kohya's Flux layout with its `.alpha` tensors, and today's
bytes when alpha equals the rank."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from train import lora
from train.families import get_preset
from train.presets import build_transformer

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

RANK = 4


def trained_flux(alpha: float, targets: str | None = None):
    """tiny-flux with adapters as after training: A from peft's init, B random (it starts at zero); (model, config, state).
    `targets`: a regex of module paths in place of the default suffixes."""
    model = build_transformer(get_preset("tiny-flux"), None, 0)
    config = lora.lora_config("flux", RANK, alpha)
    if targets:
        config.target_modules = targets
    lora.add_lora(model, config)
    generator = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = 0.1 * torch.randn(p.shape, generator=generator)
    return model, config, lora.adapter_state(model)


def output(model) -> torch.Tensor:
    """tiny-flux on fixed inputs as FluxPipeline calls it: 4 x 4 packed latents, 8 text tokens, guidance. (1, 16, 64)"""
    from diffusers import FluxPipeline

    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        return model(hidden_states=torch.randn(1, 16, 64, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                     pooled_projections=torch.randn(1, 24, generator=g), timestep=torch.tensor([0.6]),
                     img_ids=FluxPipeline._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32), txt_ids=torch.zeros(8, 3),
                     guidance=torch.tensor([3.5]), return_dict=False)[0]


def stock_load(directory, weight_name: str):
    """A fresh tiny-flux with the file loaded by the stock FluxPipeline's `load_lora_weights`."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                        transformer=build_transformer(get_preset("tiny-flux"), None, 0))
    pipe.load_lora_weights(directory, weight_name=weight_name)
    return pipe.transformer


@pytest.mark.parametrize("alpha", [16, 6])  # alpha / rank 4 and 1.5
def test_a_diffusers_file_with_alpha_unlike_rank_applies_the_trained_delta_in_every_loader(tmp_path, alpha):
    model, config, state = trained_flux(alpha)
    expected = output(model)
    written = lora.save_adapter(tmp_path, "flux", state, config)
    assert written == tmp_path / lora.DIFFUSERS_FILE

    assert torch.allclose(output(stock_load(tmp_path, lora.DIFFUSERS_FILE)), expected, rtol=1e-5, atol=1e-5)

    # a loader that takes alpha = rank whatever the file says: W + B A from the file's tensors
    plain = build_transformer(get_preset("tiny-flux"), None, 0)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(written).items()}
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                module = key.removesuffix(".lora_A.weight")
                plain.get_submodule(module).weight += tensors[f"{module}.lora_B.weight"] @ a
    assert torch.allclose(output(plain), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(output(build_transformer(get_preset("tiny-flux"), None, 0)), expected, rtol=1e-3, atol=1e-3)

    # read back as trained: the fold divided out (bit for bit when alpha / rank is a power of two)
    back = lora.read_adapter(tmp_path)
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(back[k], v) if alpha == 16 else torch.allclose(back[k], v, rtol=1e-6, atol=0), k


def test_a_kohya_flux_file_loads_into_fluxpipeline_as_the_diffusers_file_does(tmp_path):
    # diffusers' converter splits a single block's linear1 at flux-dev's widths only (3 x 3072 + 12288): the double
    # block here, the single block's linear1 at full width below
    double = r"transformer_blocks\.0\..*(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out|net\.0\.proj|net\.2)"
    model, config, state = trained_flux(12, double)
    assert len(state) == 2 * 12
    lora.save_adapter(tmp_path / "diffusers", "flux", state, config)
    written = lora.save_adapter(tmp_path / "kohya", "flux", state, config, lora_format="kohya")
    assert written == tmp_path / "kohya" / lora.KOHYA_FILE

    tensors = load_file(written)
    names = {k.rpartition(".")[0].removesuffix(".lora_down").removesuffix(".lora_up") for k in tensors}
    assert names == {f"lora_unet_double_blocks_0_{n}" for n in ("img_attn_qkv", "txt_attn_qkv", "img_attn_proj", "txt_attn_proj",
                                                               "img_mlp_0", "img_mlp_2", "txt_mlp_0", "txt_mlp_2")}
    assert all(f"{n}.{p}" in tensors for n in names for p in ("lora_down.weight", "lora_up.weight", "alpha"))
    assert tensors["lora_unet_double_blocks_0_img_attn_proj.alpha"].item() == 12
    assert tensors["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item() == 36  # rank 12 for q, k and v
    assert tensors["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 3 * RANK

    expected = output(model)
    from_kohya = output(stock_load(tmp_path / "kohya", lora.KOHYA_FILE))
    assert torch.allclose(from_kohya, output(stock_load(tmp_path / "diffusers", lora.DIFFUSERS_FILE)), rtol=1e-5, atol=1e-5)
    assert torch.allclose(from_kohya, expected, rtol=1e-5, atol=1e-5)

    # kohya's meaning, as ComfyUI applies it: up down alpha / rank per file entry is the trained B A alpha / r stacked
    qkv = "lora_unet_double_blocks_0_txt_attn_qkv"
    delta = tensors[qkv + ".lora_up.weight"] @ tensors[qkv + ".lora_down.weight"] * tensors[qkv + ".alpha"] / (3 * RANK)
    attn = "transformer_blocks.0.attn."
    trained = torch.cat([state[f"{attn}{p}.lora_B.weight"] @ state[f"{attn}{p}.lora_A.weight"]
                         for p in ("add_q_proj", "add_k_proj", "add_v_proj")]) * 12 / RANK
    assert torch.allclose(delta, trained, rtol=1e-5, atol=1e-6)


def test_a_single_blocks_query_key_value_go_to_linear1_which_diffusers_splits_back(tmp_path):
    """flux-dev's widths (3072 wide attention, 12288 wide MLP) as tensors alone: q, k and v adapted, the MLP input not."""
    from diffusers import FluxPipeline

    g = torch.Generator().manual_seed(3)
    state = {f"single_transformer_blocks.5.attn.{p}.lora_{m}.weight": torch.randn(shape, generator=g)
             for p in ("to_q", "to_k", "to_v") for m, shape in (("A", (RANK, 3072)), ("B", (3072, RANK)))}
    written = lora.save_adapter(tmp_path, "flux", state, lora.lora_config("flux", RANK, 2), lora_format="kohya")
    tensors = load_file(written)
    linear1 = "lora_unet_single_blocks_5_linear1"
    up, down = tensors[f"{linear1}.lora_up.weight"], tensors[f"{linear1}.lora_down.weight"]
    assert up.shape == (3 * 3072 + 12288, 4 * RANK) and down.shape == (4 * RANK, 3072)
    assert tensors[f"{linear1}.alpha"].item() == 8
    assert not up[3 * 3072:].any()  # the MLP input's rows: not adapted

    converted = FluxPipeline.lora_state_dict(tmp_path, weight_name=lora.KOHYA_FILE)
    for p in ("to_q", "to_k", "to_v"):
        key = f"transformer.single_transformer_blocks.5.attn.{p}"
        module = key.removeprefix("transformer.")
        trained = state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"]
        assert converted[key + ".lora_A.weight"].shape == (RANK, 3072)  # split back to rank r, not 4 r
        delta = converted[f"{key}.lora_B.weight"] @ converted[f"{key}.lora_A.weight"]
        assert torch.allclose(delta, trained * 2 / RANK, atol=1e-5)
    assert not converted["transformer.single_transformer_blocks.5.proj_mlp.lora_B.weight"].any()


@pytest.mark.parametrize("family", ["pixart", "sana", "sd3"])
def test_kohya_layout_is_refused_for_families_other_than_flux(tmp_path, family):
    with pytest.raises(ValueError, match=f"{family} adapters are written as diffusers"):
        lora.save_adapter(tmp_path, family, {}, lora.lora_config(family, RANK), lora_format="kohya")
    assert not any(tmp_path.iterdir())


def test_a_module_kohya_cannot_name_is_refused(tmp_path):
    state = {"proj_out.lora_A.weight": torch.ones(RANK, 8), "proj_out.lora_B.weight": torch.ones(8, RANK)}
    with pytest.raises(ValueError, match="proj_out: kohya's Flux layout .* export in the diffusers format"):
        lora.save_adapter(tmp_path, "flux", state, lora.lora_config("flux", RANK), lora_format="kohya")


@pytest.mark.parametrize("alpha,fold", [(RANK, True), (16, False)])
def test_unfolded_files_are_diffusers_own_bytes(tmp_path, alpha, fold):
    """alpha = rank (nothing to fold), or a checkpoint's unfolded adapters: exactly what FluxPipeline.save_lora_weights
    writes with the LoRA config in the metadata, alpha as trained."""
    import json

    from diffusers import FluxPipeline

    _, config, state = trained_flux(alpha)
    written = lora.save_adapter(tmp_path / "ours", "flux", state, config, fold=fold)
    metadata = json.loads(json.dumps(config.to_dict(), default=lora._jsonable))
    FluxPipeline.save_lora_weights(tmp_path / "stock", transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata)
    ours, stock = written.read_bytes(), (tmp_path / "stock" / lora.DIFFUSERS_FILE).read_bytes()
    # safetensors writes the header's metadata in no fixed order: the header as JSON, the tensor bytes as bytes
    size = int.from_bytes(ours[:8], "little")
    assert json.loads(ours[8:8 + size]) == json.loads(stock[8:8 + size]) and ours[8 + size:] == stock[8 + size:]
    with safe_open(written, "pt") as f:
        assert json.loads(f.metadata()["lora_adapter_metadata"])["transformer.lora_alpha"] == alpha
        assert lora.FOLDED not in f.metadata()
    back = lora.read_adapter(tmp_path / "ours")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_a_run_whose_alpha_is_not_a_power_of_two_of_its_rank_resumes_exactly(tiny_caches, tmp_path):
    """Checkpoints keep the adapters as trained: with alpha / rank = 1.5 (a fold would not divide back out exactly),
    the steps after a resume have the losses of the uninterrupted run."""
    import json

    from train.config import TrainConfig
    from train.loop import train

    common = dict(model="tiny-sd3", cache=tiny_caches["tiny-sd3"], batch_size=4, progress=False, log_every=1, workers=0,
                  checkpoint_every=3, lr=1e-3, validate=False, steps=6, lora_rank=RANK, lora_alpha=6.0, precision="fp32")
    train(TrainConfig(run=tmp_path / "straight", **common))
    train(TrainConfig(run=tmp_path / "resumed", resume=str(tmp_path / "straight" / "checkpoints" / "step-00000003"), **common))

    def losses(run):
        return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}

    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6] and resumed == {step: straight[step] for step in resumed}
    # what makes it exact: the checkpoint's file holds lora_B as trained, its alpha as configured
    from train.checkpoint import ADAPTER_DIR

    with safe_open(str(tmp_path / "straight" / "checkpoints" / "step-00000003" / ADAPTER_DIR / lora.DIFFUSERS_FILE), "pt") as f:
        metadata = f.metadata()
    assert "cachedit_lora_scale_folded" not in metadata
    assert json.loads(metadata["lora_adapter_metadata"])["transformer.lora_alpha"] == 6.0
