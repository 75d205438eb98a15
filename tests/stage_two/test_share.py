"""Sharing a run: every export carries a model card (OUT/README.md with the last validation grid), and
`export --push-to-hub` uploads exactly the export folder (the Hub stubbed at HfApi's two calls; nothing else)."""

import json
import re
import shutil
import types
from pathlib import Path

import pytest
from conftest import VALIDATION_PROMPTS
from PIL import Image, ImageFilter, ImageOps

from shards import Cache
from train import lora
from train.config import TrainConfig
from train.export import export
from train.loop import train

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}


def cfg(cache, run, model="tiny-sana", **kw):
    base = dict(model=model, cache=[str(cache)], run=str(run), steps=4, batch_size=4, workers=0, progress=False,
                validation_steps=2, precision="fp32")
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny-sana cache of 8 images (with control images) and three finished runs on it: LoRA, full fine-tuning,
    ControlNet; each left its validation grid in the run directory."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    root = tmp_path_factory.mktemp("share")
    data = make_folder(root / "data", count=8)
    for image in sorted(data.glob("?????.png")):
        ImageOps.grayscale(Image.open(image)).filter(ImageFilter.FIND_EDGES).convert("RGB").save(image.with_suffix(".control.png"))
    precompute(str(data), "tiny-sana", root / "cache", workers=0, progress=False, validation_prompt=list(VALIDATION_PROMPTS))
    precompute(str(data), "tiny-sana", root / "control", workers=0, progress=False, control=True)
    train(cfg(root / "cache", root / "lora", lora_rank=4, lora_alpha=8))
    train(cfg(root / "cache", root / "full"))
    train(cfg(root / "control", root / "controlnet", steps=2, batch_size=2, controlnet=True, validation_items=1))
    return root


def card_of(out: Path):
    from huggingface_hub import ModelCard

    return ModelCard.load(out / "README.md")


def files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def snippet(text: str) -> str:
    """The card's loading code (checked to be Python)."""
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    compile(code, "README.md", "exec")
    return code


def check_card_basics(out: Path, runs: Path, run: str, kind_tag: str | None):
    card = card_of(out)
    tags = card.data.tags
    assert {"sana", "diffusers", "cachedit"} <= set(tags) and (kind_tag is None or kind_tag in tags)
    assert card.data.library_name == "diffusers" and card.data.get("license") is None  # the licence is the owner's to set
    (widget,) = card.data.widget
    image = out / widget["output"]["url"]
    grids = sorted((runs / run).glob("samples-step*.png"))
    assert image.parent == out / "images" and image.read_bytes() == grids[-1].read_bytes()  # the run's last grid
    return card


def test_a_lora_export_has_a_card_with_base_adapters_training_data_grid_and_loading_code(runs, tmp_path):
    out = tmp_path / "my-lora"
    export(runs / "lora", out)
    card = check_card_basics(out, runs, "lora", "lora")
    assert card.data.widget[0]["text"] == "; ".join(sorted(VALIDATION_PROMPTS))  # the cache's validation prompts
    text = card.text
    assert "rank 4, alpha 8" in text and "`to_q`, `to_k`, `to_v`, `to_out.0`" in text
    assert "| steps | 4 of 4 |" in text and "adamw" in text and "0.0001, schedule constant" in text and "fp32 autocast" in text
    cache = Cache(runs / "cache")
    assert f"{len(cache)} samples" in text
    for bucket, stats in cache.manifest.buckets().items():
        assert f"{bucket.height}×{bucket.width}: {stats.samples}" in text
    assert "fresh weights from the tiny-sana config (seed 0)" in text
    assert 'SanaPipeline.from_pretrained("BASE"' in snippet(text) and f'pipe.load_lora_weights("{out}")' in snippet(text)
    assert files(out) == [".cachedit-export.json", "README.md", "images/samples-step00000004.png", lora.DIFFUSERS_FILE, "training.json"]


def test_a_full_export_has_its_card_beside_the_transformer(runs, tmp_path):
    out = tmp_path / "full"
    assert export(runs / "full", out) == out / "transformer"
    card = check_card_basics(out, runs, "full", None)
    assert "lora" not in card.data.tags and "A full fine-tune" in card.text
    code = snippet(card.text)
    assert f'SanaTransformer2DModel.from_pretrained("{out}", subfolder="transformer"' in code and "transformer=transformer" in code
    assert {"README.md", "transformer/config.json", "transformer/training.json"} <= set(files(out))
    merged = tmp_path / "merged"
    export(runs / "lora", merged, merge_lora=True)  # a LoRA run's adapters folded into the transformer: a full export's card
    card = check_card_basics(merged, runs, "lora", None)
    assert "lora" not in card.data.tags and "LoRA adapters (rank 4) trained on it and merged" in card.text
    assert 'subfolder="transformer"' in snippet(card.text)


