"""Each objective on its own, against diffusers' formulas and schedulers."""

import math

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from torch.overrides import TorchFunctionMode

from train.objectives import DDPM, DENSITY, FlowMatching, vlb_terms


def batch(n=4, c=4, h=8, w=8, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return {"latents": torch.randn(n, c, h, w, generator=g).to(device), "bucket": (64, 64)}


class Recorder:
    """A model stand-in: returns a fixed prediction and keeps what it was given."""

    def __init__(self, out):
        self.out, self.calls = out, []

    def __call__(self, xt, t, b):
        self.calls.append((xt, t))
        return self.out


def test_flow_matching_noising_and_shift_follow_the_flow_match_scheduler():
    objective = FlowMatching(weighting_scheme="none", shift=3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    # the scheduler's training sigmas are the shifted uniform grid
    u = torch.linspace(1, 0.001, 1000)
    assert torch.allclose(3.0 * u / (1 + 2.0 * u), scheduler.sigmas, atol=1e-5)
    b = batch()
    pred = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    model = Recorder(pred)
    loss, s = objective(model, b, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    u = compute_density_for_timestep_sampling("uniform", 4, generator=g)
    noise = torch.randn(b["latents"].shape, generator=g)
    assert torch.allclose(s, 3.0 * u / (1 + 2.0 * u))
    xt, t = model.calls[0]
    assert torch.allclose(t, s * 1000)
    assert torch.allclose(xt, (1 - s[:, None, None, None]) * b["latents"] + s[:, None, None, None] * noise)
    # the scheduler's own noising at one of its training timesteps gives the same x_t
    scheduler._step_index, k = None, 200
    scheduler._begin_index = None
    x = scheduler.scale_noise(b["latents"][:1], scheduler.timesteps[k : k + 1], noise[:1])
    sigma = scheduler.sigmas[k]
    assert torch.allclose(x, (1 - sigma) * b["latents"][:1] + sigma * noise[:1], atol=1e-6)
    assert torch.allclose(loss, ((pred - (noise - b["latents"])) ** 2).mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("scheme", ["logit_normal", "mode", "sigma_sqrt", "cosmap", "none"])
def test_sd3_weighting_schemes_as_diffusers_sd3_trainers_define_them(scheme):
    """Timestep density and loss weight from diffusers' helpers; with preconditioning the loss is the x0 loss
    of train_dreambooth_sd3.py, term for term."""
    objective = FlowMatching(weighting_scheme=scheme, precondition_outputs=True, shift=1.0)
    b = batch(n=6)
    pred = torch.randn(6, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    loss, s = objective(Recorder(pred), b, torch.Generator().manual_seed(3))

    g = torch.Generator().manual_seed(3)
    u = compute_density_for_timestep_sampling(DENSITY[scheme], 6, logit_mean=0.0, logit_std=1.0, mode_scale=1.29, generator=g)
    noise = torch.randn(b["latents"].shape, generator=g)
    assert torch.equal(s, u)  # shift 1
    sigmas = s[:, None, None, None]
    noisy = (1.0 - sigmas) * b["latents"] + sigmas * noise
    model_pred = pred * (-sigmas) + noisy  # the script's preconditioning
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=scheme, sigmas=sigmas)
    expected = torch.mean((weighting.float() * (model_pred.float() - b["latents"].float()) ** 2).reshape(6, -1), 1)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(objective.weights(s), compute_loss_weighting_for_sd3(scheme, s))


def test_no_weighting_lets_a_few_low_noise_samples_dominate():
    """Per-sample weight on the velocity loss's scale (x0 loss = sigma^2 x velocity loss): no setting that is
    accepted lets the largest weight exceed the median by 100x; the one that would (1e6x) is refused."""
    s = compute_density_for_timestep_sampling("uniform", 100_000, generator=torch.Generator().manual_seed(0)).clamp(min=1e-3)
    for scheme in DENSITY:
        for precondition in (True, False):
            if scheme == "sigma_sqrt" and not precondition:
                with pytest.raises(ValueError, match="million-fold"):
                    FlowMatching(weighting_scheme=scheme, precondition_outputs=False)
                assert float((1 / s**2).max() / (1 / s**2).median()) > 1e5  # why it is refused
                continue
            objective = FlowMatching(weighting_scheme=scheme, precondition_outputs=precondition)
            effective = objective.weights(s) * (s**2 if precondition else 1)
            assert float(effective.max() / effective.median()) < 100, (scheme, precondition)


def test_noise_and_timesteps_are_drawn_on_the_batchs_device():
    """With the batch on another device (meta stands in for a GPU), every draw is made there, not on the
    CPU and copied over (a draw without a device would be recorded as None)."""
    class Draws(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", str(func))
            if name in ("randn", "rand", "randint", "normal", "randperm"):
                self.seen.append((name, str(kwargs.get("device"))))
            return func(*args, **kwargs)

    for objective in (FlowMatching(weighting_scheme="logit_normal"), DDPM("epsilon")):
        b = batch(device="meta")
        with Draws() as draws:
            loss, t = objective(lambda xt, t, b: torch.zeros_like(xt), b, torch.Generator().manual_seed(0), part=(1, 2))
        assert loss.device.type == "meta" and t.device.type == "meta"
        assert draws.seen and all(device == "meta" for _, device in draws.seen), draws.seen


def test_the_global_batch_is_drawn_once_and_sliced_per_rank():
    b = batch(n=4)
    halves = [FlowMatching()(Recorder(torch.zeros(2, 4, 8, 8)), {"latents": b["latents"][r * 2 : r * 2 + 2], "bucket": (64, 64)},
                             torch.Generator().manual_seed(9), part=(r, 2))[1] for r in range(2)]
    whole = FlowMatching()(Recorder(torch.zeros(4, 4, 8, 8)), b, torch.Generator().manual_seed(9))[1]
    assert torch.equal(torch.cat(halves), whole)


def test_ddpm_noising_is_the_ddpm_schedulers():
    objective, scheduler = DDPM("epsilon"), DDPMScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02)
    b = batch()
    model = Recorder(torch.zeros(4, 4, 8, 8))
    _, t = objective(model, b, torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(2)
    steps = torch.randint(0, 1000, (4,), generator=g)
    noise = torch.randn(b["latents"].shape, generator=g)
    assert torch.equal(model.calls[0][1], steps) and torch.equal(t, steps.float() / 1000)
    assert torch.allclose(model.calls[0][0], scheduler.add_noise(b["latents"], noise, steps))


def reference_vlb(scheduler: DDPMScheduler, x0, xt, t, eps, v) -> torch.Tensor:
    """Improved DDPM's L_vlb term by term, in float64: the learned-range log variance (checked against
    diffusers' DDPMScheduler for t > 0; at t = 0 the posterior variance is clipped to t = 1's), the Gaussian
    KL, and the decoder NLL at t = 0 with the exact normal CDF."""
    out = []
    for i in range(len(t)):
        ti = int(t[i])
        a, b = scheduler.alphas_cumprod.double(), scheduler.betas.double()
        a_prev = a[ti - 1] if ti > 0 else torch.tensor(1.0, dtype=torch.float64)
        posterior_var = b * torch.cat([torch.ones(1, dtype=torch.float64), a[:-1]]).neg().add(1) / (1 - a)
        true_log_var = math.log(posterior_var[max(ti, 1)])
        frac = (v[i].double() + 1) / 2
        model_log_var = frac * math.log(b[ti]) + (1 - frac) * true_log_var
        if ti > 0:  # diffusers' learned range agrees (its float32 tables differ in the last digits)
            diffusers_log_var = scheduler._get_variance(ti, predicted_variance=v[i], variance_type="learned_range")
            torch.testing.assert_close(model_log_var.float(), diffusers_log_var, rtol=1e-4, atol=1e-4)
        c0, ct = b[ti] * a_prev.sqrt() / (1 - a[ti]), (1 - a_prev) * (1 - b[ti]).sqrt() / (1 - a[ti])
        true_mean = c0 * x0[i].double() + ct * xt[i].double()
        pred_x0 = (xt[i].double() - (1 - a[ti]).sqrt() * eps[i].double()) / a[ti].sqrt()
        model_mean = c0 * pred_x0 + ct * xt[i].double()
        if ti > 0:
            kl = 0.5 * (-1 + model_log_var - true_log_var + math.exp(true_log_var) / model_log_var.exp()
                        + (true_mean - model_mean) ** 2 / model_log_var.exp())
            out.append(kl.mean() / math.log(2))
        else:
            normal = torch.distributions.Normal(model_mean, (0.5 * model_log_var).exp())
            upper = torch.where(x0[i] > 0.999, torch.ones_like(model_mean), normal.cdf(x0[i].double() + 1 / 255))
            lower = torch.where(x0[i] < -0.999, torch.zeros_like(model_mean), normal.cdf(x0[i].double() - 1 / 255))
            out.append(-(upper - lower).clamp(min=1e-12).log().mean() / math.log(2))
    return torch.stack(out).float()


def test_pixart_learned_variance_vlb_matches_improved_ddpm():
    scheduler = DDPMScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02, variance_type="learned_range")
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 4, 8, 8, generator=g).clamp(-1, 1)
    noise = torch.randn(5, 4, 8, 8, generator=g)
    t = torch.tensor([0, 1, 10, 500, 999])
    xt = scheduler.add_noise(x0, noise, t)
    eps = noise + 0.1 * torch.randn(5, 4, 8, 8, generator=g)  # an imperfect epsilon prediction
    v = torch.rand(5, 4, 8, 8, generator=g) * 2 - 1
    got = vlb_terms(scheduler, x0, xt, t, eps, v)
    want = reference_vlb(scheduler, x0, xt, t, eps, v)
    torch.testing.assert_close(got[1:], want[1:], rtol=1e-4, atol=1e-6)  # the KL terms
    torch.testing.assert_close(got[:1], want[:1], rtol=2e-2, atol=1e-3)  # tanh-approximated CDF vs the exact one


def test_learned_variance_trains_the_variance_channels_from_the_vlb_alone():
    objective = DDPM("epsilon", learned_variance=True)
    b = batch()
    out = torch.randn(4, 8, 8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss, _ = objective(lambda xt, t, b: out, b, torch.Generator().manual_seed(2))
    eps_only, _ = DDPM("epsilon")(lambda xt, t, b: out, b, torch.Generator().manual_seed(2))
    assert (loss > eps_only).all()  # the VLB term is added
    (loss.sum() - eps_only.sum()).backward()  # the VLB's gradient alone
    assert out.grad[:, :4].abs().max() == 0 and out.grad[:, 4:].abs().max() > 0  # the mean is detached in it


def test_the_run_defaults_per_family():
    """SD3 preconditions its outputs and Sana does not; PixArt-Sigma's full fine-tunes learn the variance, its LoRA
    runs do not, and --no-learned-variance or a model without variance channels turn it off."""
    from train.config import TrainConfig
    from train.families import get_preset
    from train.model import build_run_objective

    def objective(model, **kw):
        preset = get_preset(model)
        return build_run_objective(TrainConfig(model=model, **kw), preset, preset.transformer_config())

    assert objective("sd35-large").precondition_outputs and objective("sd35-large").weighting_scheme == "logit_normal"
    assert not objective("sd35-large", precondition_outputs=False).precondition_outputs
    assert not objective("sana-1600m").precondition_outputs
    assert objective("pixart-sigma-1024").learned_variance
    assert not objective("pixart-sigma-1024", lora_rank=16).learned_variance
    assert not objective("pixart-sigma-1024", learned_variance=False).learned_variance
    preset = get_preset("pixart-sigma-1024")
    no_variance = {**preset.transformer_config(), "out_channels": preset.transformer_config()["in_channels"]}
    with pytest.raises(ValueError, match="predicts no variance channels"):
        build_run_objective(TrainConfig(model="pixart-sigma-1024", learned_variance=True), preset, no_variance)
    assert not build_run_objective(TrainConfig(model="pixart-sigma-1024"), preset, no_variance).learned_variance
