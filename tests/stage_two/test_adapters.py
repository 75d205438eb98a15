"""Adapters beyond LoRA: --adapter dora, lokr and loha train with peft's implementations and resume exactly; they export
in the pipeline's layout (diffusers' for DoRA, peft's for LoKr and LoHa) and in the LyCORIS layout ComfyUI loads, whose
layers rebuild peft's merged weights by LyCORIS' own formulas; --init-lora starts a run from any of those files, or
kohya's, with the same weights."""

import copy
import json

import pytest
import torch
from conftest import losses, stage_one_cache
from safetensors.torch import load_file, save_file

from train import init_lora, lora, lycoris
from train.checkpoint import ADAPTER_DIR, complete_checkpoints
from train.config import TrainConfig
from train.families import get_family, get_preset
from train.loop import train
from train.presets import build_transformer

pytestmark = pytest.mark.model  # builds tiny diffusers models and trains them (left out of make test-fast)

FAMILY = {"tiny-sana": "sana", "tiny-flux": "flux"}


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Stage one's caches of 8 sample images for tiny-sana and tiny-flux (a packed family)."""
    root = tmp_path_factory.mktemp("adapters")
    return {model: stage_one_cache(root / model, model) for model in FAMILY}


def run_cfg(cache, run, model="tiny-sana", **kw):
    base = dict(model=model, cache=cache, run=run, steps=4, batch_size=4, workers=0, progress=False, log_every=1,
                checkpoint_every=2, lr=1e-2, validate=False, precision="fp32", lora_rank=4, lora_alpha=8)
    return TrainConfig(**{**base, **kw})


