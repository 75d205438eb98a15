"""The memory plan of one card, big model: quantized bases and swapped blocks at real size (SD3.5 Large, Flux.1 [dev]),
and the rows the README gives."""

import functools

import pytest

from train.plan import plan
from train.plan_config import GiB, PlanConfig

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)


@functools.cache
def one_card(model: str, base_quant: str = "none", blocks_to_swap: int = 0) -> dict:
    """The plan of a rank-16 LoRA at 1024x1024, batch 1, bf16 base, checkpointing all, on a 16 GB card."""
    return plan(PlanConfig(model, lora_rank=16, weights_dtype="bf16", grad_checkpointing="all", batch_size=1, gpu_memory=16 * GiB,
                           base_quant=base_quant, blocks_to_swap=blocks_to_swap))


@pytest.mark.slow
def test_the_plan_counts_quantized_weights_at_their_size():
    """Linear weights at 1 byte (int8, fp8: plus a scale per row) or ~0.52 (nf4 with double quantization); norms,
    biases and embeddings in bf16; the adapters' gradients and states unchanged."""
    plans = {kind: one_card("flux-dev", kind) for kind in ("none", "int8", "fp8", "nf4")}
    linear = 11_901_408_320 - 30_000_000  # all but a few tens of millions of the weights are in Linear layers
    weights = {k: p["bytes"]["weights"] for k, p in plans.items()}
    assert weights["none"] - weights["int8"] == pytest.approx(linear, rel=0.01)
    assert weights["none"] - weights["nf4"] == pytest.approx(linear * (2 - 0.516), rel=0.01)
    assert weights["fp8"] < weights["int8"]
    for p in plans.values():
        assert p["bytes"]["optimizer states"] == plans["none"]["bytes"]["optimizer states"]
        assert p["trainable_parameters"] == plans["none"]["trainable_parameters"]
    # torchao's weight-only layers keep a bf16 copy of each weight they multiplied: one block's while it is recomputed
    assert plans["int8"]["bytes"]["activations"] > plans["none"]["bytes"]["activations"] == plans["nf4"]["bytes"]["activations"]


@pytest.mark.slow
def test_the_plan_keeps_swapped_blocks_off_the_device_but_three_in_flight():
    resident, swapped = one_card("flux-dev"), one_card("flux-dev", blocks_to_swap=20)
    single = 2 * (3072 * 3072 * 3 + 3 * 3072 + 3072 * 12288 + 12288 + 15360 * 3072 + 3072 + 3072 * 9216 + 9216 + 2 * 128)
    assert swapped["host_bytes"] == pytest.approx(20 * single, rel=1e-3)  # the last 20 blocks are single-stream blocks
    # the block the GPU is finishing, the one in use, the one arriving
    assert swapped["bytes"]["swapped blocks in flight"] == pytest.approx(3 * single, rel=1e-3)
    assert resident["bytes"]["weights"] - swapped["bytes"]["weights"] == pytest.approx(swapped["host_bytes"])
    assert resident["bytes"]["activations"] == pytest.approx(swapped["bytes"]["activations"], rel=0.01)
    with pytest.raises(ValueError, match="57 blocks"):
        plan(PlanConfig("flux-dev", lora_rank=16, blocks_to_swap=58))


# The README's rows: (model, --base-quant, --blocks-to-swap) -> the largest batch on a 16 GB and a 24 GB card (0: does not
# fit), what the card has left after the CUDA context
README_ROWS = [
    ("sd35-large", "none", 0, 0, 5), ("sd35-large", "int8", 0, 5, 11), ("sd35-large", "nf4", 0, 8, 14),
    ("sd35-large", "none", 8, 1, 7), ("sd35-large", "none", 16, 3, 9), ("sd35-large", "int8", 16, 7, 13),
    ("flux-dev", "none", 0, 0, 0), ("flux-dev", "int8", 0, 1, 4), ("flux-dev", "nf4", 0, 3, 7),
    ("flux-dev", "none", 20, 0, 2), ("flux-dev", "none", 44, 1, 5), ("flux-dev", "int8", 20, 2, 5),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,base_quant,blocks_to_swap,on_16,on_24", README_ROWS)
def test_the_readme_rows_of_one_card(model, base_quant, blocks_to_swap, on_16, on_24):
    """SD3.5 Large and Flux.1 [dev] LoRA rank 16 at 1024x1024, checkpointing all: the verdicts the README gives."""
    result = one_card(model, base_quant, blocks_to_swap)
    assert (result["largest_batch_by_card"]["16GB"], result["largest_batch_by_card"]["24GB"]) == (on_16, on_24)


