import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One compute thread in this process and in every process a test starts: results do not depend on how a
# kernel splits work, and on a busy machine no OpenMP team spins waiting for a core another process holds.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

from shards import Field  # noqa: E402

SCHEMA = {
    "latent_mean": Field(torch.bfloat16),
    "latent_std": Field(torch.bfloat16),
    "text": Field(torch.bfloat16, ragged=True),
    "original_size": Field(torch.int32),
}
FINGERPRINT = {"vae": {"id": "tiny-vae", "scaling_factor": 0.13025}, "text_encoder": {"id": "tiny-t5", "max_length": 300}}
BUCKETS = [(64, 64), (48, 80), (80, 48)]


def make_sample(i: int, bucket=None, *, dim: int = 16, channels: int = 4) -> tuple[str, tuple[int, int], dict]:
    """A deterministic sample: key, bucket, fields (text length varies with i, may be 0)."""
    bucket = bucket or BUCKETS[i % len(BUCKETS)]
    g = torch.Generator().manual_seed(i)
    h, w = bucket[0] // 8, bucket[1] // 8
    fields = {
        "latent_mean": torch.randn(channels, h, w, generator=g).bfloat16(),
        "latent_std": torch.rand(channels, h, w, generator=g).bfloat16(),
        "text": torch.randn(i % 7, dim, generator=g).bfloat16(),
        "original_size": torch.tensor([bucket[0] + i, bucket[1] + i], dtype=torch.int32),
    }
    return f"key{i:05d}", bucket, fields


def write_cache(root, indices, **kwargs):
    """A cache of `make_sample(i)` for each of `indices`, written in one writer session; its manifest."""
    from shards import ShardWriter

    with ShardWriter(root, FINGERPRINT, SCHEMA, **kwargs) as w:
        for i in indices:
            w.write(*make_sample(i))
    return w.manifest


@pytest.fixture
def sample():
    return make_sample


VALIDATION_PROMPTS = ("a large red circle on a blue background", "a small yellow square on a black background")


