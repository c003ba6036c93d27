"""Exponential moving averages of the LoRA, as pure functions: the decay of each update, the power-function profiles
of Karras et al. 2024 and the post-hoc reconstruction of any profile from a run's snapshots.

An EMA keeps ``ema_k = beta_k * ema_(k-1) + (1 - beta_k) * theta_k`` after optimizer step ``k`` (``k`` = 1, 2, ...),
so the averaged weights are a weighted sum of every step's weights, ``ema_t = sum_k w_k theta_k`` with
``w_k = (1 - beta_k) * prod_(j > k) beta_j``: the *profile* of the average. Two kinds are kept here:

* **The classic EMA** of one ``decay``: ``beta_k = min(decay, 1 - 1/k)`` (:func:`classic_beta`). The first
  ``1 / (1 - decay)`` updates are a plain running mean (``beta_1 = 0``: the average starts at the first step's weights,
  not at the zero-initialised ``lora_B``), then the weights of about the last ``1 / (1 - decay)`` steps count.
* **Power-function EMAs** (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models",
  EDM2): ``beta_k = (1 - 1/k) ** (gamma + 1)`` (:func:`power_beta`). Its weights are
  ``w_k = (1 - beta_k) * (k / t) ** (gamma + 1)``, the discrete form of the profile ``p(tau) = (gamma + 1) tau**gamma /
  t**(gamma + 1)`` on ``[0, t]``: the same shape *relative to the run's length* at every ``t``, so a profile is named
  by its width as a fraction of the run, ``sigma_rel`` (the standard deviation of ``tau / t`` under ``p``,
  ``sigma_rel**2 = (gamma + 1) / ((gamma + 2)**2 (gamma + 3))``: :func:`sigma_rel_to_gamma`). ``sigma_rel`` 0.05
  averages about the last tenth of the run, 0.10 about the last fifth.

**Post-hoc EMA.** A run that saves the power-function EMAs of two widths every N steps (``snapshots``) can give,
after training, the average of *any* width at any saved time: the profile wanted is approximated by a linear
combination of the snapshots' profiles, in the least-squares sense over ``tau`` (:func:`posthoc_coefficients`: the
Gram matrix of the profiles, whose entries have a closed form, :func:`profile_overlap`), and the same combination of
the snapshots' tensors is the reconstructed average (:func:`weighted_sum`). A profile that is one of the snapshots
comes back as that snapshot (its coefficient 1, the others 0, up to rounding).

The average of a LoRA is taken of its factors, ``lora_A`` and ``lora_B`` each, as every trainer that averages LoRAs
does: the product of the averages is not the average of the products ``B @ A``, but for the small late-run steps an
EMA averages the two agree to first order.

**Snapshot files** (:func:`write_snapshot`, :func:`read_snapshot`): one safetensors file per saved step,
``posthoc-step000500.safetensors``, holding every power-function EMA of that step under ``sigma_rel=<width>/<name>``
(the LoRA parameters' names in the training model), with the update count and the widths in its metadata: LoRA tensors
only, a few MB to a few hundred MB each.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from lightning_lora.errors import ConfigError

__all__ = [
    "MAX_SIGMA_REL",
    "Profile",
    "check_decay",
    "check_sigma_rel",
    "classic_beta",
    "gamma_to_sigma_rel",
    "posthoc_coefficients",
    "power_beta",
    "profile_overlap",
    "read_snapshot",
    "reconstruct",
    "sigma_rel_to_gamma",
    "snapshot_name",
    "update",
    "weighted_sum",
    "write_snapshot",
]

MAX_SIGMA_REL = math.sqrt(1 / 12)
"""The widest power-function profile with ``gamma >= 0`` (0.2887: ``gamma = 0``, a uniform average of the whole run)."""


def check_decay(decay: float, option: str) -> None:
    """A classic EMA's decay is in (0, 1); a :class:`ConfigError` naming ``option`` otherwise."""
    if not 0.0 < decay < 1.0:
        raise ConfigError(f"{option}: {decay} must be between 0 and 1 (0.99: about the last 100 steps count).")


