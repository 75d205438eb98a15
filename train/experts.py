"""Two experts trained in one run (`--expert both`): two transformers of one architecture, the first denoising the
timesteps at or above a boundary and the second those below, as a two-expert model's released pipeline switches them.

`Experts` is called as either transformer is: each sample of a batch goes to the expert its timestep picks, so the
objective draws timesteps over the whole range and each expert trains on its own, and validation switches experts at
the boundary as the pipeline does. It saves as the released pipeline lays the experts out (`transformer/`,
`transformer_2/`): checkpoints, exports and `--pretrained` directories alike.
"""

from __future__ import annotations

from pathlib import Path

import torch


class Experts(torch.nn.Module):
    """Two transformers of one architecture split at a timestep.

    Args:
        transformer: the expert of the timesteps at or above `boundary` (high noise).
        transformer_2: the expert of those below it (low noise).
        boundary: the timestep (of 1000) where they split, the pipeline's boundary_ratio x 1000.
        names: the folders of a pipeline holding them, in that order.
    """

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module, boundary: float,
                 names: tuple[str, str] = ("transformer", "transformer_2")):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary, self.names = float(boundary), tuple(names)

    @property
    def config(self):
        """The architecture both share."""
        return self.transformer.config

    @property
    def experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        return self.transformer, self.transformer_2

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False, **kwargs):
        """The prediction of each sample (B, ...) by the expert of its timestep (B,); `kwargs` as the transformers take
        them (tensors of B rows are split with the samples)."""
        if timestep.is_meta:  # the planner's trace: the experts share one architecture, so one costs what either does
            return self.transformer(hidden_states=hidden_states, timestep=timestep, return_dict=False, **kwargs)
        high = timestep >= self.boundary  # (B,)
        if bool(high.all()) or bool((~high).all()):
            expert = self.transformer if bool(high[0]) else self.transformer_2
            return expert(hidden_states=hidden_states, timestep=timestep, return_dict=False, **kwargs)
        out = None
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            part = {k: v[rows] if isinstance(v, torch.Tensor) and v.shape[:1] == rows.shape else v for k, v in kwargs.items()}
            pred = expert(hidden_states=hidden_states[rows], timestep=timestep[rows], return_dict=False, **part)[0]
            if out is None:
                out = pred.new_empty((len(rows), *pred.shape[1:]))
            out[rows] = pred
        return (out,)

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts:
            expert.enable_gradient_checkpointing()

    def save_pretrained(self, directory: Path | str, **kwargs) -> None:
        """Each expert into its folder: `directory` (named as the first's) and its sibling named as the second's."""
        for expert, path in zip(self.experts, self.folders(directory)):
            expert.save_pretrained(path, **kwargs)

    def save_config(self, directory: Path | str) -> None:
        for expert, path in zip(self.experts, self.folders(directory)):
            expert.save_config(path)

    def folders(self, directory: Path | str) -> tuple[Path, Path]:
        """The folders of the two experts saved at `directory` (the first's)."""
        return Path(directory), Path(directory).with_name(self.names[1])

    @classmethod
    def from_pretrained(cls, cls_of: type, directory: Path | str, boundary: float, names: tuple[str, str], **kwargs) -> Experts:
        """Both experts saved by `save_pretrained` at `directory` (the first's folder), as `cls_of` transformers."""
        first, second = Path(directory), Path(directory).with_name(names[1])
        return cls(cls_of.from_pretrained(first, **kwargs), cls_of.from_pretrained(second, **kwargs), boundary, names)
