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

SDXL and SD1.5 are trained as *discrete DDPM* models. A noise schedule of ``T`` (usually 1000) betas gives
``alpha_bar_t = prod_{s <= t} (1 - beta_s)``, and at an integer timestep ``t``::

    x_t = sqrt(alpha_bar_t) * x0 + sqrt(1 - alpha_bar_t) * eps        # noising (diffusers' ``add_noise``)
    target = eps                                                      # "epsilon" prediction (SD1.5, SDXL)
    target = sqrt(alpha_bar_t) * eps - sqrt(1 - alpha_bar_t) * x0     # "v_prediction" (SD2-768, v-pred finetunes)

The signal-to-noise ratio is ``SNR_t = alpha_bar_t / (1 - alpha_bar_t)``. Three refinements, each opt-in:

* **min-SNR-gamma** (Hang et al. 2023): low-noise timesteps have a huge SNR and dominate the gradient; weighting
  the MSE by ``min(SNR, gamma) / SNR`` (epsilon) or ``min(SNR, gamma) / (SNR + 1)`` (v) balances them (gamma 5).
* **noise offset** (Guttenberg 2023): adding ``offset * N(0, 1)`` per sample and channel (constant over the image)
  to the noise lets the model learn to change the mean brightness, so it can draw very dark or bright images.
* **zero terminal SNR** (Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps are Flawed"): the
  usual schedules leave some signal at ``t = T - 1``, which inference never sees; rescaling the betas makes the last
  step pure noise. The last step then has nothing to predict for epsilon, so it needs v-prediction (and, at
  inference, a scheduler with ``rescale_betas_zero_snr`` and ``timestep_spacing="trailing"``).

Every function takes its randomness as an argument or a ``torch.Generator`` so that evaluation can reuse fixed
(timestep, noise) pairs and resume can reproduce a run exactly.

**What the loss compares, and how it is weighted** (:meth:`~lightning_lora.families.base.DiffusionFamily.loss`). A
family's :class:`Prediction` is its denoiser's output and its target, both in the denoiser's layout (FLUX packs 2x2
latent patches into tokens: ``[B, tokens, 4C]``); three things change what is compared:

* **masks** (``data.images[].masks``): a weight per latent element, ``unmasked_weight + (1 - unmasked_weight) * m``
  with ``m`` in [0, 1] the mask at latent resolution (:func:`mask_weights`), packed by the family like its latents.
  :func:`masked_mse` is the *weighted mean* ``sum(w * (p - t)^2) / sum(w)`` per sample: the mean squared error over
  the region that trains, on the scale of the unmasked loss whatever the mask's area (a masked run and an unmasked one
  log comparable losses; each sample weighs the same in its batch). Where ``w`` is 0 the loss does not depend on the
  prediction at all: those elements get exactly zero gradient.
* **preservation** (:class:`Preservation`, ``model.preservation``): DreamBooth's class-image prior loss trains
  regularization images against their own target (``prior``); differential output preservation (``dop``) trains
  preservation samples against the frozen base model's own prediction with the adapter off (:class:`Reference`, put
  in by :func:`preserved_target`): the LoRA learns to leave them as the base draws them;
* **per-sample weights**: a folder's ``loss_weight`` (and the family's own, min-SNR) multiply each sample's loss, and
  the batch's loss is their plain mean (:func:`weighted_mean`): a weight is an absolute factor, not a share of the
  batch, so a batch of regularization images at weight 0.5 weighs half, whatever else the batch holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from lightning_lora.errors import ConfigError

__all__ = [
    "BetaSchedule",
    "Prediction",
    "PredictionType",
    "Preservation",
    "PreservationMode",
    "Reference",
    "SampleRole",
    "TimestepSampling",
    "alphas_cumprod",
    "beta_schedule",
    "ddpm_noisy",
    "ddpm_target",
    "discrete_timesteps",
    "flow_match_noisy",
    "flow_match_target",
    "mask_weights",
    "masked_mse",
    "per_sample_mse",
    "preserved_rows",
    "preserved_target",
    "resolution_shift",
    "sample_sigmas",
    "shift_sigmas",
    "weighted_mean",
]

