"""The tiny FLUX.1 Kontext pipeline: the tiny FLUX.1's components (:mod:`lightning_lora.tiny.flux`: the transformer
with its guidance embedder, the VAE, CLIP and T5 with their hand-built tokenizers, FLUX.1-dev's scheduler config) in
a ``FluxKontextPipeline``, which is all that tells Kontext apart: the same transformer, fed the control image's tokens
beside the image's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from diffusers import FluxKontextPipeline

from lightning_lora.tiny.flux import RANDOM_FLUX, build_tiny_flux
from lightning_lora.tiny.shared import _save_tiny

__all__ = ["RANDOM_KONTEXT", "build_tiny_kontext", "save_tiny_kontext"]


def build_tiny_kontext(seed: int = 0) -> FluxKontextPipeline:
    """A FLUX.1-Kontext-dev-shaped ``FluxKontextPipeline`` with tiny random weights (those of
    :func:`~lightning_lora.tiny.flux.build_tiny_flux` for the same ``seed``)."""
    flux = build_tiny_flux(seed=seed)
    parts = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")
    return FluxKontextPipeline(**{name: getattr(flux, name) for name in parts})


def save_tiny_kontext(folder: Path, seed: int = 0) -> Path:
    """Build the tiny Kontext pipeline and save it to ``folder`` (atomically, idempotent; see
    :func:`lightning_lora.tiny.flux.save_tiny_flux`)."""
    wanted = {"family": "flux_kontext", "seed": seed}
    return _save_tiny(Path(folder), wanted, lambda: build_tiny_kontext(seed), "FLUX.1 Kontext")


RANDOM_KONTEXT = dataclasses.replace(RANDOM_FLUX, denoiser="black-forest-labs/FLUX.1-Kontext-dev")
"""What the benchmark builds for FLUX.1 Kontext with random weights: FLUX.1-dev's transformer and scheduler."""
