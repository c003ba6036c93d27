"""The EMA math of lightning_lora.ema: pure functions, no Lightning, no GPU.

The post-hoc reconstruction is checked on a synthetic run: a parameter vector that drifts and jitters as SGD's
weights do, averaged by the same update the callback runs, with power-function EMAs of widths 0.05 and 0.10 saved
every 50 of 1000 steps. Profiles that were also tracked directly come back from the snapshots within 1% of how far
that EMA is from the raw weights (its own size: a reconstruction that did nothing would be off by 100%), where the best
single snapshot is off by 11-23%. Measured: 0.01% for the width 0.075 (between the snapshots' widths) and 0.3% for
0.10 without its last snapshot (what is left is the gap between the discrete profiles the updates make and the
continuous ones the least squares fit, largest early in the run); so 1% leaves 3x room over the worse. An overlap
formula off by its time ratio for one ordering of the times already misses by 1.8%.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_lora import ema
from lightning_lora.errors import ConfigError

STEPS, EVERY, WIDTH = 1000, 50, 64
SIGMA_RELS = (0.05, 0.10)


def test_sigma_rel_and_gamma_are_inverse() -> None:
    for sigma_rel in (0.01, 0.05, 0.10, 0.2, ema.MAX_SIGMA_REL):
        gamma = ema.sigma_rel_to_gamma(sigma_rel)
        assert gamma >= -1e-9 and ema.gamma_to_sigma_rel(gamma) == pytest.approx(sigma_rel, rel=1e-9)
    assert ema.sigma_rel_to_gamma(0.05) == pytest.approx(16.97, abs=0.01)  # EDM2's two widths
    assert ema.sigma_rel_to_gamma(0.10) == pytest.approx(6.94, abs=0.01)


@pytest.mark.parametrize("bad", [0.0, -0.1, 0.3, math.nan])
def test_a_width_outside_the_power_profiles_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"LoraEMA.sigma_rels: .* \(0, 0.2887\]"):
        ema.check_sigma_rel(bad, "LoraEMA.sigma_rels")


def test_classic_ema_is_a_running_mean_first() -> None:
    """beta_k = min(decay, 1 - 1/k): the first update takes the weights, then every step counts equally until
    1 / (1 - decay) steps, then the decay."""
    values = [torch.tensor([float(k)]) for k in range(1, 21)]
    average = torch.zeros(1)
    for k, value in enumerate(values, start=1):
        ema.update([average], [value], ema.classic_beta(0.9, k))
        if k <= 10:
            assert average.item() == pytest.approx(sum(v.item() for v in values[:k]) / k)
    assert ema.classic_beta(0.9, 1) == 0.0 and ema.classic_beta(0.9, 100) == 0.9


def test_the_power_update_gives_the_power_profile() -> None:
    """The discrete update weights step k by (1 - beta_k) (k/t)**(gamma+1): the closed form, summing to 1."""
    t, gamma = 100, ema.sigma_rel_to_gamma(0.1)
    basis = torch.eye(t, dtype=torch.float64)
    average = torch.zeros(t, dtype=torch.float64)
    for k in range(1, t + 1):
        ema.update([average], [basis[k - 1]], ema.power_beta(gamma, k))
    closed = torch.tensor([(1 - ema.power_beta(gamma, k)) * (k / t) ** (gamma + 1) for k in range(1, t + 1)])
    torch.testing.assert_close(average, closed.double())
    assert float(average.sum()) == pytest.approx(1.0)
    # and the continuous profile (gamma + 1) tau**gamma / t**(gamma + 1) it approximates
    assert float(average[-1]) == pytest.approx((gamma + 1) / t, rel=0.05)


def test_profile_overlap_matches_numerical_integration() -> None:
    for t_a, g_a, t_b, g_b in [(100, 6.94, 100, 16.97), (50, 6.94, 200, 6.94), (300, 16.97, 120, 3.0)]:
        tau = torch.linspace(0, min(t_a, t_b), 200001, dtype=torch.float64)
        p_a = (g_a + 1) * tau**g_a / t_a ** (g_a + 1)
        p_b = (g_b + 1) * tau**g_b / t_b ** (g_b + 1)
        assert ema.profile_overlap(t_a, g_a, t_b, g_b) == pytest.approx(float(torch.trapezoid(p_a * p_b, tau)), 1e-6)


@pytest.fixture(scope="module")
def synthetic_run() -> tuple[list[ema.Profile], dict[float, torch.Tensor], torch.Tensor]:
    """A drifting, jittering parameter vector (float64) over :data:`STEPS` steps: power-function EMA snapshots of
    :data:`SIGMA_RELS` every :data:`EVERY` steps, EMAs tracked directly at the end (0.05, 0.075, 0.10), the final
    raw weights."""
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(WIDTH, generator=generator, dtype=torch.float64)
    tracked = (*SIGMA_RELS, 0.075)
    gammas = {s: ema.sigma_rel_to_gamma(s) for s in tracked}
    averages = {s: torch.zeros(WIDTH, dtype=torch.float64) for s in tracked}
    theta = torch.zeros(WIDTH, dtype=torch.float64)
    snapshots: list[ema.Profile] = []
    for k in range(1, STEPS + 1):
        noise = torch.randn(WIDTH, generator=generator, dtype=torch.float64)
        theta = theta + 0.01 * direction + 0.15 * noise / math.sqrt(k)  # learning, then settling
        for s in tracked:
            ema.update([averages[s]], [theta], ema.power_beta(gammas[s], k))
        if k % EVERY == 0:
            snapshots += [ema.Profile(k, s, {"w": averages[s].clone()}) for s in SIGMA_RELS]
    return snapshots, averages, theta


@pytest.mark.parametrize(
    ("sigma_rel", "leave_out"),
    [(0.075, None), (0.10, 0.10)],
    ids=["between-the-snapshot-widths", "a-snapshot-width-without-its-last-snapshot"],
)
def test_posthoc_reconstruction_matches_an_ema_tracked_directly(
    synthetic_run: tuple[list[ema.Profile], dict[float, torch.Tensor], torch.Tensor],
    sigma_rel: float,
    leave_out: float | None,
) -> None:
    snapshots, direct, raw = synthetic_run
    used = [p for p in snapshots if not (p.sigma_rel == leave_out and p.updates == STEPS)]
    state, line = ema.reconstruct(used, STEPS, sigma_rel)
    scale = float((direct[sigma_rel] - raw).norm())
    error = float((state["w"] - direct[sigma_rel]).norm()) / scale
    nearest = min(float((p.state["w"] - direct[sigma_rel]).norm()) / scale for p in used)
    assert error < 0.01, f"reconstruction off by {error:.2%} of the EMA's distance to the raw weights"
    assert nearest > 5 * error  # the combination, not one snapshot, is what matches
    assert f"sigma_rel {sigma_rel:g} after {STEPS} steps" in line


def test_a_tracked_profile_comes_back_exactly(
    synthetic_run: tuple[list[ema.Profile], dict[float, torch.Tensor], torch.Tensor],
) -> None:
    snapshots, direct, _ = synthetic_run
    coefficients = ema.posthoc_coefficients([(p.updates, p.gamma) for p in snapshots], (STEPS, snapshots[-1].gamma))
    assert coefficients[-1] == pytest.approx(1.0, abs=1e-9) and max(map(abs, coefficients[:-1])) < 1e-9
    state, _ = ema.reconstruct(snapshots, STEPS, 0.10)
    torch.testing.assert_close(state["w"], direct[0.10], rtol=1e-9, atol=1e-12)


def test_no_profile_after_the_last_snapshot() -> None:
    with pytest.raises(ValueError, match="after the last snapshot"):
        ema.posthoc_coefficients([(10, 6.9)], (20, 6.9))
    with pytest.raises(ValueError, match="no EMA snapshots"):
        ema.posthoc_coefficients([], (20, 6.9))


def test_weighted_sum_keeps_dtypes_and_refuses_mismatches() -> None:
    a = {"x": torch.ones(2, dtype=torch.float32), "y": torch.zeros(3, dtype=torch.bfloat16)}
    b = {"x": torch.full((2,), 3.0), "y": torch.ones(3, dtype=torch.bfloat16)}
    out = ema.weighted_sum([a, b], [0.25, 0.75])
    assert out["x"].tolist() == [2.5, 2.5] and out["y"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="y: missing"):
        ema.weighted_sum([a, {"x": b["x"]}], [0.5, 0.5])


def test_snapshot_files_round_trip(tmp_path: Path) -> None:
    profiles = [ema.Profile(40, s, {"a.lora_A.default.weight": torch.randn(2, 3)}) for s in SIGMA_RELS]
    path = ema.write_snapshot(tmp_path / ema.snapshot_name(40), 40, profiles)
    assert path.name == "posthoc-step000040.safetensors"
    read = ema.read_snapshot(path)
    assert [(p.updates, p.sigma_rel) for p in read] == [(40, 0.05), (40, 0.10)]
    for got, wrote in zip(read, profiles, strict=True):
        assert torch.equal(got.state["a.lora_A.default.weight"], wrote.state["a.lora_A.default.weight"])
    (tmp_path / "other.safetensors").write_bytes(b"not a snapshot")
    with pytest.raises(ValueError, match="not a readable EMA snapshot"):
        ema.read_snapshot(tmp_path / "other.safetensors")