@pytest.fixture(scope="session")
def tiny_caches(tmp_path_factory):
    """Caches of 8 sample images built by stage one for each tiny preset, with two validation prompts."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    root = tmp_path_factory.mktemp("caches")
    data = make_folder(root / "data", count=8)
    out = {}
    for model in ("tiny-sana", "tiny-pixart", "tiny-sd3"):
        precompute(str(data), model, root / model, workers=0, progress=False, validation_prompt=VALIDATION_PROMPTS)
        out[model] = root / model
    return out


def stock_pipeline(model: str, transformer, parts: Path):
    """The family's stock diffusers pipeline around `transformer`, with the tiny preset's VAE and text
    encoder(s) saved to `parts` and loaded back with `from_pretrained`."""
    import diffusers
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, Gemma2Model, T5EncoderModel

    from precompute.presets import get_preset, save_tiny

    save_tiny(get_preset(model), parts)
    tok = lambda sub: AutoTokenizer.from_pretrained(parts / sub)  # noqa: E731
    if model == "tiny-sana":
        return diffusers.SanaPipeline(tokenizer=tok("tokenizer"), text_encoder=Gemma2Model.from_pretrained(parts / "text_encoder"),
                                      vae=diffusers.AutoencoderDC.from_pretrained(parts / "vae"), transformer=transformer,
                                      scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
    if model == "tiny-pixart":
        return diffusers.PixArtSigmaPipeline(tokenizer=tok("tokenizer"), text_encoder=T5EncoderModel.from_pretrained(parts / "text_encoder"),
                                             vae=diffusers.AutoencoderKL.from_pretrained(parts / "vae"), transformer=transformer,
                                             scheduler=diffusers.DPMSolverMultistepScheduler())
    return diffusers.StableDiffusion3Pipeline(
        tokenizer=tok("tokenizer"), text_encoder=CLIPTextModelWithProjection.from_pretrained(parts / "text_encoder"),
        tokenizer_2=tok("tokenizer_2"), text_encoder_2=CLIPTextModelWithProjection.from_pretrained(parts / "text_encoder_2"),
        tokenizer_3=tok("tokenizer_3"), text_encoder_3=T5EncoderModel.from_pretrained(parts / "text_encoder_3"),
        vae=diffusers.AutoencoderKL.from_pretrained(parts / "vae"), transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))


def pipeline_kwargs(model: str) -> dict:
    """Generation options of the tiny presets: their token limits, no Sana instruction prompt."""
    return {"tiny-sana": {"complex_human_instruction": None, "max_sequence_length": 64},
            "tiny-pixart": {"max_sequence_length": 64}, "tiny-sd3": {"max_sequence_length": 32}}[model]


def train_processes(nproc: int, run, *args: str):
    """`python -m train *args --run-dir RUN` in one process, or in `nproc` under torchrun (one compute thread each);
    fails the test with the trainer's stderr when it fails."""
    import subprocess

    runner = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc_per_node", str(nproc)]
    out = subprocess.run([*runner, "-m", "train", *args, "--run-dir", str(run)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def precompute_processes(nproc: int, data: Path, cache: Path, *args: str):
    """`python -m precompute DATA --cache CACHE *args` in `nproc` processes under torchrun, one compute thread each (CPU
    kernels split work by thread and round differently); returns the finished process, whatever its exit code."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                           "-m", "precompute", str(data), "--cache", str(cache), "--no-progress", *args],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)


def stage_one_cache(root: Path, model: str, count: int = 8) -> Path:
    """ROOT/cache: stage one's cache of `count` sample images for `model`, with the validation prompts."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    data = make_folder(root / "data", count=count)
    precompute(str(data), model, root / "cache", workers=0, progress=False, validation_prompt=VALIDATION_PROMPTS)
    return root / "cache"


def losses(run: Path) -> list[float]:
    """A run's logged losses, step by step (metrics.jsonl)."""
    import json

    return [json.loads(line)["loss"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if "loss" in line]


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds, by file and name: its weights (safetensors) and the optimizer's, scheduler's and
    EMA's state (.pt)."""
    from safetensors.torch import load_file

    out = {}
    for file in sorted(Path(checkpoint).rglob("*")):
        if file.suffix == ".safetensors":
            tensors = load_file(file)
        elif file.suffix == ".pt":
            flat, _ = torch.utils._pytree.tree_flatten_with_path(torch.load(file, weights_only=True))
            tensors = {torch.utils._pytree.keystr(k): v for k, v in flat if isinstance(v, torch.Tensor)}
        else:
            continue
        out.update({f"{file.relative_to(checkpoint)}{name}": t for name, t in tensors.items()})
    return out


def assert_same_checkpoints(a: Path, b: Path) -> None:
    """Two runs' checkpoints at each step both saved are equal bit for bit: weights, optimizer moments, the rest."""
    from train.checkpoint import complete_checkpoints

    steps_a = {c.name: c for c in complete_checkpoints(a)}
    steps_b = {c.name: c for c in complete_checkpoints(b)}
    both = sorted(steps_a.keys() & steps_b.keys())
    assert both, f"no checkpoint step saved by both {a} and {b}"
    for step in both:
        x, y = checkpoint_tensors(steps_a[step]), checkpoint_tensors(steps_b[step])
        assert x.keys() == y.keys() and any(".safetensors" in k for k in x) and any("optimizer.pt" in k for k in x), step
        differ = [k for k in x if not torch.equal(x[k], y[k])]
        assert not differ, f"{step}: {len(differ)} of {len(x)} tensors differ, e.g. {differ[:3]}"


def record_calls(model) -> list[dict]:
    """Every call's keyword arguments to `model` (cloned), and what it returned under "out"."""
    calls = []

    def pre(module, args, kwargs):
        calls.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    def post(module, args, kwargs, out):
        calls[-1]["out"] = out[0].clone()

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)
    return calls


def captioned_cache(root: Path, model: str, long_caption: str, prompt: str, seed: int = 3) -> dict:
    """Stage one's `model` cache (ROOT/cache, fp32) of three sample images listed in a metadata.jsonl: the first with
    two captions, the third with `long_caption` (over the token limit), and `prompt` as validation prompt. Returns
    root, data, cache, the run's summary and each image's captions."""
    import json
    import random

    from precompute.run import main as precompute
    from precompute.sample_data import draw_sample

    data = root / "data"
    data.mkdir()
    rng = random.Random(seed)
    captions, rows = {}, []
    for i in range(3):
        img, caption = draw_sample(rng)
        img.save(data / f"{i}.png")
        captions[f"{i}.png"] = [caption, f"{caption} with a stripe"] if i == 0 else [long_caption if i == 2 else caption]
        rows.append(json.dumps({"file_name": f"{i}.png", "text": captions[f"{i}.png"]}))
    (data / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    summary = precompute(str(data), model, root / "cache", validation_prompt=[prompt], workers=0, progress=False, batch_size=2,
                         storage_dtype="fp32")
    return {"root": root, "data": data, "cache": root / "cache", "summary": summary, "captions": captions}


def stage_one_crop(data: Path, sample):
    """The PIL image stage one encoded for a cached `sample` of a folder at `data`: its input resized to cover the
    bucket (bicubic), then cropped at the recorded (top, left), as `precompute.images` prepares it."""
    from PIL import Image

    (h, w), (top, left, bh, bw) = sample["original_size"].tolist(), sample["crop"].tolist()
    img = Image.open(data / bytes(sample["source"].tolist()).decode()).convert("RGB")
    k = max(bh / h, bw / w)
    return img.resize((max(bw, round(w * k)), max(bh, round(h * k))), Image.BICUBIC).crop((left, top, left + bw, top + bh))
