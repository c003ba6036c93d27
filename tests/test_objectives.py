"""Pure math: sigma sampling, shifting, rectified-flow noising/targets, per-sample loss (the learning-rate schedules
are in tests/test_schedules.py)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_lora import objectives as obj

N = 20_000


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- sample_sigmas -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["logit_normal", "uniform", "flux_shift"])
def test_sample_sigmas_range_dtype_and_determinism(mode: str) -> None:
    a = obj.sample_sigmas(N, mode, generator=_gen(1), shift=3.0)
    b = obj.sample_sigmas(N, mode, generator=_gen(1), shift=3.0)
    c = obj.sample_sigmas(N, mode, generator=_gen(2), shift=3.0)
    assert a.shape == (N,) and a.dtype == torch.float32 and a.device.type == "cpu"
    assert (a > 0).all() and (a < 1).all()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sample_sigmas_extreme_draws_are_clamped_away_from_ends() -> None:
    # A huge logit std puts many draws at sigmoid's saturated ends; they must still be strictly inside (0, 1).
    s = obj.sample_sigmas(N, "logit_normal", generator=_gen(), logit_std=100.0)
    assert s.min() >= 1e-4 and s.max() <= 1 - 1e-4
    assert (s == s.min()).sum() > 1  # the clamp is actually hit


def test_sample_sigmas_does_not_touch_global_rng_with_generator() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    obj.sample_sigmas(100, "logit_normal", generator=_gen())
    assert torch.equal(torch.rand(3), expected)


def test_logit_normal_distribution() -> None:
    s = obj.sample_sigmas(N, "logit_normal", generator=_gen())
    assert abs(s.median().item() - 0.5) < 0.02
    assert abs(s.mean().item() - 0.5) < 0.02
    # Concentrated on the middle: fewer draws in the outer tenths than a uniform draw would give (20%).
    outer = ((s < 0.1) | (s > 0.9)).float().mean().item()
    assert outer < 0.1
    # logit_mean moves the median to sigmoid(logit_mean).
    shifted = obj.sample_sigmas(N, "logit_normal", generator=_gen(), logit_mean=1.0)
    assert abs(shifted.median().item() - torch.sigmoid(torch.tensor(1.0)).item()) < 0.02


def test_uniform_distribution() -> None:
    s = obj.sample_sigmas(N, "uniform", generator=_gen())
    assert abs(s.mean().item() - 0.5) < 0.02
    assert abs(s.var().item() - 1 / 12) < 0.005
    assert abs(((s < 0.1).float().mean().item()) - 0.1) < 0.02


def test_flux_shift_moves_towards_noise() -> None:
    base = obj.sample_sigmas(N, "logit_normal", generator=_gen())
    shifted = obj.sample_sigmas(N, "flux_shift", generator=_gen(), shift=3.0)
    assert shifted.mean() > base.mean() + 0.1
    # Same underlying draws, shifted element by element.
    torch.testing.assert_close(shifted, obj.shift_sigmas(base, 3.0).clamp(1e-4, 1 - 1e-4))
    # shift = 1 is the identity.
    torch.testing.assert_close(obj.sample_sigmas(N, "flux_shift", generator=_gen(), shift=1.0), base)


def test_sample_sigmas_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown timestep sampling"):
        obj.sample_sigmas(4, "cosine")  # type: ignore[arg-type]


# -- shift / resolution --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [0.3, 1.0, 3.0, 7.5])
def test_shift_sigmas_fixes_ends_and_is_monotone(shift: float) -> None:
    x = torch.linspace(0, 1, 1001, dtype=torch.float64)
    y = obj.shift_sigmas(x, shift)
    assert y[0].item() == 0.0
    assert y[-1].item() == pytest.approx(1.0, abs=1e-12)
    assert (y.diff() > 0).all()
    mid = obj.shift_sigmas(torch.tensor(0.5, dtype=torch.float64), shift).item()
    if shift > 1:
        assert (y[1:-1] > x[1:-1]).all() and mid > 0.5
    elif shift < 1:
        assert (y[1:-1] < x[1:-1]).all() and mid < 0.5
    else:
        torch.testing.assert_close(y, x)


def test_shift_sigmas_inverse() -> None:
    x = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    torch.testing.assert_close(obj.shift_sigmas(obj.shift_sigmas(x, 3.0), 1 / 3.0), x)


def test_resolution_shift() -> None:
    assert obj.resolution_shift(256) == pytest.approx(math.exp(0.5))
    assert obj.resolution_shift(4096) == pytest.approx(math.exp(1.15))
    # Linear in tokens in between: 512x512 (1024 tokens).
    mu = 0.5 + (1.15 - 0.5) * (1024 - 256) / (4096 - 256)
    assert obj.resolution_shift(1024) == pytest.approx(math.exp(mu))
    assert obj.resolution_shift(256) < obj.resolution_shift(1024) < obj.resolution_shift(4096)


# -- noising, targets, loss ----------------------------------------------------------------------------------------


def test_flow_match_noisy_endpoints_and_midpoint() -> None:
    g = _gen()
    x0 = torch.randn(3, 4, 8, 8, generator=g)
    noise = torch.randn(3, 4, 8, 8, generator=g)
    torch.testing.assert_close(obj.flow_match_noisy(x0, noise, torch.zeros(3)), x0)
    torch.testing.assert_close(obj.flow_match_noisy(x0, noise, torch.ones(3)), noise)
    torch.testing.assert_close(obj.flow_match_noisy(x0, noise, torch.full((3,), 1e-6)), x0, atol=1e-5, rtol=0)
    # Per-sample sigma: sample i uses sigmas[i].
    sig = torch.tensor([0.0, 0.5, 1.0])
    out = obj.flow_match_noisy(x0, noise, sig)
    torch.testing.assert_close(out[0], x0[0])
    torch.testing.assert_close(out[1], 0.5 * (x0[1] + noise[1]))
    torch.testing.assert_close(out[2], noise[2])


def test_flow_match_noisy_keeps_dtype() -> None:
    x0 = torch.randn(2, 4, 4, 4, dtype=torch.bfloat16)
    out = obj.flow_match_noisy(x0, torch.randn_like(x0), torch.tensor([0.2, 0.7]))
    assert out.dtype == torch.bfloat16 and out.shape == x0.shape


def test_flow_match_target_is_the_velocity() -> None:
    g = _gen()
    x0 = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    noise = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    target = obj.flow_match_target(x0, noise)
    torch.testing.assert_close(target, noise - x0)
    # It is d x_sigma / d sigma: a finite difference along the path agrees.
    s, h = torch.tensor([0.3, 0.6], dtype=torch.float64), 1e-4
    fd = (obj.flow_match_noisy(x0, noise, s + h) - obj.flow_match_noisy(x0, noise, s - h)) / (2 * h)
    torch.testing.assert_close(fd, target)


def test_per_sample_mse() -> None:
    pred = torch.zeros(3, 2, 4, 4)
    target = torch.zeros(3, 2, 4, 4)
    target[0] = 1.0
    target[1, 0] = 2.0  # half the elements of sample 1 differ by 2
    loss = obj.per_sample_mse(pred, target)
    assert loss.shape == (3,) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.tensor([1.0, 2.0, 0.0]))
    a, b = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    torch.testing.assert_close(obj.per_sample_mse(a, b).mean(), torch.nn.functional.mse_loss(a, b))


def test_per_sample_mse_computes_in_float32() -> None:
    pred = torch.randn(2, 16, 16).to(torch.bfloat16)
    target = torch.randn(2, 16, 16).to(torch.bfloat16)
    loss = obj.per_sample_mse(pred, target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, (pred.float() - target.float()).pow(2).flatten(1).mean(1))


# -- masks, preservation, sample weights --------------------------------------------------------------------------


def test_masked_mse_is_the_weighted_mean_and_gives_no_gradient_where_the_weight_is_zero() -> None:
    """The masked loss is the mean squared error over the weighted region (the unmasked loss's scale: a half mask of
    a uniform error is that error), exactly zero gradient where a weight is 0, 0 (not NaN) for an all-zero mask, and
    with weights of 1 the plain per-sample MSE."""
    g = _gen(3)
    prediction = torch.randn(3, 4, 6, 8, generator=g, requires_grad=True)
    target = torch.randn(3, 4, 6, 8, generator=g)
    weights = torch.ones(3, 1, 6, 8)
    weights[0, ..., :4] = 0.0  # half of sample 0 ignored
    weights[1, ..., 2:5, :] = 0.25  # part of sample 1 weighed a quarter
    weights[2] = 0.0  # all of sample 2 ignored
    losses = obj.masked_mse(prediction, target, weights)
    diff2 = (prediction - target).detach() ** 2
    torch.testing.assert_close(losses[0], diff2[0, ..., 4:].mean())
    w1 = weights[1].expand_as(diff2[1])
    torch.testing.assert_close(losses[1], (w1 * diff2[1]).sum() / w1.sum())
    assert losses[2] == 0
    losses.sum().backward()
    assert prediction.grad is not None
    assert torch.all(prediction.grad[0, ..., :4] == 0) and torch.all(prediction.grad[2] == 0)
    assert torch.all(prediction.grad[0, ..., 4:] != 0) and torch.all(prediction.grad[1] != 0)
    uniform_error = torch.full((1, 2, 4, 4), 3.0)
    half = torch.ones(1, 1, 4, 4)
    half[..., :2] = 0
    assert obj.masked_mse(uniform_error, torch.zeros_like(uniform_error), half).item() == 9.0
    ones = torch.ones(3, 1, 6, 8)
    torch.testing.assert_close(obj.masked_mse(prediction, target, ones), obj.per_sample_mse(prediction, target))


def test_mask_weights_put_the_unmasked_weight_outside_the_mask() -> None:
    mask = torch.tensor([0.0, 0.5, 1.0])
    assert obj.mask_weights(mask, 0.0) is mask  # exactly the mask: black stays exactly 0
    assert obj.mask_weights(mask, 0.2).tolist() == pytest.approx([0.2, 0.6, 1.0])
    assert obj.mask_weights(mask, 1.0).tolist() == [1.0, 1.0, 1.0]


def test_preserved_target_replaces_the_reference_rows_and_the_batch_mean_keeps_absolute_weights() -> None:
    target = torch.zeros(3, 2)
    reference = torch.ones(2, 2, dtype=torch.bfloat16)
    out = obj.preserved_target(target, obj.Reference(reference, torch.tensor([0, 2])))
    assert out.dtype == torch.float32 and out.tolist() == [[1, 1], [0, 0], [1, 1]] and target.sum() == 0
    assert torch.equal(obj.preserved_target(target[:2], obj.Reference(reference)), reference.float())
    losses = torch.tensor([1.0, 2.0, 4.0])
    assert obj.weighted_mean(losses, None).item() == pytest.approx(7 / 3)
    # absolute factors, not shares of the batch: a batch of half-weight samples weighs half
    assert obj.weighted_mean(losses, torch.tensor([0.5, 0.5, 0.5])).item() == pytest.approx(7 / 6)
    roles = ["train", "regularization", "preservation", "train"]
    assert obj.preserved_rows(roles, "dop") == [1, 2]
    assert obj.preserved_rows(roles, "prior") == [] and obj.preserved_rows(roles, "none") == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "dpo"}, r"model.preservation.mode: 'dpo' is not one of none, prior, dop"),
        ({"mode": "dop", "weight": 0.0}, r"model.preservation.weight: 0.0 must be a positive number"),
        ({"mode": "prior", "every_image": True}, r"every_image: true .* which is mode dop \(the mode is prior\)"),
        ({"mode": "dop", "class_word": "dog"}, r"class_word replaces the trigger .* set model.preservation.every"),
        ({"mode": "dop", "every_image": True, "class_word": " "}, r"model.preservation.class_word is empty"),
    ],
)
def test_preservation_options_refuse_what_cannot_work_in_one_line(options: dict, message: str) -> None:
    from lightning_lora.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as caught:
        obj.Preservation(**options)
    assert "\n" not in str(caught.value)
    assert obj.Preservation(mode="dop", every_image=True, class_word="dog").dop