def merged(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of `model` with its adapters folded in (peft's merge), by plain module path."""
    model = copy.deepcopy(model)
    lora.merge_adapters(model)
    return dict(model.state_dict())


@pytest.mark.parametrize("model", list(FAMILY))
@pytest.mark.parametrize("adapter", ["dora", "lokr", "loha"])
def test_each_adapter_trains_its_layers_alone_and_resumes_exactly(caches, tmp_path, model, adapter):
    cache = caches[model]
    train(run_cfg(cache, tmp_path / "straight", model, adapter=adapter))
    train(run_cfg(cache, tmp_path / "resumed", model, adapter=adapter, steps=2))
    train(run_cfg(cache, tmp_path / "resumed", model, adapter=adapter))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4

    straight, resumed = complete_checkpoints(tmp_path / "straight"), complete_checkpoints(tmp_path / "resumed")
    final, halfway = lora.read_adapter(straight[-1] / ADAPTER_DIR), lora.read_adapter(straight[0] / ADAPTER_DIR)
    again = lora.read_adapter(resumed[-1] / ADAPTER_DIR)
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)
    assert sum(not torch.equal(final[k], halfway[k]) for k in final) >= len(final) // 2  # they train
    # a LoKr layer's larger factor is decomposed where rank 4 is below half its size (tiny-flux's feed-forwards)
    parts = {"dora": {"lora_A.weight", "lora_B.weight", "lora_magnitude_vector"}, "lokr": {"lokr_w1", "lokr_w2"},
             "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}}[adapter]
    found = {part for groups in lycoris.modules(final).values() for part in groups}
    assert parts <= found <= parts | ({"lokr_w2_a", "lokr_w2_b"} if model == "tiny-flux" else set())
    adapted = set(lycoris.modules(final))
    targets = get_family(FAMILY[model]).lora_targets
    assert adapted and all(m.endswith(targets) for m in adapted)
    # the checkpoint's layout: DoRA as the pipeline's LoRA file, LoKr and LoHa as peft writes them
    files = {p.name for p in (straight[-1] / ADAPTER_DIR).iterdir()}
    assert files == ({lora.DIFFUSERS_FILE} if adapter == "dora" else {lora.PEFT_FILE, "adapter_config.json"})


def random_adapters(model_name: str, adapter: str, rank: int, alpha: float, **shape):
    """(base, adapted model, config): every adapter weight random, DoRA's magnitudes near the base rows' norms."""
    base = build_transformer(get_preset(model_name), None, 0)
    model = copy.deepcopy(base)
    config = lora.lora_config(get_preset(model_name).family, rank, alpha, adapter=adapter, **shape)
    lora.add_lora(model, config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(p * (1 + 0.2 * torch.randn(p.shape, generator=g)) if "magnitude" in name
                        else 0.3 * torch.randn(p.shape, generator=g))
    return base, model, config


def lycoris_weight(t: dict[str, torch.Tensor], name: str, weight: torch.Tensor) -> torch.Tensor:
    """A layer's weight with the file's layer `name` applied, as LyCORIS and ComfyUI compute it (their rules, written
    here from their documentation, not from train.lycoris)."""
    alpha = t[f"{name}.alpha"].item()
    if f"{name}.lora_down.weight" in t:
        down, up = t[f"{name}.lora_down.weight"], t[f"{name}.lora_up.weight"]
        changed = weight + up @ down * alpha / down.shape[0]
        if f"{name}.dora_scale" in t:  # wd_on_out: each output row rescaled to its magnitude
            return t[f"{name}.dora_scale"] * changed / changed.norm(dim=1, keepdim=True)
        return changed
    if f"{name}.hada_w1_a" in t:
        w1 = t[f"{name}.hada_w1_a"] @ t[f"{name}.hada_w1_b"]
        return weight + w1 * (t[f"{name}.hada_w2_a"] @ t[f"{name}.hada_w2_b"]) * alpha / t[f"{name}.hada_w1_b"].shape[0]
    w1 = t.get(f"{name}.lokr_w1")
    w2 = t.get(f"{name}.lokr_w2")
    dim = None
    if w1 is None:
        w1, dim = t[f"{name}.lokr_w1_a"] @ t[f"{name}.lokr_w1_b"], t[f"{name}.lokr_w1_b"].shape[0]
    if w2 is None:
        w2, dim = t[f"{name}.lokr_w2_a"] @ t[f"{name}.lokr_w2_b"], t[f"{name}.lokr_w2_b"].shape[0]
    return weight + torch.kron(w1, w2).reshape(weight.shape) * (alpha / dim if dim else 1.0)


CASES = [("lora", 4, {}), ("dora", 4, {}), ("loha", 4, {}),
         ("lokr", 4, {}),  # both Kronecker factors whole matrices: the loaders' scale is 1
         ("lokr", 2, {}),  # w2 decomposed
         ("lokr", 2, {"factor": 8, "decompose_both": True})]  # w1 decomposed, w2 whole


@pytest.mark.parametrize("model_name", list(FAMILY))
@pytest.mark.parametrize("adapter,rank,shape", CASES, ids=["lora", "dora", "loha", "lokr-whole", "lokr-w2-ab", "lokr-w1-ab"])
def test_the_lycoris_file_rebuilds_peft_merged_weights(tmp_path, model_name, adapter, rank, shape):
    base, model, config = random_adapters(model_name, adapter, rank, 6.0, **shape)
    expected = merged(model)
    written = lora.save_adapter(tmp_path, FAMILY[model_name], lora.adapter_state(model), config, lora_format="lycoris")
    assert written == tmp_path / lycoris.LYCORIS_FILE
    tensors = load_file(written)
    read = set()
    for path, _ in lora.adapted_modules(model):
        name = f"lycoris_{path.replace('.', '_')}"
        read |= {k for k in tensors if k.startswith(name + ".")}
        rebuilt = lycoris_weight(tensors, name, base.get_submodule(path).weight)
        assert torch.allclose(rebuilt, expected[f"{path}.weight"], rtol=1e-5, atol=1e-5), path
        assert not torch.allclose(rebuilt, base.get_submodule(path).weight, atol=1e-3)
    assert read == set(tensors)

    # and back: --init-lora of the file gives peft's weights, hence the same merged model
    init = init_lora.read_init(written, get_preset(model_name))
    assert (init.adapter, init.rank, init.alpha) == (adapter, rank, 6.0)
    again = copy.deepcopy(base)
    lora.add_lora(again, lora.lora_config(FAMILY[model_name], init.rank, init.alpha, init.modules, adapter=init.adapter,
                                          factor=init.factor, decompose_both=init.decompose_both))
    assert init_lora.load_init(again, init, lora.lora_config(FAMILY[model_name], rank, 6.0, adapter=adapter), written) == 0
    assert all(torch.allclose(v, expected[k], rtol=1e-5, atol=1e-6) for k, v in merged(again).items())


@pytest.mark.parametrize("adapter", ["dora", "lokr", "loha"])
def test_a_run_exports_in_both_layouts_and_init_lora_continues_from_either(caches, tmp_path, adapter):
    from diffusers import SanaPipeline
    from peft import PeftModel

    from train.export import export, load_model

    run = tmp_path / "run"
    train(run_cfg(caches["tiny-sana"], run, adapter=adapter, steps=2, ema_decay=0.5))
    ckpt = complete_checkpoints(run)[-1]
    trained_model, _, _ = load_model(ckpt, ema=False)
    trained, expected = lora.adapter_state(trained_model), merged(trained_model)

    written = export(run, tmp_path / "pipeline")
    fresh = build_transformer(get_preset("tiny-sana"), None, 0)
    if adapter == "dora":  # diffusers' layout, which the stock pipeline loads, DoRA's magnitudes with it
        assert written.name == lora.DIFFUSERS_FILE
        pipe = SanaPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=fresh, scheduler=None)
        pipe.load_lora_weights(tmp_path / "pipeline")
        loaded = pipe.transformer
    else:  # peft's layout, which PeftModel loads
        assert written.name == lora.PEFT_FILE
        loaded = PeftModel.from_pretrained(fresh, tmp_path / "pipeline").base_model.model
        assert "PeftModel.from_pretrained" in (tmp_path / "pipeline" / "README.md").read_text()
    assert all(torch.allclose(v, expected[k], rtol=1e-5, atol=1e-6) for k, v in merged(loaded).items())

    comfy = export(run, tmp_path / "comfy", lora_format="lycoris")
    assert comfy.name == lycoris.LYCORIS_FILE
    card = (tmp_path / "comfy" / "README.md").read_text()
    assert "create_lycoris_from_weights" in card and "ComfyUI/models/loras" in card

    # the EMA weights by the same names: they differ from the trained ones, and rebuild the model's EMA merge
    ema_file = export(run, tmp_path / "ema", ema=True, lora_format="lycoris")
    ema_state = init_lora.read_init(ema_file, get_preset("tiny-sana")).state
    assert ema_state.keys() == trained.keys() and any(not torch.allclose(ema_state[k], trained[k]) for k in trained)
    ema_model, _, _ = load_model(ckpt, ema=True)
    assert all(torch.allclose(ema_state[k], v, atol=1e-6) for k, v in lora.adapter_state(ema_model).items())

    for source in (tmp_path / "pipeline", comfy):  # the type, rank, alpha and layers come from the file
        cfg = run_cfg(caches["tiny-sana"], tmp_path / "next", init_lora=str(source), lora_rank=0, lora_alpha=None)
        assert (cfg.adapter, cfg.lora_rank, cfg.lora_alpha) == (adapter, 4, 8)
        assert sorted(cfg.lora_targets) == sorted(lycoris.modules(trained))
        model = build_transformer(get_preset("tiny-sana"), None, 0)
        config = lora.lora_config("sana", cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, adapter=cfg.adapter)
        lora.add_lora(model, config, seed=1)
        init_lora.load_init(model, init_lora.read_init(source, get_preset("tiny-sana")), config, source)
        started = lora.adapter_state(model)
        assert started.keys() == trained.keys() and all(torch.equal(started[k], trained[k]) for k in trained), source

    # a run continues: its first loss is the trained adapters' on the first batch, not new adapters'
    continued = train(run_cfg(caches["tiny-sana"], tmp_path / "continued", init_lora=str(comfy), lora_rank=0,
                              lora_alpha=None, steps=1))
    fresh_run = train(run_cfg(caches["tiny-sana"], tmp_path / "fresh", adapter=adapter, steps=1))
    assert continued["last_loss"] != fresh_run["last_loss"]


def kohya_flux_file(tmp_path):
    """A Flux LoRA in kohya's layout (double block 0's layers), and the merged weights it stands for."""
    double = r"transformer_blocks\.0\..*(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out|net\.0\.proj|net\.2)"
    base = build_transformer(get_preset("tiny-flux"), None, 0)
    model = copy.deepcopy(base)
    config = lora.lora_config("flux", 4, 12)
    config.target_modules = double
    lora.add_lora(model, config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return lora.save_adapter(tmp_path, "flux", lora.adapter_state(model), config, lora_format="kohya"), base, merged(model)


def test_init_lora_takes_a_kohya_flux_file_through_diffusers_converter(tmp_path):
    written, base, expected = kohya_flux_file(tmp_path)
    init = init_lora.read_init(written, get_preset("tiny-flux"))
    assert init.adapter == "lora" and init.rank == 4  # diffusers splits the fused q, k, v back to rank 4, alpha folded
    assert "transformer_blocks.0.attn.add_k_proj" in init.modules
    model = copy.deepcopy(base)
    config = lora.lora_config("flux", init.rank, init.alpha, init.modules)
    lora.add_lora(model, config)
    init_lora.load_init(model, init, config, written)
    assert all(torch.allclose(v, expected[k], rtol=1e-5, atol=1e-5) for k, v in merged(model).items())


def test_a_file_for_other_modules_is_refused_naming_them(tmp_path):
    _, model, config = random_adapters("tiny-sana", "loha", 4, 4.0)
    written = lora.save_adapter(tmp_path / "lyco", "sana", lora.adapter_state(model), config, lora_format="lycoris")
    tensors = load_file(written)
    stray = {k.replace("lycoris_transformer_blocks_0_attn1_to_q.", "lycoris_transformer_blocks_7_attn1_to_q."): v
             for k, v in tensors.items()}
    save_file(stray, tmp_path / "stray.safetensors")
    with pytest.raises(ValueError, match="name no module of this model .*lycoris_transformer_blocks_7_attn1_to_q"):
        init_lora.read_init(tmp_path / "stray.safetensors", get_preset("tiny-sana"))

    _, model, config = random_adapters("tiny-sana", "lora", 4, 4.0)
    state = {f"transformer.{k}": v for k, v in lora.adapter_state(model).items()}
    save_file({**state, "transformer.blocks.3.attn.to_q.lora_A.weight": torch.ones(4, 32)}, tmp_path / "diffusers.safetensors")
    with pytest.raises(ValueError, match="name no module of this tiny-sana transformer .*blocks.3.attn.to_q"):
        init_lora.read_init(tmp_path / "diffusers.safetensors", get_preset("tiny-sana"))
    save_file({**state, "text_encoder.layers.0.q.lora_A.weight": torch.ones(4, 32)}, tmp_path / "te.safetensors")
    with pytest.raises(ValueError, match="other models than the transformer .*text_encoder.layers.0.q"):
        init_lora.read_init(tmp_path / "te.safetensors", get_preset("tiny-sana"))
    (tmp_path / "k").mkdir()
    save_file({"lora_unet_nothing_here.lora_down.weight": torch.ones(4, 32)}, tmp_path / "k" / "x.safetensors")
    with pytest.raises(ValueError, match="lora_unet_nothing_here"):
        init_lora.read_init(tmp_path / "k" / "x.safetensors", get_preset("tiny-sana"))


def test_the_options_are_checked_with_the_file(tmp_path, caches):
    cache = caches["tiny-sana"]
    with pytest.raises(ValueError, match="--adapter lokr trains adapters of --lora-rank"):
        run_cfg(cache, tmp_path, adapter="lokr", lora_rank=0, lora_alpha=None)
    with pytest.raises(ValueError, match="--lokr-factor .* shape --adapter lokr"):
        run_cfg(cache, tmp_path, lokr_factor=4)
    with pytest.raises(ValueError, match="--lora-dropout .* loha has none"):
        run_cfg(cache, tmp_path, adapter="loha", lora_dropout=0.1)
    with pytest.raises(ValueError, match="--init-lora .*: no such file"):
        run_cfg(cache, tmp_path, init_lora=str(tmp_path / "missing"))
    _, model, config = random_adapters("tiny-sana", "lokr", 4, 4.0)
    written = lora.save_adapter(tmp_path / "lokr", "sana", lora.adapter_state(model), config)
    assert written.name == lora.PEFT_FILE and json.loads((tmp_path / "lokr" / "adapter_config.json").read_text())["peft_type"] == "LOKR"
    with pytest.raises(ValueError, match="holds rank-4 adapters; this run has --lora-rank 8"):
        run_cfg(cache, tmp_path, init_lora=str(tmp_path / "lokr"), lora_rank=8)
    with pytest.raises(ValueError, match="holds lokr adapters; this run has --adapter loha"):
        run_cfg(cache, tmp_path, init_lora=str(tmp_path / "lokr"), adapter="loha")
    init = init_lora.read_init(tmp_path / "lokr", get_preset("tiny-sana"))
    other = build_transformer(get_preset("tiny-sana"), None, 0)
    config = lora.lora_config("sana", 4, 4.0, init.modules, adapter="lokr", factor=2)  # 2 x 16 factors, not 4 x 8
    lora.add_lora(other, config)
    with pytest.raises(ValueError, match="shaped unlike this run's adapters .*size mismatch"):
        init_lora.load_init(other, init, config, tmp_path / "lokr")
    with pytest.raises(ValueError, match="kohya: it holds plain LoRA adapters; write dora adapters as diffusers"):
        lora.save_adapter(tmp_path / "k", "flux", {}, lora.lora_config("flux", 4, adapter="dora"), lora_format="kohya")


@pytest.mark.parametrize("adapter", ["dora", "lokr", "loha"])
def test_the_planner_traces_each_adapter_and_counts_its_parameters(adapter):
    from train.plan import plan
    from train.plan_config import PlanConfig

    result = plan(PlanConfig("tiny-flux", lora_rank=4, adapter=adapter))
    model = build_transformer(get_preset("tiny-flux"), None, 0)
    lora.add_lora(model, lora.lora_config("flux", 4, adapter=adapter))
    assert result["trainable_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0


def stock_load(model_name: str, directory, transformer):
    """`transformer` with the export in `directory` loaded as the export's card says: the family's stock pipeline's
    load_lora_weights (a pipeline around the transformer alone), or PeftModel for peft's layout."""
    import inspect

    import diffusers
    from peft import PeftModel

    if (directory / "adapter_config.json").exists():
        return PeftModel.from_pretrained(transformer, directory).base_model.model
    cls = getattr(diffusers, get_family(get_preset(model_name).family).pipeline)
    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    pipe = cls(**{n: transformer if n == "transformer" else None for n in names if n not in ("kwargs",)})
    pipe.load_lora_weights(directory)
    return pipe.transformer


@pytest.mark.parametrize("model_name", ["tiny-pixart", "tiny-sd3", "tiny-qwen-image", "tiny-z-image", "tiny-flux", "tiny-sana"])
@pytest.mark.parametrize("adapter", ["dora", "lokr", "loha"])
def test_every_family_takes_each_adapter_on_its_targets_and_loads_both_layouts(tmp_path, model_name, adapter):
    family = get_preset(model_name).family
    base, model, config = random_adapters(model_name, adapter, 4, 8.0)
    adapted = [path for path, _ in lora.adapted_modules(model)]
    assert adapted and all(path.endswith(get_family(family).lora_targets) for path in adapted)
    expected, state = merged(model), lora.adapter_state(model)

    lora.save_adapter(tmp_path / "pipeline", family, state, config)
    loaded = stock_load(model_name, tmp_path / "pipeline", copy.deepcopy(base))
    assert all(torch.allclose(v, expected[k], rtol=1e-5, atol=1e-5) for k, v in merged(loaded).items())

    tensors = load_file(lora.save_adapter(tmp_path / "comfy", family, state, config, lora_format="lycoris"))
    for path in adapted:
        rebuilt = lycoris_weight(tensors, f"{get_family(family).lycoris_prefix}_{path.replace('.', '_')}",
                                 base.get_submodule(path).weight)
        assert torch.allclose(rebuilt, expected[f"{path}.weight"], rtol=1e-5, atol=1e-5), path
