"""The EMA's shadow weights live on the configured device, after construction, updates and resume.

No second device exists on a CPU machine: the `meta` device stands in for it, and a recording wrapper of
diffusers' `EMAModel.step` shows which tensors each update is computed with."""

import torch
from diffusers.training_utils import EMAModel

from train.ema import EMA


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


def record_steps(ema: EMA) -> list:
    """Devices of the parameters and of the shadows every update of `ema` computes with."""
    seen = []
    real = ema.model.step

    def step(parameters):
        parameters = list(parameters)
        seen.append(({p.device.type for p in parameters}, {s.device.type for s in ema.model.shadow_params}))
        return real(parameters)

    ema.model.step = step
    return seen


def test_shadows_on_another_device_from_construction_and_every_update_computed_there():
    weights = params()  # the training device's weights: cpu here
    ema = EMA(weights, 0.9, "meta")  # "--ema-device" elsewhere
    assert {s.device.type for s in ema.shadow_params} == {"meta"}
    seen = record_steps(ema)
    ema.step(weights)
    ema.step(weights)
    assert seen == [({"meta"}, {"meta"})] * 2  # the weights were copied over first; nothing mixes devices
    assert {s.device.type for s in ema.shadow_params} == {"meta"}


def test_a_resumed_ema_goes_back_to_its_device_with_this_runs_decay():
    saved = EMA(params(), 0.9, "cpu")
    saved.step(params(1))
    state = saved.state_dict()  # checkpoints load to the CPU
    resumed = EMA(params(), 0.5, "meta")
    resumed.load_state_dict(state)
    assert {s.device.type for s in resumed.shadow_params} == {"meta"} and resumed.decay == 0.5
    assert resumed.model.optimization_step == 1
    seen = record_steps(resumed)
    resumed.step(params(2))
    assert seen == [({"meta"}, {"meta"})]


def test_the_average_is_diffusers_emamodel():
    weights = params()
    ours, theirs = EMA(weights, 0.9, "cpu"), EMAModel(weights, decay=0.9, foreach=True)
    for seed in range(1, 4):
        with torch.no_grad():
            for w, new in zip(weights, params(seed)):
                w.copy_(new)
        ours.step(weights)
        theirs.step(weights)
    for a, b in zip(ours.shadow_params, theirs.shadow_params):
        assert torch.equal(a, b)
    assert all(s.dtype == torch.float32 for s in EMA([p.bfloat16() for p in weights], 0.9, "cpu").shadow_params)


def test_under_fsdp_cpu_offload_the_ema_lives_beside_the_sharded_weights(tmp_path):
    """FSDP2 with CPU offload keeps parameters as CPU DTensors: the EMA goes there too (on CUDA the training
    device would be the GPU, and a GPU EMA of CPU DTensors cannot be updated); one process, gloo."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from train.config import TrainConfig
    from train.model import ema_device_for

    gpu = torch.device("meta")  # stands in for the training GPU
    assert ema_device_for(TrainConfig(ema_device="device", parallel="fsdp", fsdp_cpu_offload=True), gpu).type == "cpu"
    assert ema_device_for(TrainConfig(ema_device="device"), gpu) == gpu
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 3)
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        weights = list(model.parameters())
        ema = EMA(weights, 0.5, ema_device_for(TrainConfig(parallel="fsdp", fsdp_cpu_offload=True), gpu))
        with torch.no_grad():
            for p in weights:
                p.add_(1.0)
        ema.step(weights)  # EMAModel's first update copies (its decay warms up from 0)
        for s, p in zip(ema.shadow_params, weights):
            assert type(s).__name__ == "DTensor" and s.device.type == "cpu"
            assert torch.equal(s.full_tensor(), p.full_tensor())
    finally:
        dist.destroy_process_group()
