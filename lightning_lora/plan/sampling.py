"""What drawing sample images during training adds to the GPU memory, measured on the ``meta`` device: the
denoiser's no-grad forward at the sampling batch and the VAE's decode at full resolution
(:mod:`lightning_lora.plan.estimate` adds it to the run's static memory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.plan.live_bytes import flash_like_attention, module_copy, peak_bytes

__all__ = ["VAE_DECODE_WORKSPACE", "SamplingPieces", "autocast_dtype", "sampling_bytes", "sampling_pieces"]


def autocast_dtype(recipe: ModelRecipe) -> torch.dtype | None:
    """The dtype training and sampling run the forward under autocast to (none for an fp32 base)."""
    return recipe.precision.base_dtype if recipe.precision.autocasts else None


# What the GPU allocates during the VAE decode beyond the tensors the meta device counts (cuDNN's workspaces for the
# full-resolution convolutions), as a fraction of the counted decode peak. Calibrated on an H200 (tools/bench.py
# --sample-steps 4, 2026-12-01): the sample peak less the planned static memory was 3.45-3.52 GiB at 1024x1024 (SDXL,
# FLUX.1: 1.25-1.33x the counted 2.5 GiB decode plus the VAE's weights) and 0.76-0.80 GiB at 512x512 (SD1.5, FLUX.1:
# 1.0x the counted 0.625 GiB); 0.25 splits the difference, within 7% of all six measured runs.
VAE_DECODE_WORKSPACE = 0.25


@dataclass(frozen=True)
class SamplingPieces:
    """What drawing one sample image adds to the GPU memory, in bytes, each measured on the ``meta`` device."""

    denoiser: float
    """The peak of one no-grad forward pass of the denoiser at the family's sampling batch, under autocast."""
    decode: float
    """The peak of the VAE's decode of one image at full resolution, under autocast."""
    vae_weights: float
    """The VAE's weights (on the GPU for the whole sampling: the callback moves it there first)."""

    @property
    def total(self) -> float:
        """The VAE's weights and the larger transient (the denoiser's and the decode's never overlap), the decode
        with :data:`VAE_DECODE_WORKSPACE`."""
        return self.vae_weights + max(self.denoiser, self.decode * (1 + VAE_DECODE_WORKSPACE))


_SAMPLING: dict[str, SamplingPieces] = {}


def sampling_pieces(
    recipe: ModelRecipe, model: nn.Module, height: int, width: int, text_len: int
) -> SamplingPieces | None:
    """The pieces of :class:`SamplingPieces` for one ``height x width`` sample image of ``recipe``'s model (``model``:
    its denoiser skeleton on the ``meta`` device), as the sampler runs it: under the precision's autocast, attention
    as the flash / memory-efficient kernels allocate it. None when the family declares no VAE architecture."""
    import diffusers

    from lightning_lora.families.base import build_from_config

    family, source = recipe.family, recipe.source
    config = family.vae_config_for(source)
    if config is None:
        return None
    autocast = autocast_dtype(recipe)
    key = repr((type(family), sorted(vars(family).items()), source, config, autocast, height, width, text_len))
    if key in _SAMPLING:
        return _SAMPLING[key]
    inputs = family.example_inputs(
        model, family.planning.sampling_batch, height, width, text_len, device="meta", dtype=source.dtype
    )
    running = module_copy(model)  # a forward may fill a model's caches (RoPE tables): the next one counts them too
    with flash_like_attention():
        denoiser, _ = peak_bytes(lambda: running(**inputs), autocast)
    dtype = family.sampling_vae_dtype(config, source.dtype)
    vae: Any = build_from_config(getattr(diffusers, config["_class_name"]), config, dtype)
    latents = torch.empty(family.sampling_latent_shape(config, height, width), device="meta", dtype=dtype)
    with flash_like_attention():
        decode, _ = peak_bytes(lambda: vae.decode(latents, return_dict=False)[0], autocast)
    weights = sum(p.numel() * p.element_size() for p in vae.parameters())
    pieces = SamplingPieces(float(denoiser), float(decode), float(weights))
    if len(_SAMPLING) > 64:
        _SAMPLING.clear()
    _SAMPLING[key] = pieces
    return pieces


def sampling_bytes(recipe: ModelRecipe, model: nn.Module, height: int, width: int, text_len: int) -> float:
    """Bytes that drawing a ``height x width`` sample image adds to the training run's static memory: the measured
    :class:`SamplingPieces`, or the family's own estimate (:meth:`~lightning_lora.families.base.DiffusionFamily.
    sampling_bytes`) for a family that declares no VAE architecture."""
    pieces = sampling_pieces(recipe, model, height, width, text_len)
    if pieces is None:
        return recipe.family.sampling_bytes(model, height, width, text_len)
    return pieces.total
