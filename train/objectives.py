"""Training objectives: `loss = objective(model, batch, generator)` and nothing else in the loop.

Flow matching (rectified flow; Sana, SD3): x_t = (1 - s) x_0 + s n, the model predicts n - x_0 at
timestep 1000 s. DDPM (PixArt-Sigma): epsilon or v prediction with diffusers' DDPMScheduler; a model
that also predicts variance channels has them split off before the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

# (model, noisy latents, timesteps, batch) -> prediction with the latents' channels first
ModelFn = Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]
TIMESTEP_BINS = 10  # loss is also reported per tenth of the timestep range


@dataclass
class FlowMatching:
    """Rectified flow with SD3's timestep densities and a shift.

    Args:
        weighting: timestep density: "uniform", "logit_normal" (SD3's default) or "mode".
        loss_weighting: SD3's per-timestep loss weights: "none", "sigma_sqrt" (1 / sigma^2) or "cosmap".
        shift: s -> shift * s / (1 + (shift - 1) s); larger shifts spend more steps at high noise.
        resolution_shift: scale the shift with sqrt(pixels / base pixels) per bucket.
        base_resolution: the square size `shift` was tuned at.
    """

    weighting: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    loss_weighting: str = "none"
    shift: float = 1.0
    resolution_shift: bool = False
    base_resolution: int = 1024

    def shift_at(self, pixels: int) -> float:
        """The shift for a bucket of `pixels` (sampling uses the same one)."""
        return self.shift * (math.sqrt(pixels) / self.base_resolution if self.resolution_shift else 1.0)

    def sigmas(self, n: int, pixels: int, generator: torch.Generator) -> torch.Tensor:
        u = compute_density_for_timestep_sampling(self.weighting, n, self.logit_mean, self.logit_std, self.mode_scale, generator=generator)
        shift = self.shift_at(pixels)
        return shift * u / (1 + (shift - 1) * u)

    def __call__(self, model_fn: ModelFn, batch: dict, generator: torch.Generator, part: tuple[int, int] = (0, 1)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample losses (B,) and timesteps in [0, 1) (B,).

        `part` = (rank, world size): the draws are made for the global batch and this rank takes its
        slice, so N processes see the same noise and timesteps as one process with the global batch.
        """
        x0 = batch["latents"]  # (B, C, h, w)
        n, _, h, w = x0.shape
        pixels = batch["bucket"][0] * batch["bucket"][1]
        mine = slice(part[0] * n, (part[0] + 1) * n)
        s = self.sigmas(n * part[1], pixels, generator)[mine].to(x0.device)
        noise = torch.randn((n * part[1], *x0.shape[1:]), generator=generator)[mine].to(x0.device)
        xt = (1 - s[:, None, None, None]) * x0 + s[:, None, None, None] * noise
        pred = model_fn(xt, s * 1000, batch)
        loss = F.mse_loss(pred.float(), (noise - x0).float(), reduction="none").mean(dim=(1, 2, 3))
        if self.loss_weighting != "none":
            loss = loss * compute_loss_weighting_for_sd3(self.loss_weighting, s.float())
        return loss, s


class DDPM:
    """Denoising diffusion with the family's scheduler (PixArt: linear betas, 1000 steps).

    Args:
        prediction: "epsilon" or "v_prediction".
    """

    def __init__(self, prediction: str = "epsilon", num_train_timesteps: int = 1000):
        if prediction not in ("epsilon", "v_prediction"):
            raise ValueError(f"DDPM prediction {prediction!r}: choose epsilon or v_prediction")
        self.scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule="linear",
                                       beta_start=0.0001, beta_end=0.02, prediction_type=prediction)
        self.prediction = prediction

    def __call__(self, model_fn: ModelFn, batch: dict, generator: torch.Generator, part: tuple[int, int] = (0, 1)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        x0 = batch["latents"]
        n, c = x0.shape[:2]
        mine = slice(part[0] * n, (part[0] + 1) * n)
        total = self.scheduler.config.num_train_timesteps
        t = torch.randint(0, total, (n * part[1],), generator=generator)[mine].to(x0.device)
        noise = torch.randn((n * part[1], *x0.shape[1:]), generator=generator)[mine].to(x0.device)
        xt = self.scheduler.add_noise(x0, noise, t)
        target = noise if self.prediction == "epsilon" else self.scheduler.get_velocity(x0, noise, t)
        pred = model_fn(xt, t, batch)[:, :c]  # learned-sigma models append variance channels
        loss = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
        return loss, t.float() / total


def build_objective(kind: str, prediction: str, **flow) -> FlowMatching | DDPM:
    if kind == "flow":
        return FlowMatching(**flow)
    if kind == "ddpm":
        return DDPM(prediction)
    raise ValueError(f"objective {kind!r}: choose flow or ddpm")