TimestepSampling = Literal["logit_normal", "uniform", "flux_shift"]
PredictionType = Literal["epsilon", "v_prediction"]
BetaSchedule = Literal["linear", "scaled_linear", "squaredcos_cap_v2"]
PreservationMode = Literal["none", "prior", "dop"]
SampleRole = Literal["train", "regularization", "preservation"]
"""What a training sample is for: an image to learn (``train``), an image of a ``role: regularization`` folder, or a
training image again with the trigger removed from its caption (``preservation``, ``every_image``)."""


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


# ------------------------------------------------------------------------------ masks, preservation, sample weights


class Prediction(NamedTuple):
    """A family's denoiser output for a batch and what it is trained towards, in the denoiser's layout (the same shape),
    and the family's own weight per sample (min-SNR; None: 1)."""

    prediction: torch.Tensor
    target: torch.Tensor
    sample_weights: torch.Tensor | None = None


class Reference(NamedTuple):
    """DOP's target for some rows of a batch: the frozen base model's own ``prediction`` for them (the adapter off, no
    gradient), and which ``rows`` they are (indices into the batch; None: every row)."""

    prediction: torch.Tensor
    rows: torch.Tensor | None = None


def mask_weights(mask: torch.Tensor, unmasked_weight: float) -> torch.Tensor:
    """Per-element loss weights from a mask ``m`` in [0, 1] (1: train here): ``unmasked_weight + (1 -
    unmasked_weight) * m``. With ``unmasked_weight`` 0 the weight is the mask itself, exactly 0 where it is black."""
    if unmasked_weight == 0:
        return mask
    return unmasked_weight + (1.0 - unmasked_weight) * mask


