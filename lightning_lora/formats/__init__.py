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
* the *packing of the scale and config*: diffusers/peft files keep ``alpha`` in a JSON config in the header, kohya files
  keep one ``.alpha`` tensor per module.

A format is pure key and tensor algebra (torch only, no diffusers, no model): each module here maps names, and the
conversions are exact (same function, not an approximation), checked in the tests against diffusers' own converters.

The modules
-----------
* :mod:`.diffusers`: the diffusers/peft LoRA layout (peft keys under the family's denoiser subfolder, ``transformer.``
  or ``unet.``, and the peft ``LoraConfig`` as ``lora_adapter_metadata``). What ``pipe.load_lora_weights`` reads.
* :mod:`.kohya`: the kohya/ComfyUI LoRA layout (``lora_unet_<module>`` keys with ``lora_down`` / ``lora_up`` /
  ``alpha``): FLUX in BFL names with fused q/k/v, SDXL in SGM names, SD1.5 in diffusers names.
* :mod:`.bfl`: diffusers <-> Black Forest Labs names of the FLUX transformer (single-file checkpoints, kohya FLUX).
* :mod:`.ldm`: diffusers <-> LDM/SGM names of a Stable Diffusion UNet (single-file checkpoints, kohya SDXL).

Which family writes which format
--------------------------------
A family declares the LoRA formats it can write (:attr:`~lightning_lora.families.base.DiffusionFamily.lora_formats`)
and provides the kohya conversion itself (:meth:`~lightning_lora.families.base.DiffusionFamily.kohya_lora`), so a new
family is one module and needs nothing here unless it brings a new layout:

=========  ===========  =====================================================
family     diffusers    kohya
=========  ===========  =====================================================
``flux``   yes          yes: BFL names, q/k/v (and the single blocks' MLP) fused
``sdxl``   yes          yes: SGM names (``input_blocks``...), LoCon 4-D kept
``sd15``   yes          yes: diffusers names with ``_``, LoCon 4-D kept
=========  ===========  =====================================================

Which adapter variant fits which format
---------------------------------------
:data:`VARIANTS` says which adapter variants (see :mod:`lightning_lora.lora`) each format holds. Both hold plain LoRA
only today: a DoRA magnitude vector, a LoKr or LoHa factor has no place in them, and export refuses such an adapter
naming the variant and the format, instead of writing a file without it (a different function than was trained).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["FORMATS", "VARIANTS", "LoraFormat"]

LoraFormat = Literal["diffusers", "kohya"]
"""A LoRA file format lightning-lora writes (``lightning-lora export --format``, ``LoraExport(formats=...)``)."""

FORMATS: tuple[str, ...] = get_args(LoraFormat)
"""The names of :data:`LoraFormat`, in the order they are offered."""

VARIANTS: dict[str, tuple[str, ...]] = {"diffusers": ("LoRA",), "kohya": ("LoRA",)}
"""Format -> the adapter variants (:attr:`lightning_lora.lora.AdapterKey.variant`) a file of that format holds."""
