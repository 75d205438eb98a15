"""The kohya layout this product writes (`--lora-format kohya`: Flux's, Kontext's, Wan's) goes back through `--init-lora`
at any width, every layer of the blocks included (diffusers' Flux converter splits a single block's linear1 at FLUX.1's
widths only; its Wan converter needs every layer of every block): export, read, and the run's adapters are the trained
ones, bit for bit, with their rank and alpha. A file nothing reads is refused with every reason, never an empty one;
the run's log names the adapted layers as `--lora-targets` does."""

import copy

import pytest
import torch
from conftest import stage_one_cache
from safetensors.torch import load_file, save_file

from train import init_lora, lora
from train.families import get_family, get_preset
from train.presets import build_transformer

pytestmark = pytest.mark.model  # builds tiny diffusers transformers


def block_layers(model: torch.nn.Module, family: str, only: tuple[str, ...] = ()) -> list[str]:
    """Every Linear layer of the model's blocks (or those ending in one of `only`), by path."""
    inside = {id(b) for b in get_family(family).blocks(model)}
    blocks = [name for name, m in model.named_modules() if id(m) in inside]
    return sorted(name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                  and any(name.startswith(b + ".") for b in blocks) and (not only or name.endswith(only)))


def trained_adapters(model_name: str, rank: int, alpha: float, only: tuple[str, ...] = ()):
    """(model with random adapters on its block layers, their peft config)."""
    preset = get_preset(model_name)
    model = build_transformer(preset, None, 0)
    config = lora.lora_config(preset.family, rank, alpha, block_layers(model, preset.family, only))
    lora.add_lora(model, config, seed=3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) / 8)
    return model, config


@pytest.mark.parametrize("model_name", ["tiny-flux", "tiny-flux1-kontext", "tiny-wan", "tiny-wan-i2v"])
@pytest.mark.parametrize("only", [(), ("to_q", "to_v")], ids=["every-layer", "q-and-v"])
def test_a_kohya_export_starts_a_run_with_the_same_adapters_bit_for_bit(tmp_path, model_name, only):
    preset = get_preset(model_name)
    model, config = trained_adapters(model_name, 4, 8.0, only)
    trained = lora.adapter_state(model)
    written = lora.save_adapter(tmp_path, preset.family, trained, config, lora_format="kohya")
    assert written.name == lora.KOHYA_FILE

    init = init_lora.read_init(written, preset)
    assert (init.adapter, init.rank, init.alpha) == ("lora", 4, 8.0)
    assert init.modules == sorted({k.rsplit(".lora_", 1)[0] for k in trained})  # a part kohya fuses but not adapted stays out
    fresh = build_transformer(preset, None, 0)
    again = lora.lora_config(preset.family, init.rank, init.alpha, init.modules)
    lora.add_lora(fresh, again, seed=11)
    assert init_lora.load_init(fresh, init, again, written) == 0
    started = lora.adapter_state(fresh)
    assert started.keys() == trained.keys()
    assert all(torch.equal(started[k], trained[k]) for k in trained)


def test_kohyas_own_fused_flux_layers_read_as_diffusers_converter_reads_them(tmp_path):
    """sd-scripts trains BFL's fused layer as one LoRA (one rank for q, k, v and the MLP input): each part gets the whole
    down and its rows of up, which stand for the same weight delta."""
    model, config = trained_adapters("tiny-flux", 4, 4.0, ("single_transformer_blocks.0.attn.to_q",))
    width = model.single_transformer_blocks[0].attn.to_q.out_features
    g = torch.Generator().manual_seed(2)
    down, up = torch.randn(4, width, generator=g), torch.randn(7 * width, 4, generator=g)
    save_file({"lora_unet_single_blocks_0_linear1.lora_down.weight": down, "lora_unet_single_blocks_0_linear1.lora_up.weight": up,
               "lora_unet_single_blocks_0_linear1.alpha": torch.tensor(2.0)}, tmp_path / "sd-scripts.safetensors",
              metadata={"ss_network_dim": "4", "ss_network_alpha": "2"})
    init = init_lora.read_init(tmp_path / "sd-scripts.safetensors", get_preset("tiny-flux"))
    assert (init.rank, init.alpha) == (4, 2.0)
    parts = ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]
    assert init.modules == sorted(f"single_transformer_blocks.0.{p}" for p in parts)
    rows = [0, width, 2 * width, 3 * width, 7 * width]
    for i, part in enumerate(parts):
        module = f"single_transformer_blocks.0.{part}"
        assert torch.equal(init.state[f"{module}.lora_A.weight"], down)
        assert torch.equal(init.state[f"{module}.lora_B.weight"], up[rows[i]:rows[i + 1]])


