"""File formats: the same weights under other names, and the layouts LoRA files are written in.

What a format is
----------------
A trained LoRA is a set of pairs ``(lora_A [r, in], lora_B [out, r])``, one per adapted layer of the denoiser, plus a
scale ``alpha / r``. The numbers are fixed by training; a *format* is only how they are named and packed in a
safetensors file, so that another program (diffusers, ComfyUI, Forge, kohya's sd-scripts) finds each pair's layer and
its scale. Two things vary between formats:

* the *module names*: diffusers names the FLUX transformer and the UNets by their Python structure
  (``transformer_blocks.0.attn.to_q``, ``down_blocks.1.attentions.0``); the original checkpoints name them as their
  authors' code did (Black Forest Labs: ``double_blocks.0.img_attn.qkv``; Stability AI's LDM/SGM:
  ``input_blocks.4.1``), and some of their layers fuse several diffusers layers (BFL's ``qkv``);
* the *packing of the scale and config*: kohya files keep one ``.alpha`` tensor per module, from which every loader
  computes ``alpha / rank``; diffusers/peft files keep a JSON config in the header, which only diffusers reads, so
  lightning-lora folds the scale into their weights (the config says ``lora_alpha = r``) and the file means the same in
  every loader that reads its keys.

A format is pure key and tensor algebra (torch only, no model; diffusers only to read files made elsewhere): each module
here maps names, and the conversions are exact (same function, not an approximation), checked in the tests against
diffusers' own converters.

The modules: one per layout
--------------------------
Two layouts of LoRA *files*, each a module with a :class:`LoraLayout` object that a family binds to its names:

* :mod:`.diffusers`: the diffusers/peft layout (peft keys under the family's denoiser subfolder, ``transformer.`` or
  ``unet.``, the scale folded into ``lora_B``, the peft ``LoraConfig`` as ``lora_adapter_metadata``): what
  ``pipe.load_lora_weights`` reads. :class:`.diffusers.DiffusersLayout`.
* :mod:`.kohya`: the kohya/ComfyUI layout (``lora_unet_<module>`` keys with ``lora_down`` / ``lora_up`` / ``alpha``,
  LyCORIS tensors for the variants; a model's layers under the names its original code gives them, fused where that
  code fuses them), and the reading of such files made elsewhere through diffusers' own converters: what ComfyUI,
  Forge/A1111, kohya's sd-scripts and musubi-tuner (and LyCORIS) and diffusers read. :class:`.kohya.KohyaLayout`.

Four layouts of model *weights* (a checkpoint's names against diffusers'), which the kohya layout names modules by,
and single-file checkpoints, ComfyUI's key maps and the tests use:

* :mod:`.bfl`: Black Forest Labs' names of the FLUX.1 and FLUX.2 transformers (fused q/k/v);
* :mod:`.ldm`: the LDM/SGM names of a Stable Diffusion UNet;
* :mod:`.nextdit`: Z-Image's original names (ComfyUI's NextDiT);
* :mod:`.krea2`: Krea 2's original names (Krea's checkpoint, ComfyUI's model).

And what they share: :mod:`.adapters` (one adapted layer of any variant under peft's tensor names, and the rank each
loader divides ``alpha`` by) and :mod:`.clients` (which layers of a file each of those loaders applies, by its key
rules: export prints it).

Which family writes which layout
--------------------------------
This package names no family. A family lists the layouts it writes in ``lora_files.layouts``
(:class:`~lightning_lora.families.facts.LoraFiles`), each bound to its names (``DiffusersLayout("transformer")``;
``KohyaLayout`` with its kohya network, its names from one of the weight layouts, its reader), and says in its own
module docstring which tools read each file; its ``lora_coverage`` applies the loaders' rules, and ``lightning-lora
export`` prints them for every file. So a new family is one module and needs nothing here unless it brings a new
layout. A training run writes every layout of its family by default (``<name>.safetensors``,
``<name>.kohya.safetensors``).

Which adapter variant fits which format
---------------------------------------
:data:`VARIANTS` says which adapter variants (see :mod:`lightning_lora.lora`) each format holds: diffusers files hold
LoRA and DoRA (diffusers 0.42 loads nothing else), kohya files all four in LyCORIS' tensors. A variant a format
cannot hold, or a layer it has no exact form for (a LoKr on FLUX's fused q/k/v), is refused naming the variant, the
layer and the format, instead of writing a file that does something else than what was trained.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, get_args

if TYPE_CHECKING:
    import torch

__all__ = ["FORMATS", "VARIANTS", "FileFacts", "LoraFormat", "LoraLayout"]

LoraFormat = Literal["diffusers", "kohya"]
"""A LoRA file format lightning-lora writes (``lightning-lora export --format``, ``LoraExport(formats=...)``)."""

FORMATS: tuple[str, ...] = get_args(LoraFormat)
"""The names of :data:`LoraFormat`, in the order they are offered."""

VARIANTS: dict[str, tuple[str, ...]] = {"diffusers": ("LoRA", "DoRA"), "kohya": ("LoRA", "DoRA", "LoKr", "LoHa")}
"""Format -> the adapter variants (:attr:`lightning_lora.lora.AdapterKey.variant`) a file of that format holds."""


@dataclass(frozen=True)
class FileFacts:
    """What a LoRA file is written with besides its tensors, in any layout."""

    scale: float
    """Every update is multiplied by this (peft's ``alpha / r`` of a trained LoRA; 1 for a file whose scale is in)."""
    rank: int
    """The trained rank the header reports."""
    alpha: float
    """The trained alpha the header reports."""
    title: str = ""
    """The file's name without suffix (kohya's ``ss_output_name``)."""
    init: str = "gaussian"
    """The ``init_lora_weights`` a peft config records."""
    dtype: torch.dtype | None = None
    """The weights' dtype in the file (None: as given)."""


class LoraLayout(Protocol):
    """One layout of LoRA files as one family serves it: a layout module's code bound to the family's names
    (:class:`.diffusers.DiffusersLayout`, :class:`.kohya.KohyaLayout`). A family lists its layouts in
    ``lora_files.layouts``; export writes and reads files through them."""

    @property
    def format(self) -> LoraFormat:
        """The layout's name (``--format``)."""
        ...

    def write(
        self, state: Mapping[str, torch.Tensor], file: FileFacts
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """A peft state dict (no prefix, no adapter name) as the file's ``(tensors, header entries)``, every update
        scaled by ``file.scale``. ``ValueError`` naming a module the layout has no name or exact form for."""
        ...

    def read(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """A file of this layout made elsewhere as a peft state dict, its scale folded in; ``ValueError`` naming what
        cannot be read."""
        ...
