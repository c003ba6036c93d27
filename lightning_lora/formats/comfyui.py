"""The ComfyUI layout: ``diffusion_model.<module>`` keys, the module named as ComfyUI builds the model.

Why a layout of its own
-----------------------
ComfyUI finds a LoRA's layers through a key map (``comfy/lora.py`` ``model_lora_keys_unet``). Part of that map is the
same in every release since mid-2024 and for every model: for each weight ``diffusion_model.<name>.weight`` of the model
as ComfyUI builds it, the keys ``diffusion_model.<name>`` ("generic lora format without any weird key names") and
``lora_unet_<name with _>``. The rest are per-model rules added with each model, or later: the diffusers names of a FLUX
LoRA under ``transformer.`` (``comfy/utils.py`` ``flux_to_diffusers``, which FLUX.2 and Chroma get too, ComfyUI's
``Flux2`` and ``Chroma`` models being kinds of ``Flux``), Z-Image's diffusers names (``z_image_to_diffusers``, added
after Z-Image itself: ComfyUI PR #10978, "Support some z image lora formats"; releases without it leave every
``transformer.`` key of a Z-Image file "not loaded"). A file under the generic names loads in every ComfyUI release that
runs the model; a file under the per-model names only in the releases that have the rule.

So this layout writes what the generic rule maps: ``diffusion_model.<ComfyUI module>`` with the tensors ComfyUI's
``load_lora`` reads (``lora_up.weight`` / ``lora_down.weight`` / ``alpha``, and LyCORIS' ``dora_scale``, ``lokr_*``,
``hada_*``: the kohya layout's tensors, :func:`lightning_lora.formats.kohya.adapter_to_kohya`). ComfyUI's modules are
the model's original ones, which fuse some of diffusers' layers (q/k/v into one ``qkv``): the separate LoRAs of the
parts become one block-diagonal LoRA of the fused layer, exactly (:func:`~lightning_lora.formats.kohya.fused_to_kohya`,
whose algebra the kohya layout documents). A family binds the layout to its table of names (``slices``:
:func:`lightning_lora.formats.chroma.chroma_lora_slices`, :func:`lightning_lora.formats.nextdit.zimage_lora_slices`)
and to a reader of such files made elsewhere.

What the other tools make of it is each family's (``lora_coverage``): diffusers reads a FLUX-like file under these names
as a kohya file (its FLUX converter turns ``diffusion_model.`` into ``lora_unet_``), a Z-Image file only where the
original name is diffusers' own; kohya's sd-scripts reads ``lora_unet_`` keys only.

This module is pure tensor code (torch only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from lightning_lora.formats import FileFacts, LoraFormat
from lightning_lora.formats.kohya import LYCORIS_PREFIX, Slices, fused_to_kohya

__all__ = ["COMFY_PREFIX", "ComfyLayout", "comfy_name", "is_comfy_file"]

COMFY_PREFIX = "diffusion_model."
"""The prefix of the model's weights in ComfyUI, and of this layout's keys."""


def comfy_name(module: str) -> str:
    """``double_blocks.0.img_attn.qkv`` -> ``diffusion_model.double_blocks.0.img_attn.qkv``."""
    return COMFY_PREFIX + module


def is_comfy_file(tensors: Mapping[str, Tensor]) -> bool:
    """Whether every key is a ``diffusion_model.`` module's (or a part written under ComfyUI's per-part ``lycoris_``
    name), with at least one of the former."""
    keys = list(tensors)
    return any(k.startswith(COMFY_PREFIX) for k in keys) and all(
        k.startswith((COMFY_PREFIX, LYCORIS_PREFIX)) for k in keys
    )


@dataclass(frozen=True)
class ComfyLayout:
    """The ComfyUI layout as one family serves it (see the module docstring)."""

    slices: Slices
    """Where each of the LoRA's modules (diffusers names) lives in ComfyUI's model: its name there, and its rows of a
    fused layer."""
    from_comfy: Callable[[Mapping[str, Tensor]], dict[str, Tensor]]
    """A file's tensors (plain LoRA) -> a peft state dict in diffusers names, every module's scale folded in."""
    format: ClassVar[LoraFormat] = "comfyui"

    def write(self, state: Mapping[str, Tensor], file: FileFacts) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The file's tensors (no header entries of its own: ModelSpec and ours come from the export)."""
        return fused_to_kohya(state, file.scale, file.dtype, slices=self.slices, name=comfy_name), {}

    def read(self, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> dict[str, Tensor]:
        """A file of this layout made elsewhere (plain LoRA) as a peft state dict; ``ValueError`` naming what it cannot
        read."""
        other = sorted(
            {k.rsplit(".", 1)[-1] for k in tensors if not k.endswith((".weight", ".alpha")) or "dora_scale" in k}
        )
        if other:
            raise ValueError(f"has {', '.join(other[:3])} tensors (DoRA, LoKr or LoHa); plain LoRA files are read.")
        return self.from_comfy(tensors)
