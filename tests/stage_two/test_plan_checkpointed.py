"""The plan of a checkpointed run meets its dry run within 10 %: the backward pass that recomputes the blocks holds
their forward's temporaries and their intermediates' gradients beside their saved tensors, and LoRA's fp32 adapters
copy each adapted layer's input under autocast; the plan traces both."""

from pathlib import Path

import pytest
from conftest import VALIDATION_PROMPTS

from train.config import TrainConfig
from train.loop import train

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

MODELS = ("tiny-sd3", "tiny-flux", "tiny-sana")


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """Caches of 8 sample images built by stage one, per model."""
    from precompute.run import main as precompute
    from precompute.sample_data import make_folder

    root = tmp_path_factory.mktemp("checkpointed")
    data = make_folder(root / "data", count=8)
    for model in MODELS:
        precompute(str(data), model, root / model, workers=0, progress=False, validation_prompt=VALIDATION_PROMPTS)
    return {model: root / model for model in MODELS}


@pytest.mark.parametrize("model,options", [
    ("tiny-sd3", dict(lora_rank=4, precision="bf16", weights_dtype="bf16")),
    ("tiny-flux", dict(lora_rank=4, precision="bf16", weights_dtype="bf16")),
    ("tiny-sana", dict(lora_rank=4, precision="bf16", weights_dtype="bf16")),
    ("tiny-flux", dict(lora_rank=0, precision="fp32", weights_dtype="fp32")),
], ids=["sd3-lora", "flux-lora", "sana-lora", "flux-full"])
def test_a_checkpointed_dry_run_meets_its_plan_within_10_percent(caches, tmp_path, model, options):
    result = train(TrainConfig(model=model, cache=caches[model], run=tmp_path, batch_size=8, workers=0, progress=False,
                               grad_checkpointing="all", dry_run=True, validate=False, resume="", **options))
    assert abs(result["predicted_peak"] / result["measured_peak"] - 1) <= 0.10, result
