"""The memory plan of FLUX.2 [dev] at real size: the published transformer's parameters, and LoRA on one 24, 48 or 80 GB
card with an int8 or nf4 base and block swap, for a text-to-image sample and for an edit sample whose reference image's
tokens join the target's (the rows the README gives)."""

import functools

import pytest

from train.plan import plan
from train.plan_config import GiB, PlanConfig

pytestmark = pytest.mark.model  # builds the transformer on the meta device through diffusers


@functools.cache
def lora(base_quant: str, blocks_to_swap: int, references: int) -> dict:
    """A rank-16 LoRA at 1024x1024, batch 1, bf16 base, checkpointing all; `references` reference images of 1024x1024
    per sample (the pipelines' largest)."""
    return plan(PlanConfig("flux2-dev", lora_rank=16, weights_dtype="bf16", grad_checkpointing="all", batch_size=1,
                           gpu_memory=24 * GiB, base_quant=base_quant, blocks_to_swap=blocks_to_swap, references=references,
                           reference_size="1024x1024" if references else None))


@pytest.mark.slow
def test_the_plan_counts_the_published_transformer():
    """`python -m train plan flux2-dev`: 32,223,281,152 parameters, the published config's, and a 1024x1024 sample's
    4,096 tokens (16 x 16 pixels each) beside 512 caption tokens, plus 4,096 for the default reference."""
    result = plan(PlanConfig("flux2-dev", batch_size=1, grad_checkpointing="all"))
    assert result["parameters"] == result["trainable_parameters"] == 32_223_281_152
    assert result["references"] == {"count": 1, "size": "1024x1024", "tokens": 4096}
    assert result["largest_batch_by_card"]["80GB"] == 0  # full fine-tuning needs more than one card
    # a trainer without a cache keeps the VAE and Mistral Small 3.1 (LM head and vision tower included) resident in bf16
    assert result["peak_with_encoders_resident"] - result["predicted_peak"] == 2 * published_encoders()


def published_encoders() -> int:
    """The parameters of what FLUX.2 [dev]'s pipeline loads beside the transformer, counted on the meta device:
    AutoencoderKLFlux2 with its default (the published) config, and Mistral3ForConditionalGeneration with the
    config.json of mistralai/Mistral-Small-3.1-24B-Instruct-2503 (the numbers that decide the count)."""
    import torch
    from diffusers import AutoencoderKLFlux2
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config=dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                         max_position_embeddings=131072, tie_word_embeddings=False),
        vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                           num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14, num_channels=3),
        multimodal_projector_bias=False, projector_hidden_act="gelu", spatial_merge_size=2, tie_word_embeddings=False)
    with torch.device("meta"):
        models = [AutoencoderKLFlux2(), Mistral3ForConditionalGeneration(config)]
    return sum(p.numel() for model in models for p in model.parameters())


# (--base-quant, --blocks-to-swap, references per sample) -> the largest batch on a 24, 48 and 80 GB card (0: does not fit)
README_ROWS = [
    ("int8", 0, 0, 0, 2, 8), ("int8", 44, 0, 1, 6, 12), ("nf4", 0, 0, 1, 5, 11),
    ("int8", 0, 1, 0, 1, 4), ("int8", 52, 1, 1, 3, 7), ("nf4", 0, 1, 0, 3, 6),
]


@pytest.mark.slow
@pytest.mark.parametrize("base_quant,blocks_to_swap,references,on_24,on_48,on_80", README_ROWS)
def test_the_readme_rows(base_quant, blocks_to_swap, references, on_24, on_48, on_80):
    result = lora(base_quant, blocks_to_swap, references)
    cards = result["largest_batch_by_card"]
    assert result["trainable_parameters"] == 100_663_296  # rank 16 on the family's targets
    assert (cards["24GB"], cards["48GB"], cards["80GB"]) == (on_24, on_48, on_80)
    assert result["tokens_per_sample"] == 4096 and (result["references"] or {}).get("tokens", 0) == 4096 * references


@pytest.mark.slow
def test_a_reference_costs_activations_not_weights_and_swapping_moves_blocks_to_the_host():
    t2i, edit, swapped = lora("int8", 0, 0), lora("int8", 0, 1), lora("int8", 52, 1)
    assert edit["bytes"]["weights"] == t2i["bytes"]["weights"] and edit["trainable_parameters"] == t2i["trainable_parameters"]
    assert edit["bytes"]["activations"] > 1.5 * t2i["bytes"]["activations"]  # twice the image tokens, the same caption
    assert swapped["host_bytes"] > 20 * GiB and edit["bytes"]["weights"] - swapped["bytes"]["weights"] > 20 * GiB
    with pytest.raises(ValueError, match="blocks-to-swap with --base-quant nf4"):
        lora("nf4", 8, 0)
