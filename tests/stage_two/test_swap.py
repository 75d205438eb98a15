"""Block swapping (train/swap.py) on tiny real transformers: training with swapped blocks is bit-identical to training
without, the swapped weights are on the device exactly while they are used (meta as the device), transfers are
started one block ahead in the forward and the backward, and an int8-quantized base swaps its int8 bytes."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from train import lora
from train.families import get_preset
from train.presets import build_transformer, model_forward, transformer_blocks
from train.swap import BlockSwap, Transfer

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

FAMILIES = {"tiny-flux": "flux", "tiny-sana": "sana"}


def lora_model(preset: str, dtype: torch.dtype = torch.float32, int8: bool = False) -> torch.nn.Module:
    """A seeded tiny transformer, frozen, with LoRA adapters whose lora_B is non-zero (so lora_A gets gradients)."""
    model = build_transformer(get_preset(preset), None, seed=0, dtype=dtype)
    if int8:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig())
    family = FAMILIES[preset]
    lora.add_lora(model, lora.lora_config(family, rank=4), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def inputs(preset: str, device="cpu") -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor]:
    """Noisy latents, timesteps, the family's text batch and a target, seeded. Flux: (2, 16, 4, 4); Sana: (2, 8, 4, 4)."""
    g = torch.Generator().manual_seed(2)
    channels = 16 if preset == "tiny-flux" else 8
    xt = torch.randn(2, channels, 4, 4, generator=g)
    batch = {"text": torch.randn(2, 6, 32, generator=g)}
    if preset == "tiny-flux":
        batch["pooled"] = torch.randn(2, 24, generator=g)
    else:
        batch["text_mask"] = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    t = torch.tensor([300.0, 700.0])
    target = torch.randn(xt.shape, generator=g)
    move = lambda x: x.to(device)  # noqa: E731
    return move(xt), move(t), {k: move(v) for k, v in batch.items()}, move(target)