def test_a_controlnet_export_has_its_card_with_the_controlnet_depth_and_pipeline(runs, tmp_path):
    out = tmp_path / "cn"
    export(runs / "controlnet", out)
    card = check_card_basics(out, runs, "controlnet", "controlnet")
    layers = json.loads((out / "controlnet" / "config.json").read_text())["num_layers"]
    assert f"A ControlNet for the sana transformer of preset `tiny-sana`: {layers} blocks" in card.text
    code = snippet(card.text)
    assert f'SanaControlNetModel.from_pretrained("{out}", subfolder="controlnet"' in code and "SanaControlNetPipeline" in code


def test_the_card_names_a_hub_base_and_its_commit_and_survives_a_cache_that_is_gone_or_remote(runs, tmp_path):
    """A run from Hub weights whose caches were deleted or live in object storage still exports, and the card says so."""
    run = tmp_path / "moved"
    shutil.copytree(runs / "lora", run)
    (state_file,) = run.glob("checkpoints/step-*/state.json")
    state = json.loads(state_file.read_text())
    state["weights"] = {"kind": "hub", "source": "Efficient-Large-Model/Sana_600M_1024px_diffusers", "revision": None,
                        "commit": "0123abcd"}
    state["caches"] = [{"cache_root": str(tmp_path / "deleted"), "cache_generation": 3},
                       {"cache_url": "s3://bucket/cache", "cache_generation": 7}]
    state_file.write_text(json.dumps(state))
    out = tmp_path / "out"
    export(run, out, hub_repo="me/sana-lora")
    card = card_of(out)
    assert card.data.base_model == "Efficient-Large-Model/Sana_600M_1024px_diffusers"
    assert "revision `main`, commit `0123abcd`" in card.text
    assert f"Cache `{tmp_path / 'deleted'}` (generation 3): not readable" in card.text
    assert "Cache `s3://bucket/cache` (generation 7): remote, not opened" in card.text
    code = snippet(card.text)
    assert 'SanaPipeline.from_pretrained("Efficient-Large-Model/Sana_600M_1024px_diffusers"' in code
    assert 'pipe.load_lora_weights("me/sana-lora")' in code  # where it will be pushed
    assert "Efficient-Large-Model/Sana_600M_1024px_diffusers (revision main, commit 0123abcd)" in \
        json.loads((out / "training.json").read_text())["base"]  # recorded, not looked up on the (offline) Hub


def test_an_export_is_complete_or_absent_and_never_replaces_a_directory_that_is_not_an_export(runs, tmp_path, monkeypatch):
    import train.card

    out = tmp_path / "out"
    export(runs / "lora", out)
    before = {name: (out / name).read_bytes() for name in files(out)}

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")
    monkeypatch.setattr(train.card, "write_card", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export(runs / "full", out)
    assert {name: (out / name).read_bytes() for name in files(out)} == before  # the earlier export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp directory left
    monkeypatch.undo()
    export(runs / "full", out)  # an export replaces an earlier one whole
    assert "pytorch_lora_weights.safetensors" not in files(out) and (out / "transformer" / "config.json").exists()

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="files an export does not write"):
        export(runs / "lora", mine)
    assert files(mine) == ["notes.txt"]
    # a pipeline's folder holding an exported transformer is not a bare export: its other parts would go
    pipeline = tmp_path / "pipeline"
    shutil.copytree(out / "transformer", pipeline / "transformer")
    (pipeline / "vae").mkdir()
    (pipeline / "model_index.json").write_text("{}")
    with pytest.raises(ValueError, match="model_index.json, vae"):
        export(runs / "full", pipeline)
    assert (pipeline / "vae").is_dir() and (pipeline / "model_index.json").exists()


@pytest.fixture
def hub(monkeypatch):
    """HfApi's create_repo and upload_folder record their arguments (and the folder's files at upload) instead of
    calling the Hub."""
    from huggingface_hub import HfApi, RepoUrl

    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = {"repo_id": repo_id, **kwargs}
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, **kwargs):
        calls["upload_folder"] = {**kwargs, "files": files(Path(kwargs["folder_path"]))}

    def repo_info(self, repo_id, **kwargs):
        calls["repo_info"] = repo_id
        return types.SimpleNamespace(private=calls.get("existing_private", calls["create_repo"]["private"] is True))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(HfApi, "repo_info", repo_info)
    return calls


