"""Validation samples, export to the stock diffusers pipelines, and the sampling CLI (tiny presets, CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VALIDATION_PROMPTS, pipeline_kwargs, stock_pipeline
from PIL import Image

from shards import Bucket, Cache
from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.decode import LABEL_WIDTH, TITLE_HEIGHT, grid
from train.loop import train
from train.validate import reference_latents

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]


def cfg(cache, run, **kw):
    base = dict(model="tiny-sana", cache=cache, run=run, steps=4, batch_size=4, workers=0, progress=False, log_every=1,
                checkpoint_every=1000, lr=1e-3, validation_steps=3)
    return TrainConfig(**{**base, **kw})


def test_an_uncached_validation_prompt_stops_before_step_one(tiny_caches, tmp_path):
    with pytest.raises(ValueError) as e:
        train(cfg(tiny_caches["tiny-sana"], tmp_path, validation_prompt=[VALIDATION_PROMPTS[0], "a green triangle at dusk"]))
    message = str(e.value)
    assert "a green triangle at dusk" in message and VALIDATION_PROMPTS[0] not in message.split("Add them")[0]
    assert "make precompute DATA=<your data> MODEL=tiny-sana" in message and """PRECOMPUTE_ARGS='--validation-prompt "a green triangle at dusk"'""" in message
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("model", ["tiny-sana", "tiny-pixart"])
def test_validation_grid_has_a_row_per_prompt_and_the_dataset_row(tiny_caches, tmp_path, model):
    train(cfg(tiny_caches[model], tmp_path, model=model, validation_bucket=["256x256", "208x304"]))
    grid = Image.open(tmp_path / "samples-step00000004.png")
    # a title, a row per prompt (one cell per bucket), a row of decoded dataset latents; a label column
    cache = Cache(tiny_caches[model])
    down = cache.spec.latent.downsample
    buckets = [(256, 256), (208, 304)]
    references = [tuple(down * n for n in z.shape[-2:]) for _, z in reference_latents(cache, [Bucket(*b) for b in buckets])]
    rows = [buckets, buckets, references]
    cell_width = max(w for row in rows for _, w in row)
    assert grid.size == (LABEL_WIDTH + max(map(len, rows)) * (cell_width + 4),
                         TITLE_HEIGHT + sum(max(h for h, _ in row) + 4 for row in rows))


def test_grid_cells_are_equal_and_images_centred_in_them():
    red, blue, white = (255, 0, 0), (0, 0, 255), (255, 255, 255)
    wide, tall = Image.new("RGB", (32, 16), red), Image.new("RGB", (16, 32), blue)  # (width, height)
    canvas = grid("title", [("first", [wide, tall]), ("second", [tall])])
    x0, y0, cell = LABEL_WIDTH, TITLE_HEIGHT, 32 + 4  # cells as wide and rows as high as the largest image, 4 px apart
    assert canvas.size == (x0 + 2 * cell, y0 + 2 * cell)
    assert canvas.getpixel((x0 + 16, y0 + 4)) == white and canvas.getpixel((x0 + 16, y0 + 16)) == red  # wide: 8 px down
    assert canvas.getpixel((x0 + cell + 4, y0 + 16)) == white and canvas.getpixel((x0 + cell + 16, y0 + 16)) == blue  # tall: 8 px in
    assert canvas.getpixel((x0 + 16, y0 + cell + 16)) == blue and canvas.getpixel((x0 + cell + 16, y0 + cell + 16)) == white


def test_decoding_on_the_training_device(tiny_caches, tmp_path):
    train(cfg(tiny_caches["tiny-sana"], tmp_path, decode_device="device", validation_bucket=["256x256"]))
    assert (tmp_path / "samples-step00000004.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-sana", "tiny-pixart", "tiny-sd3"])
def test_exported_weights_generate_through_the_stock_pipeline(tiny_caches, tmp_path, model):
    train(cfg(tiny_caches[model], tmp_path / "run", model=model, ema_decay=0.5, validate=False))
    out = subprocess.run([sys.executable, "-m", "train", "export", str(tmp_path / "run"), "--ema", "--out", str(tmp_path / "export")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    ckpt = complete_checkpoints(tmp_path / "run")[-1]
    shadow = torch.load(ckpt / "ema.pt", weights_only=True)["shadow_params"]
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
    trained = load_file(ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == trained.keys() and any(not torch.equal(exported[k], trained[k]) for k in exported)  # EMA, not raw
    from train.families import get_preset
    from train.presets import build_transformer

    buffers = {name for name, _ in build_transformer(get_preset(model), None, 0).named_buffers()}  # SD3's pos_embed
    assert sorted(t.numel() for k, t in exported.items() if k not in buffers) == sorted(t.numel() for t in shadow)
    assert json.loads((tmp_path / "export" / "transformer" / "training.json").read_text())["weights"] == "ema"

    transformer = get_preset(model).transformer_class.from_pretrained(tmp_path / "export", subfolder="transformer")
    pipe = stock_pipeline(model, transformer, tmp_path / "parts")
    pipe.save_pretrained(tmp_path / "pipeline")  # and back: a pipeline directory a user would load
    pipe = type(pipe).from_pretrained(tmp_path / "pipeline")
    image = pipe(VALIDATION_PROMPTS[0], height=256, width=256, num_inference_steps=2, guidance_scale=4.5,
                 generator=torch.Generator().manual_seed(0), output_type="np", **pipeline_kwargs(model)).images[0]
    assert image.shape == (256, 256, 3) and float(image.std()) > 0


def test_sample_cli_writes_one_image_per_prompt_and_bucket(tiny_caches, tmp_path):
    train(cfg(tiny_caches["tiny-pixart"], tmp_path / "run", model="tiny-pixart", validate=False))
    out = subprocess.run([sys.executable, "-m", "train", "sample", str(tmp_path / "run"), "--prompt-cache", str(tiny_caches["tiny-pixart"]),
                          "--validation-bucket", "256x256", "--validation-bucket", "304x208", "--validation-steps", "3", "--out", str(tmp_path / "samples")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    images = sorted((tmp_path / "samples").glob("*.png"))
    assert len(images) == 2 * len(VALIDATION_PROMPTS)
    assert {Image.open(p).size for p in images} == {(256, 256), (208, 304)}
    from typer.testing import CliRunner

    from train.__main__ import tools

    missing = CliRunner().invoke(tools, ["sample", str(tmp_path / "run"), "--prompt-cache", str(tiny_caches["tiny-pixart"]),
                                         "--validation-prompt", "never cached"])
    assert missing.exit_code == 2 and "never cached" in missing.output
