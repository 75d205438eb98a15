"""What the ControlNet tests share: caches built by stage one whose images have an edge map as control image, the
run's options, and a ControlNet as after training."""

import torch
from conftest import VALIDATION_PROMPTS
from PIL import Image, ImageFilter, ImageOps

from train.config import TrainConfig

MODELS = ["tiny-sd3", "tiny-sana"]


def build_caches(root, plain: bool = False) -> dict:
    """Stage one's caches of 8 sample images, each with an edge map as its control image (NAME.control.png), per
    model; with `plain`, one tiny-sana cache of the same images without control latents."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    data = make_folder(root / "data", count=8)
    for image in sorted(data.glob("?????.png")):
        ImageOps.grayscale(Image.open(image)).filter(ImageFilter.FIND_EDGES).convert("RGB").save(image.with_suffix(".control.png"))
    out = {}
    for model in MODELS:
        precompute(str(data), model, root / model, workers=0, progress=False, control=True, validation_prompt=VALIDATION_PROMPTS)
        out[model] = root / model
    if plain:
        precompute(str(data), "tiny-sana", root / "plain", workers=0, progress=False)
        out["plain"] = root / "plain"
    return out


def cfg(cache, run, model, **kw):
    base = dict(model=model, cache=cache, run=run, steps=8, batch_size=2, workers=0, progress=False, log_every=1,
                checkpoint_every=4, lr=5e-3, precision="fp32", validate=False, controlnet=True, caption_dropout=0.25,
                ema_decay=0.9)
    return TrainConfig(**{**base, **kw})


def perturbed(net: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A ControlNet whose zero-initialised output projections hold small random weights, as after training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.startswith(("controlnet_blocks.", "input_block.", "pos_embed_input.")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return net
