"""The EMA of the trained weights, kept in fp32 on the device the user chose, after resume too.

The averaging is diffusers' `EMAModel`; this wrapper owns where its shadow weights live. With the EMA on
another device than the weights (`--ema-device cpu` on a GPU), each update first copies the weights
into pinned buffers on the EMA's device and averages there, so no operation ever mixes devices; a
loaded state is moved back to the EMA's device (checkpoints load to the CPU).
"""

from __future__ import annotations

import torch


class EMA:
    """Exponential moving average of `params` on `device`.

    Args:
        params: the trainable parameters, in the order every later call passes them.
        decay: the EMA decay.
        device: where the shadow weights live (the training device, or the CPU).
    """

    def __init__(self, params: list[torch.Tensor], decay: float, device: torch.device | str):
        from diffusers.training_utils import EMAModel

        self.device = torch.device(device)
        self.model = EMAModel(params, decay=decay, foreach=True)
        self._staging: list[torch.Tensor] | None = None
        self._place()

    def _place(self) -> None:
        # fp32 whatever the weights' dtype: a bf16 average would drop the (1 - decay)-sized updates
        self.model.to(device=self.device, dtype=torch.float32)
        sharded = any(type(p).__name__ == "DTensor" for p in self.model.shadow_params)  # FSDP: shards beside the weights
        if self.device.type == "cpu" and torch.cuda.is_available() and not sharded:
            self.model.pin_memory()  # the copies from the GPU then run at full bandwidth
        self._staging = None

    @property
    def shadow_params(self) -> list[torch.Tensor]:
        return self.model.shadow_params

    @property
    def decay(self) -> float:
        return self.model.decay

    @decay.setter
    def decay(self, value: float) -> None:
        self.model.decay = value

    def _on_my_device(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """`params` themselves when they live on the EMA's device, else copies in reusable buffers there."""
        if all(p.device == self.device for p in params):
            return params
        if self._staging is None:
            pin = self.device.type == "cpu" and torch.cuda.is_available()
            self._staging = [torch.empty(p.shape, dtype=torch.float32, device=self.device, pin_memory=pin).requires_grad_(p.requires_grad)
                             for p in params]
        with torch.no_grad():
            torch._foreach_copy_(self._staging, [p.detach() for p in params])  # blocking: the CPU reads them next
        return self._staging

    def step(self, params: list[torch.Tensor]) -> None:
        """One EMA update towards `params`, computed on the EMA's device."""
        self.model.step(self._on_my_device(list(params)))

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved EMA (its tensors may sit anywhere, e.g. on the CPU) onto the EMA's device. The
        decay stays this run's, so a resumed run can change it."""
        decay = self.model.decay
        self.model.load_state_dict(state)
        self.model.decay = decay
        self._place()


def load_shadow(module: torch.nn.Module, ema_state: dict, where) -> None:
    """Copy a saved EMA's shadow weights (`ema_state["shadow_params"]`) into `module`'s trainable parameters, in
    order; refused, naming `where` (the checkpoint), when they do not match one for one."""
    params = [p for p in module.parameters() if p.requires_grad]
    shadow = ema_state["shadow_params"]
    if len(shadow) != len(params) or any(s.shape != p.shape for s, p in zip(shadow, params)):
        raise ValueError(f"{where}: the EMA weights do not match the {type(module).__name__}'s parameters")
    with torch.no_grad():
        for p, s in zip(params, shadow):
            p.copy_(s)
