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

A format is pure key and tensor algebra (torch only, no diffusers, no model): each module here maps names, and the
conversions are exact (same function, not an approximation), checked in the tests against diffusers' own converters.

The modules
-----------
* :mod:`.adapters`: one adapted layer of any variant (LoRA, DoRA, LoKr, LoHa) under peft's tensor names, and the rank
  each loader divides ``alpha`` by.
* :mod:`.diffusers`: the diffusers/peft LoRA layout (peft keys under the family's denoiser subfolder, ``transformer.``
  or ``unet.``, the scale folded into ``lora_B``, the peft ``LoraConfig`` as ``lora_adapter_metadata``). What
  ``pipe.load_lora_weights`` reads; ComfyUI reads it too for FLUX.
* :mod:`.kohya`: the kohya/ComfyUI LoRA layout (``lora_unet_<module>`` keys with ``lora_down`` / ``lora_up`` /
  ``alpha``, LyCORIS tensors for the variants): FLUX in BFL names with fused q/k/v, SDXL in SGM names, SD1.5 in
  diffusers names. What ComfyUI, Forge/A1111, kohya's sd-scripts (and LyCORIS) and diffusers read.
* :mod:`.kohya_read`: kohya files made elsewhere back to peft keys, through diffusers' own converters.
* :mod:`.clients`: which layers of a file each of those loaders applies, by its key rules (export prints it).
* :mod:`.bfl`: diffusers <-> Black Forest Labs names of the FLUX transformer (single-file checkpoints, kohya FLUX).
* :mod:`.ldm`: diffusers <-> LDM/SGM names of a Stable Diffusion UNet (single-file checkpoints, kohya SDXL).
* :mod:`.flux2`: diffusers <-> BFL names of the FLUX.2 transformer, and its ComfyUI LoRA layout.

Which family writes which format
--------------------------------
A family declares the LoRA formats it can write (``lora_files.formats``) and provides the kohya conversion itself
(:meth:`~lightning_lora.families.base.DiffusionFamily.kohya_lora`), so a new family is one module and needs nothing
here unless it brings a new layout:

=========  ============================================  ======================================================
family     diffusers                                     kohya
=========  ============================================  ======================================================
``flux``   diffusers; ComfyUI (part by part, compact)    ComfyUI, sd-scripts, diffusers: BFL names, q/k/v (and
                                                         the single blocks' MLP) fused
``sdxl``   diffusers (ComfyUI skips attention layers)    ComfyUI, Forge/A1111, sd-scripts, diffusers: SGM names
``sd15``   diffusers (ComfyUI skips attention layers)    ComfyUI, Forge/A1111, sd-scripts, diffusers: diffusers
                                                         names with ``_``
=========  ============================================  ======================================================

``qwenimage`` writes both too: its diffusers file is ComfyUI's (ComfyUI builds Qwen-Image with diffusers' names); its
kohya file is musubi-tuner's layout (diffusers names with ``_``), which ComfyUI and diffusers (plain LoRA) read.

``flux2`` writes both: its diffusers file is what ``Flux2KleinPipeline.load_lora_weights`` reads; its kohya file is the
ComfyUI layout (BFL names, q/k/v fused), which diffusers reads too (:mod:`.flux2`).

A training run writes both by default (``<name>.safetensors`` and ``<name>.kohya.safetensors``).

Which adapter variant fits which format
---------------------------------------
:data:`VARIANTS` says which adapter variants (see :mod:`lightning_lora.lora`) each format holds: diffusers files hold
LoRA and DoRA (diffusers 0.42 loads nothing else), kohya files all four in LyCORIS' tensors. A variant a format
cannot hold, or a layer it has no exact form for (a LoKr on FLUX's fused q/k/v), is refused naming the variant, the
layer and the format, instead of writing a file that does something else than what was trained.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["FORMATS", "VARIANTS", "LoraFormat"]

LoraFormat = Literal["diffusers", "kohya"]
"""A LoRA file format lightning-lora writes (``lightning-lora export --format``, ``LoraExport(formats=...)``)."""

FORMATS: tuple[str, ...] = get_args(LoraFormat)
"""The names of :data:`LoraFormat`, in the order they are offered."""

VARIANTS: dict[str, tuple[str, ...]] = {"diffusers": ("LoRA", "DoRA"), "kohya": ("LoRA", "DoRA", "LoKr", "LoHa")}
"""Format -> the adapter variants (:attr:`lightning_lora.lora.AdapterKey.variant`) a file of that format holds."""
