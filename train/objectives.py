"""Training objectives: `loss, t = objective(model_fn, batch, generator)` and nothing else in the loop; the held-out
loss takes the same loss at fixed timesteps and noise (`fixed_times`, `loss_at`).

Flow matching (rectified flow): x_t = (1 - s) x_0 + s n, the model predicts n - x_0 at timestep 1000 s, with the
timestep density and loss weighting of diffusers' rectified-flow trainers and a timestep shift (fixed, scaled with
the resolution, or the family's dynamic one, from the image's sequence length). DDPM: epsilon or v prediction with
diffusers' DDPMScheduler (linear betas, 1000 steps), and for models that predict their variance too, the VLB term of
improved DDPM.

Noise and timesteps are drawn for the global batch on the batch's device (the generator must live
there) and each rank takes its slice, so N processes train what one process with the global batch would.

With `masked_loss`, the per-element loss is weighted by the batch's loss mask (`mask`, (B, 1, h, w) uint8, 255 for
1, broadcast over the channels) before the mean over every element, as kohya's and SimpleTuner's masked losses
normalise: a kept element's gradient is what it is unmasked, and an all-white mask gives the unmasked loss exactly.
Every family's prediction is unpacked to (B, C, h, w) before the loss, so the mask, at latent resolution, lines up
with packed families' latents as it does with the others'.

A clip's latents have a frame axis, (B, C, T, h, w): the noise is drawn for every element, a sample's timestep holds for
all its frames, and the loss is the mean over every element (loss masks are cached for images only). A model that also
generates a clip from an image given as its clean first latent frame (`Family.first_frame_conditioning`) trains that
with `clean_first_frame`: a drawn share of the clips keep their first latent frame clean in the noisy latents, are
marked in the batch (`CLEAN_FIRST_FRAME`, for the family's forward: timestep 0 on that frame's tokens) and take the
loss over their other frames only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling

# (noisy latents, timesteps, batch) -> prediction with the latents' channels first
ModelFn = Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]
TIMESTEP_BINS = 10  # loss is also reported per tenth of the timestep range
# image-to-video by a clean first latent frame (`Family.first_frame_conditioning`): in a batch, (B,) bool, true for the
# samples whose first latent frame is the clean condition (the objective keeps it out of the noise and the loss; the
# family's `forward` gives its tokens timestep 0); in a validation batch, `FIRST_FRAME` holds that frame's latent
# (B, C, 1, h, w), which the family's `denoise` keeps in place of the noise at every step, as its pipeline keeps it
CLEAN_FIRST_FRAME = "clean_first_frame"
FIRST_FRAME = "first_frame"
# what each weighting scheme draws timesteps from (diffusers' compute_density_for_timestep_sampling)
DENSITY = {"logit_normal": "logit_normal", "mode": "mode", "sigma_sqrt": "uniform", "cosmap": "uniform", "none": "uniform"}


def global_slice(draw: torch.Tensor, n: int, part: tuple[int, int]) -> torch.Tensor:
    """Rank `part[0]`'s `n` rows of a draw made for the whole global batch."""
    return draw[part[0] * n : (part[0] + 1) * n]


def loss_mask(batch: dict, masked: bool) -> torch.Tensor | None:
    """The batch's loss mask as weights in [0, 1], (B, 1, h, w) float32, when the loss is masked; else None."""
    if not masked:
        return None
    if "mask" not in batch:
        raise ValueError("--masked-loss: this batch carries no loss masks; train from a cache built with stage one's "
                         "--masks (or --alpha-mask)")
    return batch["mask"].float() / 255  # 255 / 255 is exactly 1: an all-white mask leaves the loss as it is


