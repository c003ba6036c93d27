"""The training objective as pure functions: timestep sampling, noising, targets, loss.

FLUX is trained with *rectified flow* (flow matching on a straight path). With clean latents ``x0``, Gaussian noise
``eps`` and a noise level ``sigma`` in (0, 1)::

    x_sigma = (1 - sigma) * x0 + sigma * eps          # the point on the straight line from data to noise
    target  = eps - x0                                 # its velocity d x_sigma / d sigma, what the model predicts

Which ``sigma`` values are drawn decides what the LoRA learns. Uniform sampling spends as many steps on nearly clean
images as on pure noise. SD3 (Esser et al. 2024, "Scaling Rectified Flow Transformers") found *logit-normal* sampling
best: ``sigma = sigmoid(m + s * z)`` with ``z ~ N(0, 1)``, which concentrates on the middle of the path. FLUX's own
sampler *shifts* its schedule towards noise for large images: ``sigma' = shift * sigma / (1 + (shift - 1) * sigma)``
with ``shift = exp(mu)`` and ``mu`` growing linearly with the number of image tokens (0.5 at 256 tokens, 1.15 at
4096). Training with the same shift ("flux_shift") matches what the model sees at inference.

Every function takes its randomness as an argument or a ``torch.Generator`` so that evaluation can reuse fixed
(timestep, noise) pairs and resume can reproduce a run exactly.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = [
    "TimestepSampling",
    "flow_match_noisy",
    "flow_match_target",
    "per_sample_mse",
    "resolution_shift",
    "sample_sigmas",
    "shift_sigmas",
]

TimestepSampling = Literal["logit_normal", "uniform", "flux_shift"]


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Move noise levels towards 1 (``shift > 1``) or 0 (``shift < 1``); 0 and 1 stay fixed."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def resolution_shift(
    image_tokens: int,
    base_tokens: int = 256,
    max_tokens: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's resolution-dependent shift ``exp(mu)``, ``mu`` linear in the image token count.

    The defaults are FLUX.1-dev's scheduler config (``base_image_seq_len``, ``max_image_seq_len``, ``base_shift``,
    ``max_shift``); 1024x1024 is 4096 tokens, 512x512 is 1024.
    """
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    mu = base_shift + slope * (image_tokens - base_tokens)
    return math.exp(mu)


def sample_sigmas(
    n: int,
    mode: TimestepSampling = "logit_normal",
    *,
    generator: torch.Generator | None = None,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    shift: float = 1.0,
) -> torch.Tensor:
    """Draw ``n`` noise levels in (0, 1) on the CPU, as float32.

    ``logit_normal``: ``sigmoid(logit_mean + logit_std * z)``; ``uniform``: U(0, 1); ``flux_shift``: a logit-normal
    draw moved by ``shift`` (see :func:`resolution_shift`), which is what FLUX's inference schedule does.
    """
    if mode == "uniform":
        sigmas = torch.rand(n, generator=generator)
    else:
        z = torch.randn(n, generator=generator)
        sigmas = torch.sigmoid(logit_mean + logit_std * z)
        if mode == "flux_shift":
            sigmas = shift_sigmas(sigmas, shift)
        elif mode != "logit_normal":
            raise ValueError(f"unknown timestep sampling {mode!r}; use logit_normal, uniform or flux_shift")
    # Keep away from the exact ends: sigma = 0 has no noise to remove, sigma = 1 no signal.
    return sigmas.clamp(1e-4, 1 - 1e-4)


def _expand(sigmas: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sigmas.to(like.dtype).view(-1, *([1] * (like.ndim - 1)))


def flow_match_noisy(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The rectified-flow interpolation ``(1 - sigma) * x0 + sigma * noise``, ``sigmas`` of shape ``[batch]``."""
    s = _expand(sigmas, x0)
    return (1 - s) * x0 + s * noise


def flow_match_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the model predicts: ``noise - x0``."""
    return noise - x0


def per_sample_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error per sample, computed in float32; shape ``[batch]``."""
    diff = prediction.float() - target.float()
    return diff.pow(2).flatten(1).mean(dim=1)