def test_a_file_no_reader_takes_is_refused_with_every_reason(tmp_path):
    model, config = trained_adapters("tiny-flux", 4, 4.0)
    tensors = load_file(lora.save_adapter(tmp_path, "flux", lora.adapter_state(model), config, lora_format="kohya"))
    tensors["lora_unet_single_blocks_0_bogus.lora_down.weight"] = torch.zeros(4, 8)
    save_file(tensors, tmp_path / "odd.safetensors")
    with pytest.raises(ValueError) as e:
        init_lora.read_init(tmp_path / "odd.safetensors", get_preset("tiny-flux"))
    message = str(e.value)
    assert "()" not in message
    assert "not Flux's kohya layout: lora_unet_single_blocks_0_bogus has no lora_up.weight" in message  # why not ours
    # diffusers' converter asserts FLUX.1's widths without a message: its type, where, and the line say it
    assert "FluxPipeline.lora_state_dict does not convert it (AssertionError without a message at lora_conversion_utils.py:" in message
    assert "assert sum(dims) == up_weight.shape[0]" in message


def test_a_cause_without_words_says_where_it_was_raised():
    def converter():
        raise AssertionError  # a bare assert outside a test module (pytest rewrites this file's)

    try:
        converter()
    except AssertionError as e:
        assert init_lora.cause(e).startswith("AssertionError without a message at test_review_fixes2_kohya.py:")
        assert init_lora.cause(e).endswith("in converter: raise AssertionError  # a bare assert outside a test module (pytest rewrites this file's)")
    assert init_lora.cause(KeyError("blocks_0_self_attn_k.lora_down.weight")) == "KeyError: 'blocks_0_self_attn_k.lora_down.weight'"


def test_the_layer_names_are_the_ones_lora_targets_takes():
    """peft rewrites 20 or more target paths into the shortest suffixes that pick the same layers ("2" for ffn.net.2);
    the log names each layer by its path inside its block."""
    model, config = trained_adapters("tiny-wan", 4, 4.0)
    assert "2" in config.target_modules  # peft's rewrite, which the log showed as it was
    blocks = get_family("wan").blocks(model)
    assert lora.layer_names(model, blocks) == ("attn1.to_k, attn1.to_out.0, attn1.to_q, attn1.to_v, attn2.to_k, attn2.to_out.0, "
                                               "attn2.to_q, attn2.to_v, ffn.net.0.proj, ffn.net.2")
    outside = build_transformer(get_preset("tiny-wan"), None, 0)
    lora.add_lora(outside, lora.lora_config("wan", 4, 4.0, ["condition_embedder.time_embedder.linear_1", "blocks.0.ffn.net.2"]))
    assert lora.layer_names(outside, get_family("wan").blocks(outside)) == "condition_embedder.time_embedder.linear_1, ffn.net.2"
    flux = copy.deepcopy(trained_adapters("tiny-flux", 4, 4.0)[0])
    assert lora.layer_names(flux, get_family("flux").blocks(flux), limit=3) == "attn.add_k_proj, attn.add_q_proj, attn.add_v_proj and 14 more"