def masked_mean(err: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Per-sample mean of a per-element loss (B, C, h, w) or (B, C, T, h, w), each element weighted by the mask first
    (B,)."""
    if mask is not None and mask.dim() != err.dim():
        raise ValueError(f"a loss mask {tuple(mask.shape)} cannot weight latents {tuple(err.shape)}: loss masks are cached "
                         f"for images only; train without --masked-loss")
    return (err if mask is None else err * mask).mean(dim=tuple(range(1, err.dim())))


def per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) values shaped to broadcast over each sample's elements of `like` (B, C, h, w) or (B, C, T, h, w)."""
    return values.reshape(-1, *[1] * (like.dim() - 1))


@dataclass
class FlowMatching:
    """Rectified flow with the weighting schemes of diffusers' rectified-flow trainers and a timestep shift.

    Args:
        weighting_scheme: "logit_normal" (diffusers' default) or "mode": timesteps from that density, unit
            weights; "sigma_sqrt" (1 / sigma^2) or "cosmap": uniform timesteps, weighted loss; "none".
        precondition_outputs: as diffusers' rectified-flow trainers can: the prediction becomes an x0 estimate
            x_t - sigma * v and the loss is taken against x_0 (a velocity loss scaled by sigma^2).
        shift: s -> shift * s / (1 + (shift - 1) s); larger shifts spend more steps at high noise.
        resolution_shift: scale the shift with sqrt(pixels / base pixels) per bucket.
        base_resolution: the square size `shift` was tuned at.
        dynamic_shift: the family's dynamic shift instead of `shift`: mu from the image's sequence length (pixels /
            `pixels_per_token`) by `mu_of`, and the exponential time shift exp(mu) / (exp(mu) + 1 / s - 1) the
            scheduler applies with `use_dynamic_shifting`, which is the shift above with shift = exp(mu).
        pixels_per_token: image pixels per token of the transformer's sequence ((VAE factor x patch)^2).
        mu_of: the family's mu of an image sequence length (`Family.mu`), as its pipeline computes it.
        masked_loss: weight each element's loss by the batch's loss mask (see the module's docstring).
        timestep_range: the noise levels [low, high) drawn (one expert of a two-expert model trains on its own range;
            high 1 includes 1): the training density, shift included, cut to the range and renormalised, drawn by its
            inverse CDF (`quantile`), so the two experts' ranges together are the whole model's density.
        clean_first_frame: the share of clips (of more than one latent frame) trained as image-to-video: their first
            latent frame stays clean, as the pipeline keeps the image's latent, and only the other frames are noised
            and count in the loss (their mean). Drawn per clip after the noise, so a run without it draws what it did.
            The held-out loss (`loss_at` without draws) takes every clip so when it is above 0.
    """

    weighting_scheme: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    precondition_outputs: bool = False
    shift: float = 1.0
    resolution_shift: bool = False
    base_resolution: int = 1024
    dynamic_shift: bool = False
    pixels_per_token: int = 256
    mu_of: Callable[[int], float] | None = None
    masked_loss: bool = False
    timestep_range: tuple[float, float] = (0.0, 1.0)
    clean_first_frame: float = 0.0

    def __post_init__(self) -> None:
        if self.dynamic_shift and self.mu_of is None:
            raise ValueError("the dynamic shift needs the family's mu of a sequence length (mu_of)")
        if self.dynamic_shift and self.resolution_shift:
            raise ValueError("the dynamic (sequence-length) shift and --resolution-shift both scale the shift: choose one")
        if self.weighting_scheme not in DENSITY:
            raise ValueError(f"weighting scheme {self.weighting_scheme!r}: choose one of {', '.join(DENSITY)}")
        if self.weighting_scheme == "sigma_sqrt" and not self.precondition_outputs:
            raise ValueError("--weighting-scheme sigma_sqrt weights the loss by 1/sigma^2: on the velocity loss a handful of "
                             "low-noise samples would outweigh the rest up to a million-fold. It is meant for the x0 loss of "
                             "--precondition-outputs (as in diffusers' rectified-flow trainers); add it, or choose another scheme.")

    def mu(self, pixels: int) -> float:
        """The dynamic shift's mu for a bucket of `pixels`: the family's, of its image sequence length."""
        return self.mu_of(pixels // self.pixels_per_token)

    def shift_at(self, pixels: int) -> float:
        """The shift for a bucket of `pixels` (sampling uses the same one)."""
        if self.dynamic_shift:
            return math.exp(self.mu(pixels))
        return self.shift * (math.sqrt(pixels) / self.base_resolution if self.resolution_shift else 1.0)

    def sigmas(self, n: int, pixels: int, generator: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
        """`n` noise levels in (0, 1) for a bucket of `pixels`, drawn on `device` (in `timestep_range`)."""
        low, high = self.timestep_range
        if (low, high) != (0.0, 1.0):  # one expert's range: the density cut to it, by its inverse CDF
            a, b = self.cdf(low, pixels), self.cdf(high, pixels)
            q = a + (b - a) * torch.rand(n, generator=generator, device=device, dtype=torch.float64)
            s = self.quantile(q, pixels)
            # the boundary belongs to the range above it: a level rounded onto it from below stays below
            return s.clamp(low, math.nextafter(high, 0.0) if high < 1 else 1.0).float()
        u = compute_density_for_timestep_sampling(DENSITY[self.weighting_scheme], n, self.logit_mean, self.logit_std,
                                                  self.mode_scale, device=device, generator=generator)
        shift = self.shift_at(pixels)
        return shift * u / (1 + (shift - 1) * u)

    def weights(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Per-sample loss weights, as diffusers' `training_utils` weights a rectified-flow loss (tests compare them)."""
        s = sigmas.float()
        if self.weighting_scheme == "sigma_sqrt":
            return s**-2.0
        if self.weighting_scheme == "cosmap":
            return 2 / (math.pi * (1 - 2 * s + 2 * s**2))
        return torch.ones_like(s)

    def __call__(self, model_fn: ModelFn, batch: dict, generator: torch.Generator, part: tuple[int, int] = (0, 1),
                 target_fn: ModelFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample losses (B,) and noise levels in [0, 1) (B,); `part` = (rank, world size). `target_fn`: a
        prediction to match instead of the data's velocity (output preservation: the base model's, no gradients)."""
        x0 = batch["latents"]  # (B, C, h, w), a clip's (B, C, T, h, w)
        n = x0.shape[0]
        pixels = batch["bucket"][0] * batch["bucket"][1]  # of one frame
        s = global_slice(self.sigmas(n * part[1], pixels, generator, x0.device), n, part)
        noise = global_slice(torch.randn((n * part[1], *x0.shape[1:]), generator=generator, device=x0.device), n, part)
        clean = None
        if self.first_frames(x0):  # which clips train image-to-video: drawn after the noise, from the same generator
            clean = global_slice(torch.rand(n * part[1], generator=generator, device=x0.device), n, part) < self.clean_first_frame
        return self.loss_at(model_fn, batch, s, noise, target_fn, clean), s

    def first_frames(self, x0: torch.Tensor) -> bool:
        """Whether clips of these latents may train image-to-video: clips of more than one latent frame, in a run that
        trains it."""
        return self.clean_first_frame > 0 and x0.dim() == 5 and x0.shape[2] > 1

    def loss_at(self, model_fn: ModelFn, batch: dict, s: torch.Tensor, noise: torch.Tensor,
                target_fn: ModelFn | None = None, clean: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample losses (B,) at noise levels `s` (B,) with this `noise` (the latents' shape): the training loss,
        given its draws (`target_fn`: as `__call__`'s; `clean`: (B,) bool, the clips whose first latent frame stays
        clean, by default every clip when `clean_first_frame` is above 0)."""
        x0 = batch["latents"]
        s4 = per_sample(s, x0)
        xt = (1 - s4) * x0 + s4 * noise
        if clean is None and self.first_frames(x0):
            clean = torch.ones(x0.shape[0], dtype=torch.bool, device=x0.device)
        if clean is not None:  # (B, 1, T, 1, 1): the first frame of each clean clip, its latent as it is
            first = clean.reshape(-1, 1, 1, 1, 1) & (torch.arange(x0.shape[2], device=x0.device) == 0).reshape(1, 1, -1, 1, 1)
            xt = torch.where(first, x0, xt)
            batch = {**batch, CLEAN_FIRST_FRAME: clean}
        # the target's forward first: its memory is freed before the trained forward saves its activations
        base = target_fn(xt, s * 1000, batch).float() if target_fn is not None else None
        pred = model_fn(xt, s * 1000, batch).float()
        if self.precondition_outputs:  # the x0 the velocity implies, against the clean latent (or the base's x0)
            pred, target = xt.float() - s4 * pred, x0.float() if base is None else xt.float() - s4 * base
        else:
            target = (noise - x0).float() if base is None else base
        err = F.mse_loss(pred, target, reduction="none")
        loss = masked_mean(err, loss_mask(batch, self.masked_loss))
        if clean is not None:  # a clean first frame is the condition, not a prediction: the mean over the other frames
            loss = torch.where(clean, masked_mean(err[:, :, 1:], None), loss)
        return loss * self.weights(s)

    def fixed_times(self, n: int, pixels: int) -> torch.Tensor:
        """`n` fixed noise levels for a bucket of `pixels`: the quantiles (k + 1/2) / n of the training density,
        shifted as training shifts and cut to `timestep_range` (n,). Their mean loss is a stratified estimate of the
        training loss's expectation, without its sampling noise."""
        q = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        low, high = self.timestep_range
        if (low, high) != (0.0, 1.0):
            a, b = self.cdf(low, pixels), self.cdf(high, pixels)
            q = a + (b - a) * q
        return self.quantile(q, pixels).float()

    def quantile(self, q: torch.Tensor, pixels: int) -> torch.Tensor:
        """The training density's noise level at quantile `q` in [0, 1] (float64, shift included)."""
        kind = DENSITY[self.weighting_scheme]
        if kind == "logit_normal":
            u = torch.sigmoid(self.logit_mean + self.logit_std * math.sqrt(2.0) * torch.special.erfinv(2 * q - 1))
        elif kind == "mode":  # diffusers' mode density maps a uniform v to this, decreasing in v: quantile q is v = 1 - q
            v = 1 - q
            u = 1 - v - self.mode_scale * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
        else:
            u = q
        shift = self.shift_at(pixels)
        return shift * u / (1 + (shift - 1) * u)

    def cdf(self, sigma: float, pixels: int) -> float:
        """The fraction of the training density below noise level `sigma` (the inverse of `quantile`, by bisection)."""
        if sigma <= 0 or sigma >= 1:
            return 0.0 if sigma <= 0 else 1.0
        low, high = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
        for _ in range(60):  # float64's precision
            mid = (low + high) / 2
            below = self.quantile(mid[None], pixels)[0] < sigma
            low, high = torch.where(below, mid, low), torch.where(below, high, mid)
        return float((low + high) / 2)


class DDPM:
    """Denoising diffusion with diffusers' DDPMScheduler (linear betas, 1000 steps).

    Args:
        prediction: "epsilon" or "v_prediction".
        learned_variance: the model's second half of output channels predicts the variance
            (learned range between the posterior's and beta's, improved DDPM), trained by the VLB term
            with the mean detached, added to the epsilon loss as improved DDPM does. Off: those
            channels are split off and get no loss.
        masked_loss: weight each element's loss (and VLB term) by the batch's loss mask (see the module's docstring).
    """

    def __init__(self, prediction: str = "epsilon", num_train_timesteps: int = 1000, learned_variance: bool = False,
                 masked_loss: bool = False):
        if prediction not in ("epsilon", "v_prediction"):
            raise ValueError(f"DDPM prediction {prediction!r}: choose epsilon or v_prediction")
        if learned_variance and prediction != "epsilon":
            raise ValueError("the learned variance's VLB term is defined for epsilon prediction")
        self.scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule="linear",
                                       beta_start=0.0001, beta_end=0.02, prediction_type=prediction)
        self.prediction = prediction
        self.learned_variance = learned_variance
        self.masked_loss = masked_loss

    def __call__(self, model_fn: ModelFn, batch: dict, generator: torch.Generator, part: tuple[int, int] = (0, 1),
                 target_fn: ModelFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As `FlowMatching`'s; with `target_fn` the loss is against its prediction, the variance channels' too when
        they train (in place of the VLB term)."""
        x0 = batch["latents"]
        n = x0.shape[0]
        total = self.scheduler.config.num_train_timesteps
        t = global_slice(torch.randint(0, total, (n * part[1],), generator=generator, device=x0.device), n, part)
        noise = global_slice(torch.randn((n * part[1], *x0.shape[1:]), generator=generator, device=x0.device), n, part)
        return self.loss_at(model_fn, batch, t, noise, target_fn), t.float() / total

    def fixed_times(self, n: int, pixels: int) -> torch.Tensor:
        """`n` fixed timesteps, evenly spaced over the uniform training range: the midpoints of n equal bins (n,)."""
        total = self.scheduler.config.num_train_timesteps
        return ((torch.arange(n, dtype=torch.float64) + 0.5) * total / n).long().clamp(0, total - 1)

    def loss_at(self, model_fn: ModelFn, batch: dict, t: torch.Tensor, noise: torch.Tensor,
                target_fn: ModelFn | None = None) -> torch.Tensor:
        """Per-sample losses (B,) at timesteps `t` (B,) with this `noise` (B, C, h, w) (`target_fn`: as `__call__`'s)."""
        x0 = batch["latents"]
        c = x0.shape[1]
        xt = self.scheduler.add_noise(x0, noise, t)
        target = noise if self.prediction == "epsilon" else self.scheduler.get_velocity(x0, noise, t)
        base = target_fn(xt, t, batch).float() if target_fn is not None else None
        out = model_fn(xt, t, batch).float()
        mask = loss_mask(batch, self.masked_loss)
        if base is not None:
            trained = out.shape[1] if self.learned_variance else c
            return masked_mean(F.mse_loss(out[:, :trained], base[:, :trained], reduction="none"), mask)
        pred = out[:, :c]
        loss = masked_mean(F.mse_loss(pred, target.float(), reduction="none"), mask)
        if self.learned_variance:
            if out.shape[1] != 2 * c:
                raise ValueError(f"--learned-variance needs a model with 2 x {c} output channels; this one has {out.shape[1]}")
            loss = loss + vlb_terms(self.scheduler, x0.float(), xt.float(), t, pred.detach(), out[:, c:], mask)
        return loss


def vlb_terms(scheduler: DDPMScheduler, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor, eps: torch.Tensor,
              variance: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Improved DDPM's variational bound per sample, in bits per dimension (B,), each dimension weighted by `mask`
    (B, 1, h, w) when given.

    KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) for t > 0 and the discretised Gaussian decoder NLL of
    x_0 at t = 0, with p's mean from the (detached) epsilon prediction and its log variance interpolated
    between the clipped posterior's and beta's by `variance` in [-1, 1] (the "learned range").
    """
    betas, ac = schedule_tables(scheduler, x0.device)
    ac_prev = torch.cat([ac.new_ones(1), ac[:-1]])
    posterior_var = betas * (1 - ac_prev) / (1 - ac)
    # log of the posterior variance, clipped: at t = 0 it is 0, so t = 1's is used
    posterior_log_var = torch.log(torch.cat([posterior_var[1:2], posterior_var[1:]]))
    coef_x0 = betas * ac_prev.sqrt() / (1 - ac)
    coef_xt = (1 - ac_prev) * (1 - betas).sqrt() / (1 - ac)

    def at(table: torch.Tensor) -> torch.Tensor:  # the schedule in float64, each sample's entry in float32
        return per_sample(table[t].float(), x0)

    true_mean = at(coef_x0) * x0 + at(coef_xt) * xt
    true_log_var = at(posterior_log_var)
    pred_x0 = (1 / at(ac)).sqrt() * xt - (1 / at(ac) - 1).sqrt() * eps
    model_mean = at(coef_x0) * pred_x0 + at(coef_xt) * xt
    frac = (variance + 1) / 2
    model_log_var = frac * at(torch.log(betas)) + (1 - frac) * true_log_var
    # KL of two Gaussians; -1 + exp(-d) as expm1(-d): their variances are close, and 1 - exp(...) would cancel
    d = model_log_var - true_log_var
    kl = 0.5 * (d + torch.expm1(-d) + (true_mean - model_mean) ** 2 * torch.exp(-model_log_var))
    nll = -discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_var)
    per_dim = torch.where(per_sample(t == 0, x0), nll, kl)
    return masked_mean(per_dim, mask) / math.log(2.0)


def schedule_tables(scheduler: DDPMScheduler, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheduler's betas and cumulative alphas in float64 on `device`, copied there once: a copy from the host at
    every step would wait for the device each time."""
    tables = scheduler.__dict__.setdefault("_float64_tables", {})
    if device not in tables:
        tables[device] = (scheduler.betas.to(device, torch.float64), scheduler.alphas_cumprod.to(device, torch.float64))
    return tables[device]


def discretized_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """log-likelihood of `x` (data in [-1, 1] on a 256-level grid) under a Gaussian, per element."""
    def cdf(v):  # the tanh approximation of the standard normal CDF improved DDPM uses
        return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v.pow(3))))

    centered, inv_std = x - mean, torch.exp(-log_scale)
    cdf_plus, cdf_min = cdf(inv_std * (centered + 1 / 255)), cdf(inv_std * (centered - 1 / 255))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


def build_objective(kind: str, prediction: str, *, learned_variance: bool = False, masked_loss: bool = False,
                    **flow) -> FlowMatching | DDPM:
    if kind == "flow":
        return FlowMatching(masked_loss=masked_loss, **flow)
    if kind == "ddpm":
        return DDPM(prediction, learned_variance=learned_variance, masked_loss=masked_loss)
    raise ValueError(f"objective {kind!r}: choose flow or ddpm")