def check_sigma_rel(sigma_rel: float, option: str) -> None:
    """A power-function profile's ``sigma_rel`` is in (0, :data:`MAX_SIGMA_REL`]; a :class:`ConfigError` naming
    ``option`` otherwise."""
    if not (math.isfinite(sigma_rel) and 0.0 < sigma_rel <= MAX_SIGMA_REL):
        raise ConfigError(
            f"{option}: {sigma_rel} is not a power-function EMA width; give a sigma_rel in (0, {MAX_SIGMA_REL:.4f}] "
            "(0.05: about the last tenth of the run, 0.10: the last fifth)."
        )


def classic_beta(decay: float, step: int) -> float:
    """The decay of update ``step`` (1, 2, ...) of a classic EMA: ``min(decay, 1 - 1/step)`` (a running mean first)."""
    return min(decay, 1.0 - 1.0 / step)


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent ``gamma`` of the power-function profile of relative width ``sigma_rel``: the largest real root of
    ``gamma**3 + 7 gamma**2 + (16 - s) gamma + (12 - s) = 0`` with ``s = sigma_rel**-2`` (the width's formula, see
    the module docstring, multiplied out)."""
    check_sigma_rel(sigma_rel, "sigma_rel")
    s = sigma_rel**-2
    roots = np.roots([1.0, 7.0, 16.0 - s, 12.0 - s])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-9))


def gamma_to_sigma_rel(gamma: float) -> float:
    """The relative width of the power-function profile of exponent ``gamma``."""
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def power_beta(gamma: float, step: int) -> float:
    """The decay of update ``step`` (1, 2, ...) of the power-function EMA of exponent ``gamma``:
    ``(1 - 1/step) ** (gamma + 1)`` (0 at the first: it starts at the first step's weights)."""
    return (1.0 - 1.0 / step) ** (gamma + 1.0)


def update(averages: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], beta: float) -> None:
    """``average = beta * average + (1 - beta) * weight`` in place, for each pair (one fused kernel per device)."""
    if averages:
        torch._foreach_lerp_(list(averages), list(weights), 1.0 - beta)


def profile_overlap(t_a: float, gamma_a: float, t_b: float, gamma_b: float) -> float:
    """The inner product ``integral p_a(tau) p_b(tau) dtau`` of the power-function profiles ``(t_a, gamma_a)`` and
    ``(t_b, gamma_b)`` (each ``(gamma + 1) tau**gamma / t**(gamma + 1)`` on ``[0, t]``)::

        (gamma_a + 1)(gamma_b + 1) / (gamma_a + gamma_b + 1) * (t_min / t_other)**gamma_other / t_other

    where ``t_other`` is the later of the two times and ``gamma_other`` its exponent (written with the ratio of the
    times, which stays finite for long runs and large exponents)."""
    if t_a <= t_b:
        ratio, later, gamma_later = t_a / t_b, t_b, gamma_b
    else:
        ratio, later, gamma_later = t_b / t_a, t_a, gamma_a
    scale = (gamma_a + 1.0) * (gamma_b + 1.0) / (gamma_a + gamma_b + 1.0)
    return scale * ratio**gamma_later / later


def posthoc_coefficients(snapshots: Sequence[tuple[float, float]], target: tuple[float, float]) -> list[float]:
    """The combination of ``snapshots`` (each ``(t, gamma)``: a power-function EMA saved after update ``t``) whose
    profile is closest to ``target`` ``(t, gamma)`` in the least-squares sense, scaled to sum to 1 (a weighted average
    of weights, as every EMA is).

    Solves ``A c = b`` with ``A_ij = <p_i, p_j>`` and ``b_i = <p_i, p_target>`` (:func:`profile_overlap`) in float64;
    a Gram matrix that is singular to rounding (two snapshots of the same profile) takes the least-norm solution.
    Raises ``ValueError`` without snapshots, or for a target after the last snapshot (nothing saved can tell what the
    weights did after it)."""
    if not snapshots:
        raise ValueError("no EMA snapshots to combine")
    latest = max(t for t, _ in snapshots)
    if target[0] > latest:
        raise ValueError(f"the target time {target[0]:g} is after the last snapshot ({latest:g})")
    gram = np.array([[profile_overlap(*a, *b) for b in snapshots] for a in snapshots], dtype=np.float64)
    rhs = np.array([profile_overlap(*a, *target) for a in snapshots], dtype=np.float64)
    # Scaled to a unit diagonal: the entries fall as 1/t, and lstsq's cut-off of small singular values is relative.
    scale = 1.0 / np.sqrt(np.diag(gram))
    solution = np.linalg.lstsq(gram * scale[:, None] * scale[None, :], rhs * scale, rcond=1e-13)[0] * scale
    total = float(solution.sum())
    if not math.isfinite(total) or abs(total) < 1e-12:
        raise ValueError("the EMA snapshots cannot represent this profile (their combination sums to 0)")
    return [float(c) / total for c in solution]