def test_push_to_hub_uploads_exactly_the_export_folder(runs, tmp_path, hub):
    from typer.testing import CliRunner

    from train.__main__ import tools

    out = tmp_path / "push"
    result = CliRunner().invoke(tools, ["export", str(runs / "lora"), "--out", str(out), "--push-to-hub", "me/tiny-lora",
                                        "--private"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert hub["create_repo"] == {"repo_id": "me/tiny-lora", "private": True, "exist_ok": True, "repo_type": "model"}
    upload = hub["upload_folder"]
    assert Path(upload["folder_path"]) == out.resolve() and upload["repo_id"] == "me/tiny-lora" and upload["repo_type"] == "model"
    assert upload["files"] == files(out) and "README.md" in upload["files"] and upload["commit_message"]
    assert upload["delete_patterns"] == "*"  # what earlier pushes left and this export lacks goes
    assert 'pipe.load_lora_weights("me/tiny-lora")' in (out / "README.md").read_text()
    assert "https://huggingface.co/me/tiny-lora" in result.output

    public = CliRunner().invoke(tools, ["export", str(runs / "full"), "--out", str(tmp_path / "public"), "--push-to-hub", "me/full"],
                                env=WIDE)
    # no --private: a new repository takes its owner's default visibility, an existing one keeps its own
    assert public.exit_code == 0 and hub["create_repo"]["private"] is None
    # --private onto an existing public repository is refused, not uploaded
    hub["existing_private"] = False
    del hub["upload_folder"]
    refused = CliRunner().invoke(tools, ["export", str(runs / "full"), "--out", str(tmp_path / "p2"), "--push-to-hub", "me/full",
                                         "--private"], env=WIDE)
    assert refused.exit_code != 0 and "is public" in refused.output and "upload_folder" not in hub


def test_a_failed_upload_says_how_to_log_in_and_leaves_the_export_intact(runs, tmp_path, monkeypatch):
    from huggingface_hub import HfApi
    from typer.testing import CliRunner

    from train.__main__ import EXIT_UPLOAD, tools

    def offline(self, *args, **kwargs):
        raise ConnectionError("Name or service not known")
    monkeypatch.setattr(HfApi, "create_repo", offline)
    out = tmp_path / "out"
    result = CliRunner().invoke(tools, ["export", str(runs / "lora"), "--out", str(out), "--push-to-hub", "me/tiny"], env=WIDE)
    assert result.exit_code == EXIT_UPLOAD
    message = " ".join(result.output.split())
    assert "huggingface-cli login" in message and "HF_TOKEN" in message and "Name or service not known" in message
    assert f"The export in {out} is complete and intact" in message and f"hf upload me/tiny {out} ." in message
    assert {"README.md", lora.DIFFUSERS_FILE, "training.json"} <= set(files(out))


def test_export_options_are_checked_before_anything_is_written(runs, tmp_path):
    from typer.testing import CliRunner

    from train.__main__ import tools

    bare = CliRunner().invoke(tools, ["export", str(runs / "lora"), "--out", str(tmp_path / "b"), "--push-to-hub", "tiny"], env=WIDE)
    assert bare.exit_code == 2 and "owner/name" in bare.output and not (tmp_path / "b").exists()
    private = CliRunner().invoke(tools, ["export", str(runs / "lora"), "--out", str(tmp_path / "a"), "--private"], env=WIDE)
    assert private.exit_code == 2 and "--push-to-hub" in private.output
    kohya = CliRunner().invoke(tools, ["export", str(runs / "full"), "--out", str(tmp_path / "b"), "--lora-format", "kohya"], env=WIDE)
    assert kohya.exit_code == 2 and "applies to LoRA adapters" in " ".join(kohya.output.split())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_lora_format_kohya_reaches_the_adapter_writer_and_the_card_names_the_file(runs, tmp_path):
    from safetensors.torch import load_file

    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    precompute(str(make_folder(tmp_path / "data", count=8)), "tiny-flux", tmp_path / "cache", workers=0, progress=False,
               validation_prompt=list(VALIDATION_PROMPTS))
    train(cfg(tmp_path / "cache", tmp_path / "run", "tiny-flux", steps=2, lora_rank=4, validate=False))
    written = export(tmp_path / "run", tmp_path / "out", lora_format="kohya")
    assert written.parent == (tmp_path / "out").resolve() and written.name != lora.DIFFUSERS_FILE
    card = card_of(tmp_path / "out")
    assert card.data.get("widget") is None and "left no validation grid" in card.text
    assert f'pipe.load_lora_weights("{(tmp_path / "out").resolve()}", weight_name="{written.name}")' in snippet(card.text)
    assert json.loads((tmp_path / "out" / "training.json").read_text())["lora_format"] == "kohya"
    assert written.name == lora.KOHYA_FILE and "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in load_file(written)
    with pytest.raises(ValueError, match="sana adapters are written as diffusers"):  # kohya's layout is Flux's alone
        export(runs / "lora", tmp_path / "sana", lora_format="kohya")
    assert not (tmp_path / "sana").exists()