def train(model: torch.nn.Module, preset: str, steps: int = 3, bf16: bool = False):
    """`steps` AdamW steps on a fixed batch; every loss and every adapter gradient (by name), per step."""
    xt, t, batch, target = inputs(preset)
    fn = model_forward(model, FAMILIES[preset], guidance=3.5)
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trained.values(), lr=1e-2)
    losses, grads = [], []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.mse_loss(fn(xt, t, batch).float(), target)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({name: p.grad.clone() for name, p in trained.items()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def assert_same_run(a, b, what: str):
    (losses_a, grads_a), (losses_b, grads_b) = a, b
    for step, (la, lb) in enumerate(zip(losses_a, losses_b)):
        assert torch.equal(la, lb), f"{what}: loss of step {step} differs ({la.item()} vs {lb.item()})"
    for step, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        assert ga.keys() == gb.keys() and any("lora_A" in k for k in ga)
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"{what}: gradient of {name} differs in step {step}"


def frozen(block: torch.nn.Module) -> list[torch.Tensor]:
    return [p for m in block.modules() for p in m._parameters.values() if p is not None and not p.requires_grad]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("preset", ["tiny-flux", "tiny-sana"])
def test_training_with_swapped_blocks_is_bit_identical(preset, bf16):
    reference = train(lora_model(preset), preset, bf16=bf16)
    checkpointed = lora_model(preset)
    checkpointed.enable_gradient_checkpointing()
    assert_same_run(train(checkpointed, preset, bf16=bf16), reference, "all blocks checkpointed")
    n = len(transformer_blocks(lora_model(preset)))
    for count in range(1, n + 1):
        model = lora_model(preset)
        swap = BlockSwap(transformer_blocks(model), count, torch.device("cpu"))
        swap.place(model, torch.device("cpu"))
        assert_same_run(train(model, preset, bf16=bf16), reference, f"{count} of {n} blocks swapped")
        assert swap.resident() == [0]  # kept for the next step's forward


class MetaOnly(TorchDispatchMode):
    """Fails any op on meta tensors that is also given a CPU tensor (meta kernels do not all check devices)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        devices = {x.device.type for x in tree_leaves((args, kwargs or {})) if isinstance(x, torch.Tensor)}
        if "meta" in devices and "cpu" in devices:
            raise AssertionError(f"{func} was given a tensor on cpu")
        return func(*args, **(kwargs or {}))


def test_swapped_weights_are_on_the_device_only_while_used():
    meta = torch.device("meta")
    with pytest.raises(AssertionError, match="on cpu"), MetaOnly():
        torch.nn.functional.linear(torch.empty(2, 3, device=meta), torch.randn(4, 3))

    model = lora_model("tiny-flux")
    blocks = transformer_blocks(model)
    swap = BlockSwap(blocks, 2, meta)
    swap.place(model, meta)
    swapped = blocks[1:]
    assert all(p.device == meta for name, p in model.named_parameters() if name.split(".")[0] != "single_transformer_blocks")
    assert all(p.device.type == "cpu" for b in swapped for p in frozen(b))
    assert all(p.device == meta for b in swapped for p in b.parameters() if p.requires_grad)
    assert sorted(swap.parameter_names(model)) == sorted(
        name for name, p in model.named_parameters() if p.device.type == "cpu")

    uses = []

    def check(k):
        def hook(module, args):
            uses.append(k)
            resident = swap.resident()
            assert k in resident and len(resident) <= 2, resident
            assert all(p.device == meta for p in frozen(swapped[k]))
            for j, block in enumerate(swapped):
                if j not in resident:
                    assert all(p.device.type == "cpu" for p in frozen(block)), f"block {j} is not in {resident}"
        return hook

    for k, block in enumerate(swapped):
        first = next(m for m in block.modules() if any(not p.requires_grad for p in m._parameters.values() if p is not None))
        first.register_forward_pre_hook(check(k))  # fires inside the checkpointed function: forward and recompute

    xt, t, batch, target = inputs("tiny-flux", meta)
    fn = model_forward(model, "flux", guidance=3.5)
    for step in range(2):
        uses.clear()
        with MetaOnly():
            torch.nn.functional.mse_loss(fn(xt, t, batch), target).backward()
        assert uses == [0, 1, 1, 0], f"step {step}: swapped blocks ran in the order {uses} (forward, then recomputed)"
        assert swap.resident() == [0]
        assert all(p.device == meta for p in frozen(swapped[0]))
        assert all(p.device.type == "cpu" for p in frozen(swapped[1]))
        assert all(p.grad is not None and p.grad.device == meta for b in swapped for p in b.parameters() if p.requires_grad)


class RecordingTransfer(Transfer):
    """Synchronous copies that log which swapped block each start and wait is for."""

    def __init__(self, device, swapped, log: list):
        super().__init__(device)
        self.block_of = {id(p): k for k, block in enumerate(swapped) for p in frozen(block)}
        self.log = log

    def start(self, tensors):
        self.log.append(f"start {self.block_of[id(tensors[0])]}")
        return super().start(tensors), self.block_of[id(tensors[0])]

    def wait(self, handle):
        copies, k = handle
        self.log.append(f"wait {k}")
        return super().wait(copies)


def test_transfers_start_one_block_ahead():
    model = lora_model("tiny-flux")
    blocks = transformer_blocks(model)  # double-stream, then two single-stream blocks: s_0 and s_1
    log = []
    blocks[0].register_forward_pre_hook(lambda *_: log.append("enter block before"))
    blocks[0].register_forward_hook(lambda *_: log.append("leave block before"))
    for k, block in enumerate(blocks[1:]):
        block.norm.register_forward_pre_hook(lambda *_, k=k: log.append(f"use {k}"))
    BlockSwap(blocks, 2, torch.device("cpu"), RecordingTransfer("cpu", blocks[1:], log))
    xt, t, batch, target = inputs("tiny-flux")
    loss = torch.nn.functional.mse_loss(model_forward(model, "flux", guidance=3.5)(xt, t, batch), target)
    assert log == ["enter block before", "start 0", "leave block before", "wait 0", "start 1", "use 0", "wait 1", "use 1"]
    log.clear()
    loss.backward()
    # s_1 was kept on the device for its recomputation; s_0 stays there for the next forward
    assert log == ["start 0", "use 1", "wait 0", "use 0"]
    log.clear()
    model_forward(model, "flux", guidance=3.5)(xt, t, batch)
    assert log == ["enter block before", "leave block before", "start 1", "use 0", "wait 1", "use 1"]


class MarkingTransfer(RecordingTransfer):
    """Also logs the marks of the device's work and the waits for them (CUDA events and their synchronize)."""

    def mark(self):
        self.log.append("mark")
        return self.log.count("mark") - 1

    def wait_for(self, mark):
        self.log.append(f"wait for mark {mark}")


def test_a_transfer_waits_until_the_device_is_done_with_the_block_two_uses_back():
    """The CPU runs ahead of the GPU: before a block's copy is allocated, the GPU must have finished the work queued
    before the previous block's use, so a dropped block's memory is free again and at most three blocks' copies exist."""
    model = lora_model("tiny-flux")
    blocks = transformer_blocks(model)
    log = []
    for k, block in enumerate(blocks):
        block.attn.register_forward_pre_hook(lambda *_, k=k: log.append(f"use {k}"))
    BlockSwap(blocks, 3, torch.device("cpu"), MarkingTransfer("cpu", blocks, log))
    xt, t, batch, target = inputs("tiny-flux")
    torch.nn.functional.mse_loss(model_forward(model, "flux", guidance=3.5)(xt, t, batch), target).backward()
    assert log == [
        "start 0", "wait 0", "mark", "start 1", "use 0",  # forward: nothing to wait for yet
        "wait 1", "mark", "wait for mark 0", "start 2", "use 1",
        "wait 2", "mark", "use 2",  # kept for backward
        "mark", "wait for mark 2", "start 1", "use 2",  # backward recomputes from the last block
        "wait 1", "mark", "wait for mark 3", "start 0", "use 1",
        "wait 0", "mark", "use 0",
    ]


@pytest.mark.parametrize("preset", ["tiny-flux", "tiny-sana"])
def test_validation_runs_swapped_blocks_without_checkpointing(preset, monkeypatch):
    xt, t, batch, _ = inputs(preset)
    family = FAMILIES[preset]
    with torch.no_grad():
        expected = model_forward(lora_model(preset), family, guidance=3.5)(xt, t, batch)
    model = lora_model(preset)
    blocks = transformer_blocks(model)
    swap = BlockSwap(blocks, len(blocks), torch.device("cpu"))

    def no_checkpoint(*args, **kwargs):
        raise AssertionError("checkpointed without grad")

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", no_checkpoint)
    with torch.no_grad():
        out = model_forward(model, family, guidance=3.5)(xt, t, batch)
    assert torch.equal(out, expected)
    assert swap.resident() == []  # no backward follows: nothing is kept


def test_int8_base_swaps_its_int8_bytes():
    from torchao.quantization import Int8Tensor

    reference = train(lora_model("tiny-flux", torch.bfloat16, int8=True), "tiny-flux", bf16=True)
    model = lora_model("tiny-flux", torch.bfloat16, int8=True)
    blocks = transformer_blocks(model)
    swap = BlockSwap(blocks, 2, torch.device("cpu"))
    quantized = [p for b in blocks[1:] for p in frozen(b) if isinstance(p, Int8Tensor)]
    rest = [p for b in blocks[1:] for p in frozen(b) if not isinstance(p, Int8Tensor)]
    assert quantized and all(p.dtype == torch.bfloat16 for p in quantized)  # the wrapper reports bf16, 2 bytes
    int8_weights = sum(p.numel() for p in quantized)
    other = sum(p.numel() * p.element_size() for p in rest)
    # 1 byte per quantized weight plus per-row scales (the widths here are 32 to 128)
    assert int8_weights + other < swap.host_bytes() < 1.2 * int8_weights + other
    assert_same_run(train(model, "tiny-flux", bf16=True), reference, "int8 base, 2 blocks swapped")


def test_sizes_description_and_removal():
    model = lora_model("tiny-flux")
    blocks = transformer_blocks(model)
    xt, t, batch, _ = inputs("tiny-flux")
    with torch.no_grad():
        expected = model_forward(model, "flux", guidance=3.5)(xt, t, batch)
    swap = BlockSwap(blocks, 3, torch.device("cpu"))
    sizes = [sum(p.numel() * p.element_size() for p in frozen(b)) for b in blocks]
    assert swap.host_bytes() == sum(sizes)
    assert swap.window_bytes() == sum(sizes)  # three blocks: the GPU may be finishing one while two are held
    assert swap.describe().startswith("block swapping: 3 of 3 blocks' frozen weights")
    model_forward(model, "flux", guidance=3.5)(xt, t, batch).sum().backward()
    swap.remove()
    assert swap.resident() == [] and all("forward" not in b.__dict__ for b in blocks)
    with torch.no_grad():
        assert torch.equal(model_forward(model, "flux", guidance=3.5)(xt, t, batch), expected)


def test_count_out_of_range_and_diffusers_checkpointing_are_rejected():
    model = build_transformer(get_preset("tiny-sana"), None, seed=0)
    blocks = transformer_blocks(model)
    for count in (0, 3):
        with pytest.raises(ValueError, match="swap 1 to 2"):
            BlockSwap(blocks, count, torch.device("cpu"))
    swap = BlockSwap(blocks, 1, torch.device("cpu"))
    model.enable_gradient_checkpointing()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        swap.place(model, torch.device("cpu"))
