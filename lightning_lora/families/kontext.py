"""FLUX.1 Kontext [dev]: FLUX.1-dev's transformer trained to edit, its control image's tokens beside the image's.

Kontext is FLUX.1 (:mod:`lightning_lora.families.flux`) in everything but one input: ``FluxKontextPipeline`` encodes the
control image with the same VAE and normalisation, packs it into 2x2-patch tokens like the noisy latents, and appends
them to the image tokens of every denoising step. Shapes, for a target of ``H x W`` pixels and a control of ``H' x
W'`` (here: the target's bucket, so ``H' = H``):

* ``hidden_states [B, (H/16)(W/16) + (H'/16)(W'/16), 64]``: the noisy target's tokens, then the control's;
* ``img_ids``: the target's ``(0, row, col)``, the control's ``(1, row, col)`` (the first axis tells them apart; rows
  and columns restart at 0);
* the transformer's output has one prediction per token; the pipeline keeps the first ``(H/16)(W/16)`` (the target's),
  and so does the loss. The timestep shift follows the target's tokens alone, as the pipeline's schedule does.

So a 1024x1024 target with its 1024x1024 control is twice FLUX.1's image tokens (8192 instead of 4096), which the
planner counts (:meth:`FluxKontext.example_inputs_with_controls`). A target without a control (a folder without
``controls``) trains text-to-image: the pipeline without an ``image`` draws that way too.

Training data: ``data.images[].controls: [<folder>]``, one control per target (the pipeline takes one image). Samples
draw with a fixed control per prompt (``SampleImages.controls``) at the sample's size, as ``FluxKontextPipeline(image=
..., _auto_resize=False, max_area=height * width)`` draws (by default it resizes the control to one of Kontext's
preferred sizes near 1024², and scales the output to about 1024²).

LoRA files: the transformer is FLUX.1's, module for module, so the files are FLUX.1's layouts (:class:`~lightning_lora.
families.flux.Flux`) and load where a FLUX.1 LoRA loads: ``FluxKontextPipeline.load_lora_weights`` (the same
``FluxLoraLoaderMixin``), ComfyUI (which builds Kontext as its FLUX model, ``model_base.Flux``, the control image being
a ``reference_latents`` conditioning, not weights: the FLUX key map applies unchanged) and kohya's ``lora_flux``
network. Their ModelSpec says ``flux-1-kontext-dev/lora`` and the kohya file's ``ss_base_model_version``
``flux1_kontext`` (musubi-tuner writes ``Flux.1-dev/lora`` for Kontext, which names FLUX.1: such a file is read as
FLUX.1's unless ``--family flux_kontext`` is passed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_lora.families.base import DiffusersModel, SampleSettings, SampleText
from lightning_lora.families.encoders import CLIP_L, T5_XXL
from lightning_lora.families.facts import Architecture, Editing, LoraFiles, Planning, RandomModels
from lightning_lora.families.flux import FLUX1_TRANSFORMER, Flux, latent_image_ids, pack_latents, with_control_tokens
from lightning_lora.formats.kohya import with_base_model_version

__all__ = ["FluxKontext", "KONTEXT_DEV", "kontext_controls"]

KONTEXT_DEV = "black-forest-labs/FLUX.1-Kontext-dev"
"""The hub id of FLUX.1 Kontext [dev] (its ``transformer/config.json`` is FLUX.1-dev's)."""


def kontext_controls(controls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Control latents ``[B, N, C, h, w]`` as ``FluxKontextPipeline`` appends them: packed tokens ``[B, N (h/2)(w/2),
    4C]`` and their ids ``[N (h/2)(w/2), 3]`` = ``(1, row, col)`` (each control's rows and columns from 0)."""
    b, n, c, h, w = controls.shape
    tokens = pack_latents(controls.reshape(b * n, c, h, w)).reshape(b, n * (h // 2) * (w // 2), 4 * c)
    ids = latent_image_ids(h, w, device=controls.device).repeat(n, 1)
    ids[:, 0] = 1
    return tokens, ids


class FluxKontext(Flux):
    """FLUX.1 Kontext [dev]: edit training on (control, target) pairs; the options are FLUX.1's (:class:`Flux`)."""

    name: ClassVar[str] = "flux_kontext"
    architecture: ClassVar[Architecture] = dataclasses.replace(
        Flux.architecture, pipeline_classes=("FluxKontextPipeline",)
    )
    planning: ClassVar[Planning] = dataclasses.replace(
        Flux.planning,
        known_denoisers={KONTEXT_DEV: FLUX1_TRANSFORMER},
        known_text_encoders={KONTEXT_DEV: {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL}},
    )
    lora_files: ClassVar[LoraFiles] = dataclasses.replace(
        Flux.lora_files,
        layouts=with_base_model_version(Flux.lora_files.layouts, "flux1_kontext"),
        modelspec={
            "architecture": "flux-1-kontext-dev/lora",
            "implementation": "https://github.com/black-forest-labs/flux",
        },
        markers=("kontext",),
    )
    editing: ClassVar[Editing] = Editing(max_controls=1)

    @override
    def with_controls(
        self, tokens: torch.Tensor, ids: torch.Tensor, controls: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if controls is None:
            return tokens, ids
        control_tokens, control_ids = kontext_controls(controls.to(tokens.device))
        return torch.cat([tokens, control_tokens.to(tokens.dtype)], dim=1), torch.cat([ids, control_ids.to(ids)])

    @override
    def sampling_inputs(self, pipeline: Any, text: SampleText, settings: SampleSettings) -> dict[str, Any]:
        """FLUX.1's, and ``max_area`` the sample's: the pipeline otherwise scales every output to about 1024²."""
        return {**super().sampling_inputs(pipeline, text, settings), "max_area": settings.height * settings.width}

    @override
    def control_inputs(self, images: list[Any]) -> dict[str, Any]:
        """The control as ``image``, kept at its size (``_auto_resize=False``: the pipeline would resize it to the
        Kontext resolution nearest its aspect ratio), the output drawn at its area (a sample's control is at the
        sample's size)."""
        if not images:
            return {}
        image = images[0]
        return {"image": image, "_auto_resize": False, "max_area": image.size[0] * image.size[1]}

    @classmethod
    @override
    def claims_lora_keys(cls, tensors: Mapping[str, torch.Tensor]) -> int:
        """0: a Kontext LoRA's names are FLUX.1's (its header tells them apart: ``flux-1-kontext-dev/lora``)."""
        return 0

    @override
    def example_inputs_with_controls(
        self,
        model: DiffusersModel,
        batch: int,
        height: int,
        width: int,
        text_len: int,
        controls: int,
        device: str,
        dtype: torch.dtype,
    ) -> dict[str, Any]:
        """FLUX.1's inputs with ``controls`` controls of the target's size appended (twice the image tokens for one)."""
        return with_control_tokens(self.example_inputs(model, batch, height, width, text_len, device, dtype), controls)

    @classmethod
    @override
    def save_tiny(cls, folder: Path, seed: int = 0) -> Path:
        from lightning_lora.tiny.kontext import save_tiny_kontext

        return save_tiny_kontext(folder, seed=seed)

    @classmethod
    @override
    def random_models(cls) -> RandomModels:
        from lightning_lora.tiny.kontext import RANDOM_KONTEXT

        return RANDOM_KONTEXT
