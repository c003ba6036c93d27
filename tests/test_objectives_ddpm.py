"""Pure math of the discrete-DDPM objective (SDXL, SD1.5), checked against diffusers' schedulers and training utils."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_snr

from lightning_lora import objectives as obj


def _scheduler(**kwargs: object) -> DDPMScheduler:
    return DDPMScheduler(beta_start=0.00085, beta_end=0.012, **{"beta_schedule": "scaled_linear", **kwargs})


@pytest.mark.parametrize("kind", ["scaled_linear", "linear", "squaredcos_cap_v2"])
def test_beta_schedules_match_diffusers(kind: str) -> None:
    ours = obj.beta_schedule(kind, 1000, 0.00085, 0.012)
    theirs = _scheduler(beta_schedule=kind).betas
    assert ours.dtype == torch.float32 and ours.shape == (1000,)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    torch.testing.assert_close(obj.alphas_cumprod(ours), _scheduler(beta_schedule=kind).alphas_cumprod)
    with pytest.raises(ValueError, match="unknown beta schedule"):
        obj.beta_schedule("cosine", 10)  # type: ignore[arg-type]


def test_zero_terminal_snr_rescale() -> None:
    betas = obj.beta_schedule("scaled_linear")
    rescaled = obj.rescale_zero_terminal_snr(betas)
    torch.testing.assert_close(rescaled, _scheduler(rescale_betas_zero_snr=True).betas)
    ab, ab0 = obj.alphas_cumprod(rescaled), obj.alphas_cumprod(betas)
    assert ab[-1] == 0 and ab0[-1] > 0  # pure noise at the last step, some signal before the rescale
    torch.testing.assert_close(ab[0], ab0[0])  # the first step is unchanged
    assert (ab[1:] <= ab[:-1]).all()


def test_noisy_and_targets_match_diffusers() -> None:
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(5, 4, 8, 8, generator=g), torch.randn(5, 4, 8, 8, generator=g)
    t = torch.tensor([0, 1, 250, 998, 999])
    sched = _scheduler()
    ab = sched.alphas_cumprod
    torch.testing.assert_close(obj.ddpm_noisy(x0, noise, ab, t), sched.add_noise(x0, noise, t))
    assert torch.equal(obj.ddpm_target(x0, noise, ab, t, "epsilon"), noise)
    torch.testing.assert_close(obj.ddpm_target(x0, noise, ab, t, "v_prediction"), sched.get_velocity(x0, noise, t))
    with pytest.raises(ValueError, match="unknown prediction type"):
        obj.ddpm_target(x0, noise, ab, t, "sample")  # type: ignore[arg-type]


def test_v_target_recovers_x0_and_noise() -> None:
    """``x0 = sqrt(ab) x_t - sqrt(1 - ab) v`` and ``eps = sqrt(1 - ab) x_t + sqrt(ab) v``: v loses nothing."""
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    ab = obj.alphas_cumprod(obj.beta_schedule("scaled_linear"))
    t = torch.tensor([10, 500, 990])
    xt, v = obj.ddpm_noisy(x0, noise, ab, t), obj.ddpm_target(x0, noise, ab, t, "v_prediction")
    a = ab[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(a.sqrt() * xt - (1 - a).sqrt() * v, x0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((1 - a).sqrt() * xt + a.sqrt() * v, noise, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_weights_match_the_diffusers_training_scripts(prediction: str) -> None:
    sched = _scheduler(prediction_type=prediction)
    t = torch.tensor([0, 5, 100, 400, 999])
    snr = obj.snr(sched.alphas_cumprod, t)
    torch.testing.assert_close(snr, compute_snr(sched, t))
    gamma = 5.0
    # train_text_to_image.py: min(snr, gamma) / snr (epsilon) or / (snr + 1) (v_prediction)
    clipped = torch.stack([snr, gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    expected = clipped / snr if prediction == "epsilon" else clipped / (snr + 1)
    weights = obj.min_snr_weights(snr, gamma, prediction)  # type: ignore[arg-type]
    torch.testing.assert_close(weights, expected)
    assert weights.max() <= 1.0 + 1e-6
    if prediction == "epsilon":
        assert weights[-1] == 1.0 and weights[0] < 0.01  # noisy steps full weight, nearly clean steps down-weighted


def test_min_snr_at_zero_terminal_snr() -> None:
    snr = torch.tensor([0.0, 1.0, 10.0])
    assert obj.min_snr_weights(snr, 5.0, "v_prediction")[0] == 0
    with pytest.raises(ValueError, match="SNR > 0"):
        obj.min_snr_weights(snr, 5.0, "epsilon")


def test_offset_noise_is_constant_per_channel() -> None:
    g = torch.Generator().manual_seed(2)
    noise, per_channel = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 1, 1, generator=g)
    out = obj.offset_noise(noise, 0.1, per_channel)
    delta = out - noise
    torch.testing.assert_close(delta, (0.1 * per_channel).expand_as(noise))
    with pytest.raises(ValueError, match="does not fit"):
        obj.offset_noise(noise, 0.1, torch.randn(2, 4, 8, 8))


def test_discrete_timesteps() -> None:
    u = torch.tensor([0.0, 0.5, 0.999999, 1 - 1e-12])
    assert obj.discrete_timesteps(u, 1000).tolist() == [0, 500, 999, 999]
    assert obj.discrete_timesteps(u, 1000, 200, 300).tolist() == [200, 250, 299, 299]
    draws = obj.discrete_timesteps(torch.rand(20_000, generator=torch.Generator().manual_seed(0)), 1000)
    assert draws.dtype == torch.int64 and draws.min() == 0 and draws.max() == 999
    assert abs(draws.float().mean().item() - 499.5) < 10
    with pytest.raises(ValueError, match="timestep range"):
        obj.discrete_timesteps(u, 1000, 500, 400)