def test_a_tiny_flux_runs_kohya_export_starts_the_next_run(tmp_path, capsys):
    """`python -m train export RUN --lora-format kohya`, then a run with `--init-lora` on the file: the run's adapters,
    rank, alpha and layers; its log names the layers as `--lora-targets` does."""
    from typer.testing import CliRunner

    from train.__main__ import tools
    from train.checkpoint import ADAPTER_DIR, complete_checkpoints
    from train.config import TrainConfig
    from train.loop import train

    cache = stage_one_cache(tmp_path / "data", "tiny-flux", count=4)
    layers = block_layers(build_transformer(get_preset("tiny-flux"), None, 0), "flux")
    run = dict(model="tiny-flux", cache=cache, batch_size=2, workers=0, progress=False, validate=False, precision="fp32",
               lr=1e-2)
    train(TrainConfig(**run, run=tmp_path / "run", steps=2, lora_rank=4, lora_alpha=8, lora_targets=layers))
    exported = CliRunner().invoke(tools, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--lora-format", "kohya"])
    assert exported.exit_code == 0, exported.output
    trained = lora.read_adapter(complete_checkpoints(tmp_path / "run")[-1] / ADAPTER_DIR)

    capsys.readouterr()
    cfg = TrainConfig(**run, run=tmp_path / "next", steps=1, init_lora=str(tmp_path / "out" / lora.KOHYA_FILE))
    assert (cfg.adapter, cfg.lora_rank, cfg.lora_alpha, sorted(cfg.lora_targets)) == ("lora", 4, 8.0, layers)
    model = build_transformer(get_preset("tiny-flux"), None, 0)
    config = lora.lora_config("flux", cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    lora.add_lora(model, config, seed=1)
    init_lora.load_init(model, init_lora.read_init(cfg.init_lora, get_preset("tiny-flux")), config, cfg.init_lora)
    started = lora.adapter_state(model)
    assert started.keys() == trained.keys() and all(torch.equal(started[k], trained[k]) for k in trained)
    train(cfg)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("LoRA rank 4, alpha 8 on "))
    assert f"on {len(layers)} layers (attn.add_k_proj, attn.add_q_proj, " in line and " and 5 more): " in line


def test_a_kohya_file_beyond_the_exported_layout_goes_through_diffusers_converter(tmp_path):
    """sd-scripts also adapts layers outside the blocks (`lora_unet_img_in`, Flux's x_embedder), which the export does
    not write: such a file is not read as the export's layout but converted by FluxPipeline.lora_state_dict, and
    stands for the same weights."""
    double = [f"transformer_blocks.0.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj")]
    base = build_transformer(get_preset("tiny-flux"), None, 0)
    model = copy.deepcopy(base)
    config = lora.lora_config("flux", 4, 12, [*double, "x_embedder"])
    lora.add_lora(model, config, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) / 8)
    state = lora.adapter_state(model)
    embedder = {k: state.pop(k) for k in list(state) if k.startswith("x_embedder.")}
    tensors = load_file(lora.save_adapter(tmp_path, "flux", state, config, lora_format="kohya"))
    tensors |= {"lora_unet_img_in.lora_down.weight": embedder["x_embedder.lora_A.weight"],
                "lora_unet_img_in.lora_up.weight": embedder["x_embedder.lora_B.weight"], "lora_unet_img_in.alpha": torch.tensor(12.0)}
    save_file(tensors, tmp_path / "sd-scripts.safetensors")

    init = init_lora.read_init(tmp_path / "sd-scripts.safetensors", get_preset("tiny-flux"))
    assert init.modules == sorted([*double, "x_embedder"])
    loaded = copy.deepcopy(base)
    again = lora.lora_config("flux", init.rank, init.alpha, init.modules)
    lora.add_lora(loaded, again)
    init_lora.load_init(loaded, init, again, tmp_path / "sd-scripts.safetensors")
    expected, got = merged(model), merged(loaded)
    assert all(torch.allclose(got[k], v, rtol=1e-5, atol=1e-6) for k, v in expected.items())
    assert not torch.allclose(expected["x_embedder.weight"], dict(base.state_dict())["x_embedder.weight"])


def merged(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    lora.merge_adapters(model)
    return dict(model.state_dict())
