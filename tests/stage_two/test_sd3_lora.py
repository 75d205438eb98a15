"""SD3 end to end (cache -> train -> validate -> export -> stock StableDiffusion3Pipeline) and LoRA on every family."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VALIDATION_PROMPTS, pipeline_kwargs, stock_pipeline
from PIL import Image

from shards import Cache, prompt_key
from train.checkpoint import complete_checkpoints
from train.config import TrainConfig
from train.families import get_preset
from train.families.sd3 import joint_tokens
from train.loop import train
from train.presets import build_transformer

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

ROOT = Path(__file__).resolve().parents[2]


def cfg(cache, run, model, **kw):
    base = dict(model=model, cache=cache, run=run, steps=6, batch_size=4, workers=0, progress=False, log_every=1,
                checkpoint_every=1000, lr=1e-3, validation_steps=2, precision="fp32", validate=False)
    return TrainConfig(**{**base, **kw})


def _joint(cache: Cache, fields: dict, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cached prompt as the trainer feeds it to the transformer."""
    from train.data import TextLayout

    layout = TextLayout.of(cache)
    batch = layout.collate([{k: v.float() for k, v in layout.caption(fields).items()}])
    return joint_tokens(batch, width, torch.float32), batch["pooled"]


@pytest.mark.parametrize("drop_t5", [False, True], ids=["clip+t5", "t5-dropped"])
def test_sd3_cache_holds_what_the_stock_pipeline_computes(tmp_path, drop_t5):
    """Encoders loaded with from_pretrained; the cached fields rebuild StableDiffusion3Pipeline.encode_prompt's
    prompt_embeds and pooled_prompt_embeds exactly (at the storage dtype), and the latents carry the VAE's
    shift and scaling once."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    pipe = stock_pipeline("tiny-sd3", build_transformer(get_preset("tiny-sd3"), None, 0), tmp_path / "parts")
    if drop_t5:
        pipe.text_encoder_3 = pipe.tokenizer_3 = None
    data = make_folder(tmp_path / "data", 4)
    precompute(str(data), "tiny-sd3", tmp_path / "cache", pretrained=str(tmp_path / "parts"), workers=0, progress=False,
               drop_t5=drop_t5, validation_prompt=VALIDATION_PROMPTS[:1])
    cache = Cache(tmp_path / "cache")
    fp = cache.fingerprint
    assert (fp["vae"]["shift_factor"], fp["vae"]["scaling_factor"]) == (0.0609, 1.5305)
    assert fp["text_encoder"]["layout"]["t5"] == ("dropped" if drop_t5 else "stored")
    assert set(fp["text_encoder"]["modules"]) == {"text_encoder", "text_encoder_2"} | (set() if drop_t5 else {"text_encoder_3"})

    width = pipe.transformer.config.joint_attention_dim
    prompt = cache.prompts()[prompt_key(VALIDATION_PROMPTS[0])]
    embeds, _, pooled, _ = pipe.encode_prompt(VALIDATION_PROMPTS[0], None, None, do_classifier_free_guidance=False, max_sequence_length=32)
    joint, cached_pooled = _joint(cache, prompt.fields, width)
    assert joint.shape == embeds.shape == (1, 77 + 32, width)
    assert torch.equal(joint, embeds.bfloat16().float()) and torch.equal(cached_pooled, pooled.bfloat16().float())

    sample = cache[0]
    source = bytes(sample["source"].numpy()).decode()
    pixels = torch.from_numpy(np.array(Image.open(data / source).convert("RGB"))).permute(2, 0, 1)
    assert tuple(sample["crop"][2:].tolist()) == tuple(pixels.shape[1:])  # the sample images fill their buckets exactly
    with torch.no_grad():
        posterior = pipe.vae.encode(pixels[None].float() / 127.5 - 1).latent_dist
    expected = (posterior.mean - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    assert torch.allclose(sample["latent_mean"].float(), expected[0], atol=0.02, rtol=0.02)


def test_sd3_end_to_end_through_the_stock_pipeline(tiny_caches, tmp_path):
    """Train with SD3's loss weighting and zeroed caption dropout, validate, export, generate with the stock pipeline."""
    run = tmp_path / "run"
    result = train(cfg(tiny_caches["tiny-sd3"], run, "tiny-sd3", steps=8, weighting_scheme="cosmap", caption_dropout=0.3,
                       validate=True, validation_bucket=["256x256"]))
    assert result["step"] == 8 and torch.isfinite(torch.tensor(result["last_loss"]))
    assert Image.open(run / "samples-step00000008.png").height >= 28 + 3 * 256
    out = subprocess.run([sys.executable, "-m", "train", "export", str(run), "--out", str(tmp_path / "export")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    from diffusers import SD3Transformer2DModel

    pipe = stock_pipeline("tiny-sd3", SD3Transformer2DModel.from_pretrained(tmp_path / "export", subfolder="transformer"), tmp_path / "parts")
    image = pipe(VALIDATION_PROMPTS[0], height=256, width=256, num_inference_steps=2, guidance_scale=4.5, output_type="np",
                 generator=torch.Generator().manual_seed(0), **pipeline_kwargs("tiny-sd3")).images[0]
    assert image.shape == (256, 256, 3) and float(image.std()) > 0


def test_weighting_scheme_is_refused_for_ddpm(tiny_caches, tmp_path):
    with pytest.raises(ValueError, match="trains with DDPM"):
        train(cfg(tiny_caches["tiny-pixart"], tmp_path, "tiny-pixart", weighting_scheme="cosmap"))


def test_zeroed_caption_dropout_is_sd3s_default(tiny_caches):
    from train.data import TrainingSamples
    from train.model import null_caption

    sd3 = TrainingSamples(tiny_caches["tiny-sd3"], 0, 1.0, null_caption(cfg("c", "r", "tiny-sd3"), get_preset("tiny-sd3")))
    cond = sd3[(0, 0)]["cond"]
    assert set(cond) == {"clip", "pooled", "text"} and all(not v.any() for v in cond.values())
    sana = TrainingSamples(tiny_caches["tiny-sana"], 0, 1.0, null_caption(cfg("c", "r", "tiny-sana"), get_preset("tiny-sana")))
    assert sana[(0, 0)]["cond"]["text"].abs().sum() > 0  # the cached empty caption, not zeros


@pytest.mark.parametrize("model", ["tiny-pixart", "tiny-sana", "tiny-sd3"])
def test_lora_trains_only_adapters_resumes_exactly_and_loads_into_the_stock_pipeline(tiny_caches, tmp_path, model):
    lora = dict(lora_rank=4, lora_alpha=8, lr=1e-2, checkpoint_every=3)
    straight = train(cfg(tiny_caches[model], tmp_path / "straight", model, **lora))
    train(cfg(tiny_caches[model], tmp_path / "resumed", model, **{**lora, "steps": 3}))
    resumed = train(cfg(tiny_caches[model], tmp_path / "resumed", model, **lora))
    assert resumed["last_loss"] == straight["last_loss"]

    ckpt = complete_checkpoints(tmp_path / "straight")[-1]
    assert not (ckpt / "transformer" / "diffusion_pytorch_model.safetensors").exists()  # the frozen base is not saved again
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    from train.export import load_model

    trained, _, _ = load_model(ckpt, ema=False)
    base = build_transformer(get_preset(model), None, 0)
    adapters = {n for n, _ in trained.named_parameters() if "lora_" in n}
    assert len(optimizer["state"]) == len(adapters)  # moments for the adapters alone
    base_weights = dict(base.named_parameters())
    for name, p in trained.named_parameters():
        if name not in adapters:  # peft wraps adapted layers: their weight moves under base_layer
            assert torch.equal(p, base_weights[name.replace("base_layer.", "")]), name
    assert any(p.abs().sum() > 0 for n, p in trained.named_parameters() if "lora_B" in n)  # B starts at zero

    out = subprocess.run([sys.executable, "-m", "train", "export", str(tmp_path / "straight"), "--out", str(tmp_path / "lora")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    pipe = stock_pipeline(model, base, tmp_path / "parts")

    def generate():
        return pipe(VALIDATION_PROMPTS[0], height=256, width=256, num_inference_steps=2, guidance_scale=4.5, output_type="latent",
                    generator=torch.Generator().manual_seed(0), **pipeline_kwargs(model)).images

    before = generate()
    if model == "tiny-pixart":  # PixArtSigmaPipeline has no LoRA loader; PixArt-Sigma's LoRAs load through peft
        from peft import PeftModel

        pipe.transformer = PeftModel.from_pretrained(pipe.transformer, tmp_path / "lora")
    else:
        pipe.load_lora_weights(tmp_path / "lora")
    after = generate()
    assert torch.isfinite(after).all() and not torch.allclose(before, after)

    if model == "tiny-pixart":  # the adapters folded into a plain transformer generate the same
        from train.export import export

        export(tmp_path / "straight", tmp_path / "merged", merge_lora=True)
        merged = get_preset(model).transformer_class.from_pretrained(tmp_path / "merged", subfolder="transformer")
        assert not any("lora" in n for n, _ in merged.named_parameters())
        pipe.transformer = merged
        assert torch.allclose(generate(), after, rtol=1e-4, atol=1e-3)