def weighted_sum(
    states: Sequence[Mapping[str, torch.Tensor]], coefficients: Sequence[float]
) -> dict[str, torch.Tensor]:
    """``sum_i coefficients[i] * states[i]`` tensor by tensor (accumulated in float64, returned in each tensor's
    dtype); every state must have the same keys and shapes (``ValueError`` naming the first that does not)."""
    if len(states) != len(coefficients) or not states:
        raise ValueError(f"{len(states)} states for {len(coefficients)} coefficients")
    keys = list(states[0])
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        first = states[0][key]
        total = torch.zeros(first.shape, dtype=torch.float64)
        for state, c in zip(states, coefficients, strict=True):
            tensor = state.get(key)
            if tensor is None or tensor.shape != first.shape:
                raise ValueError(f"{key}: missing or of another shape in one of the EMA snapshots")
            total += c * tensor.detach().to("cpu", torch.float64)
        out[key] = total.to(first.dtype)
    extra = [k for state in states for k in state if k not in out]
    if extra:
        raise ValueError(f"{extra[0]}: in one EMA snapshot but not in the others")
    return out


# -- snapshots -------------------------------------------------------------------------------------------------------


class Profile(NamedTuple):
    """One power-function EMA of the LoRA: its tensors after ``updates`` optimizer steps, of width ``sigma_rel``."""

    updates: int
    sigma_rel: float
    state: Mapping[str, torch.Tensor]

    @property
    def gamma(self) -> float:
        return sigma_rel_to_gamma(self.sigma_rel)


_METADATA = "lightning_lora.ema"


def snapshot_name(step: int) -> str:
    """The file name of the snapshot of global step ``step``."""
    return f"posthoc-step{step:06d}.safetensors"


def write_snapshot(path: str | Path, step: int, profiles: Sequence[Profile]) -> Path:
    """Write the power-function EMAs ``profiles`` (all of the same update count) of global step ``step`` to ``path``
    (safetensors, atomically)."""
    from lightning_lora.io import save_safetensors

    tensors = {f"sigma_rel={p.sigma_rel!r}/{name}": t for p in profiles for name, t in p.state.items()}
    meta = {"step": step, "updates": [p.updates for p in profiles], "sigma_rels": [p.sigma_rel for p in profiles]}
    return save_safetensors(tensors, path, metadata={_METADATA: json.dumps(meta)})


def read_snapshot(path: str | Path) -> list[Profile]:
    """The profiles in a snapshot file (:func:`write_snapshot`); ``ValueError`` naming the file when it is not one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[_METADATA])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safe_open has no iterator
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: not a readable EMA snapshot ({type(e).__name__}: {e})") from None
    profiles = []
    for updates, sigma_rel in zip(meta["updates"], meta["sigma_rels"], strict=True):
        prefix = f"sigma_rel={sigma_rel!r}/"
        state = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        profiles.append(Profile(int(updates), float(sigma_rel), state))
    return profiles


def reconstruct(profiles: Sequence[Profile], updates: int, sigma_rel: float) -> tuple[dict[str, torch.Tensor], str]:
    """The power-function EMA of width ``sigma_rel`` after ``updates`` optimizer steps, combined from ``profiles``
    (:func:`posthoc_coefficients`, :func:`weighted_sum`), and one line saying from what."""
    usable = [p for p in profiles if 0 < p.updates <= updates]
    target = (updates, sigma_rel_to_gamma(sigma_rel))
    coefficients = posthoc_coefficients([(p.updates, p.gamma) for p in usable], target)
    state = weighted_sum([p.state for p in usable], coefficients)
    widths = ", ".join(f"{s:g}" for s in sorted({p.sigma_rel for p in usable}))
    steps = sorted({p.updates for p in usable})
    return state, (
        f"sigma_rel {sigma_rel:g} after {updates} steps, from {len(usable)} power-function EMAs (sigma_rel {widths}) "
        f"saved at {len(steps)} steps ({steps[0]}..{steps[-1]})"
    )