def masked_mse(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted mean squared error per sample, ``sum(w * (p - t)^2) / sum(w)`` in float32, shape ``[batch]``;
    ``weights`` broadcast to the prediction's shape. See the module docstring: the unmasked loss's scale, and exactly
    zero gradient where a weight is 0. A sample whose weights are all 0 has loss 0."""
    diff = prediction.float() - target.float()
    w = weights.float().expand_as(diff)
    total = (w * diff.pow(2)).flatten(1).sum(dim=1)
    return total / w.flatten(1).sum(dim=1).clamp_min(torch.finfo(torch.float32).tiny)


def preserved_rows(roles: Sequence[str], mode: PreservationMode) -> list[int]:
    """The rows of a batch (their :data:`SampleRole` s) that train against the base model's own prediction: under
    ``dop`` every sample that is not a ``train`` sample; none otherwise (``prior`` trains regularization images against
    their own target)."""
    if mode != "dop":
        return []
    return [i for i, role in enumerate(roles) if role != "train"]


def preserved_target(target: torch.Tensor, reference: Reference) -> torch.Tensor:
    """``target`` with the rows of ``reference`` replaced by its prediction (DOP), in the target's dtype."""
    values = reference.prediction.detach().to(target.dtype)
    if reference.rows is None:
        return values
    return target.index_copy(0, reference.rows.to(target.device), values)


def weighted_mean(losses: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The batch's loss from per-sample ``losses`` and per-sample ``weights`` (None: each 1): ``mean(w * loss)``."""
    if weights is None:
        return losses.mean()
    return (losses * weights.to(losses.dtype)).mean()


@dataclass
class Preservation:
    """Keep what the base model does where the LoRA should not change it: ``model.preservation``.

    Args:
        mode: ``none``; ``prior``: class-image preservation (DreamBooth's prior loss): the images of the ``role:
            regularization`` folders of ``data.images`` train against their own target, each weighted by its folder's
            ``loss_weight``; ``dop``: differential output preservation: their target is the frozen base model's own
            prediction for the same noisy latent and caption with the adapter off, computed in the same step without
            gradients (one more forward of the denoiser in each batch that holds such samples; ``lightning-lora plan``
            counts it).
        every_image: with ``dop``, every training image also serves as a preservation sample with the trigger word
            removed from its caption (or replaced by ``class_word``): the LoRA learns to draw prompts without the
            trigger as the base does. Needs a trigger (``data.trigger`` or a folder's ``trigger``); the images of a
            folder without one have nothing to take out and are not repeated.
        class_word: the word that replaces the trigger in those captions (``person`` for ``sks person``); null
            removes the trigger.
        weight: the loss weight of those preservation samples (a regularization folder's ``loss_weight`` weighs its
            own images).
    """

    mode: PreservationMode = "none"
    every_image: bool = False
    class_word: str | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        modes = ("none", "prior", "dop")
        if self.mode not in modes:
            raise ConfigError(f"model.preservation.mode: {self.mode!r} is not one of {', '.join(modes)}.")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ConfigError(f"model.preservation.weight: {self.weight} must be a positive number (1: as an image).")
        if self.every_image and self.mode != "dop":
            raise ConfigError(
                "model.preservation.every_image: true trains each image without its trigger towards the base model's "
                f"own prediction, which is mode dop (the mode is {self.mode}); set model.preservation.mode: dop."
            )
        if self.class_word is not None and not self.every_image:
            raise ConfigError(
                "model.preservation.class_word replaces the trigger in the preservation captions of every_image: true; "
                "set model.preservation.every_image: true (with mode: dop), or remove class_word."
            )
        if self.class_word is not None and not self.class_word.strip():
            raise ConfigError("model.preservation.class_word is empty; give a word (e.g. person), or null.")

    @property
    def dop(self) -> bool:
        """Whether preservation samples train against the base model's own prediction (``mode: dop``)."""
        return self.mode == "dop"


# --------------------------------------------------------------------------------------------- discrete DDPM (UNets)


def beta_schedule(
    kind: BetaSchedule, num_train_timesteps: int = 1000, beta_start: float = 0.00085, beta_end: float = 0.012
) -> torch.Tensor:
    """The betas ``[T]`` (float32) of a scheduler config, exactly as diffusers' schedulers compute them.

    ``scaled_linear`` (SD1.x, SDXL: linear in sqrt(beta)), ``linear``, or ``squaredcos_cap_v2`` (the cosine schedule
    of Nichol & Dhariwal, capped at 0.999).
    """
    t = num_train_timesteps
    if kind == "scaled_linear":
        return torch.linspace(beta_start**0.5, beta_end**0.5, t, dtype=torch.float32) ** 2
    if kind == "linear":
        return torch.linspace(beta_start, beta_end, t, dtype=torch.float32)
    if kind == "squaredcos_cap_v2":

        def alpha_bar(x: float) -> float:
            return math.cos((x + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = [min(1 - alpha_bar((i + 1) / t) / alpha_bar(i / t), 0.999) for i in range(t)]
        return torch.tensor(betas, dtype=torch.float32)
    raise ValueError(f"unknown beta schedule {kind!r}; use scaled_linear, linear or squaredcos_cap_v2")


def rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Rescale ``betas`` so that the last timestep has zero SNR (Lin et al. 2023, Algorithm 1).

    ``sqrt(alpha_bar)`` is shifted so its last value is 0 and scaled so its first value is unchanged.
    """
    sqrt_ab = torch.cumprod(1.0 - betas, dim=0).sqrt()
    first, last = sqrt_ab[0].clone(), sqrt_ab[-1].clone()
    sqrt_ab = (sqrt_ab - last) * (first / (first - last))
    ab = sqrt_ab**2
    alphas = torch.cat([ab[:1], ab[1:] / ab[:-1]])
    return 1 - alphas


def alphas_cumprod(betas: torch.Tensor) -> torch.Tensor:
    """``alpha_bar_t = prod_{s <= t} (1 - beta_s)``, shape ``[T]``."""
    return torch.cumprod(1.0 - betas, dim=0)


def discrete_timesteps(
    fractions: torch.Tensor, num_train_timesteps: int, min_timestep: int = 0, max_timestep: int | None = None
) -> torch.Tensor:
    """Map draws ``u`` in [0, 1) to integer timesteps uniform in ``[min_timestep, max_timestep)`` (int64).

    The draws are made without knowing ``T`` (it comes with the model), so families sample ``u`` and map it here.
    """
    high = num_train_timesteps if max_timestep is None else max_timestep
    if not 0 <= min_timestep < high <= num_train_timesteps:
        raise ValueError(f"timestep range [{min_timestep}, {high}) is empty or outside [0, {num_train_timesteps})")
    t = min_timestep + torch.floor(fractions.double() * (high - min_timestep)).long()
    return t.clamp(min_timestep, high - 1)


def _gather(values: torch.Tensor, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    picked = values.to(like.device)[timesteps.to(like.device).long()]
    return picked.to(like.dtype).view(-1, *([1] * (like.ndim - 1)))


def ddpm_noisy(
    x0: torch.Tensor, noise: torch.Tensor, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    """``sqrt(alpha_bar_t) * x0 + sqrt(1 - alpha_bar_t) * noise`` per sample (diffusers' ``add_noise``)."""
    ab = _gather(alphas_cumprod, timesteps, x0)
    return ab.sqrt() * x0 + (1 - ab).sqrt() * noise


def ddpm_target(
    x0: torch.Tensor,
    noise: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor,
    prediction_type: PredictionType,
) -> torch.Tensor:
    """What the UNet predicts: ``noise`` (epsilon) or ``sqrt(ab) * noise - sqrt(1 - ab) * x0`` (v_prediction)."""
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        ab = _gather(alphas_cumprod, timesteps, x0)
        return ab.sqrt() * noise - (1 - ab).sqrt() * x0
    raise ValueError(f"unknown prediction type {prediction_type!r}; use epsilon or v_prediction")


def snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio ``alpha_bar_t / (1 - alpha_bar_t)`` at ``timesteps``, float32, shape ``[batch]``."""
    ab = alphas_cumprod.to(timesteps.device, torch.float32)[timesteps.long()]
    return ab / (1 - ab)


def min_snr_weights(snr_values: torch.Tensor, gamma: float, prediction_type: PredictionType) -> torch.Tensor:
    """Min-SNR-gamma loss weights ``[batch]``: ``min(SNR, gamma) / SNR`` (epsilon), ``/ (SNR + 1)`` (v).

    Both make the effective target the same: the x0 error weighted by ``min(SNR, gamma)``. A zero SNR (the last step
    of a zero-terminal-SNR schedule) gets weight 0 for v-prediction; epsilon cannot train there (see the module
    docstring) and raises.
    """
    clipped = snr_values.clamp(max=gamma)
    if prediction_type == "epsilon":
        if (snr_values <= 0).any():
            raise ValueError("min-SNR weighting with epsilon prediction needs SNR > 0 (no zero-terminal-SNR step)")
        return clipped / snr_values
    if prediction_type == "v_prediction":
        return clipped / (snr_values + 1)
    raise ValueError(f"unknown prediction type {prediction_type!r}; use epsilon or v_prediction")


def offset_noise(noise: torch.Tensor, offset: float, per_channel: torch.Tensor) -> torch.Tensor:
    """``noise + offset * per_channel``: ``per_channel`` is N(0, 1) of shape ``[B, C, 1, 1]``, constant over the image.

    The draw is an argument (not made here) so that the caller decides which random stream it comes from.
    """
    if per_channel.shape != (*noise.shape[:2], *([1] * (noise.ndim - 2))):
        shape, expected = tuple(per_channel.shape), tuple(noise.shape)
        raise ValueError(f"per-channel draw of shape {shape} does not fit noise {expected}")
    return noise + offset * per_channel.to(noise.dtype)
