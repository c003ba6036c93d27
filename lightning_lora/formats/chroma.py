"""Chroma's original names (lodestones' checkpoints, ComfyUI's ``Chroma`` model) against diffusers' names.

Chroma is FLUX.1-schnell with the per-block modulation layers pruned: one *approximator* MLP
(``distilled_guidance_layer``) makes every block's shift, scale and gate from the timestep, so the blocks have no
``img_mod`` / ``txt_mod`` / ``modulation`` layers, the final layer no ``adaLN_modulation``, and there is no pooled CLIP
vector, guidance or timestep embedder. Everything that remains is named as in Black Forest Labs' FLUX
(:mod:`lightning_lora.formats.bfl`: ``double_blocks.i.img_attn.qkv`` with q/k/v fused, ``single_blocks.i.linear1``
with q/k/v and the MLP input fused, ``img_in``, ``txt_in``, ``final_layer.linear``), plus the approximator:

=====================================================  ======================================================
diffusers (``ChromaTransformer2DModel``)               original (ComfyUI, ``Chroma1-HD.safetensors``)
=====================================================  ======================================================
``distilled_guidance_layer.in_proj`` / ``out_proj``    the same
``distilled_guidance_layer.layers.i.linear_1 / _2``    ``distilled_guidance_layer.layers.i.in_layer / out_layer``
``distilled_guidance_layer.norms.i`` (``weight``)      ``distilled_guidance_layer.norms.i`` (``scale``)
everything else                                        FLUX's BFL names (:func:`lightning_lora.formats.bfl.bfl_slice`)
=====================================================  ======================================================

diffusers' ``from_single_file`` reads the original layout (``convert_chroma_transformer_checkpoint_to_diffusers``,
which hard-codes FLUX.1's 3072 width); :func:`chroma_to_original` writes it and :func:`original_to_chroma` reads it at
any width (the tests check them against diffusers' converter). :func:`chroma_slice` is the one table, and
:func:`chroma_lora_slices` places a LoRA's modules in it (the ComfyUI layout: :mod:`lightning_lora.formats.comfyui`).

This module only needs torch; it does not import diffusers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor

from lightning_lora.formats.adapters import Adapter
from lightning_lora.formats.bfl import BflSlice, FluxDims, bfl_slice, bfl_to_diffusers, diffusers_to_bfl, flux_lora_dims

__all__ = ["chroma_lora_slices", "chroma_slice", "chroma_to_original", "original_to_chroma"]

_APPROXIMATOR = "distilled_guidance_layer."
_LAYER = re.compile(r"^distilled_guidance_layer\.layers\.(\d+)\.linear_([12])$")
_NORM = re.compile(r"^distilled_guidance_layer\.norms\.(\d+)$")
_ORIGINAL_LAYER = re.compile(r"^distilled_guidance_layer\.layers\.(\d+)\.(in|out)_layer\.(weight|bias)$")
_ORIGINAL_NORM = re.compile(r"^distilled_guidance_layer\.norms\.(\d+)\.scale$")


def chroma_slice(module: str, dims: FluxDims) -> BflSlice:
    """Where the diffusers Chroma module ``module`` lives in the original checkpoint (fused rows as FLUX's); raises
    ``KeyError`` for a name that is not a parameterised module of ``ChromaTransformer2DModel``."""
    if module in (_APPROXIMATOR + "in_proj", _APPROXIMATOR + "out_proj"):
        return BflSlice(module)
    layer = _LAYER.match(module)
    if layer:
        return BflSlice(f"{_APPROXIMATOR}layers.{layer.group(1)}.{'in' if layer.group(2) == '1' else 'out'}_layer")
    if _NORM.match(module):
        return BflSlice(module, weight_name="scale")
    where = bfl_slice(module, dims)
    if where.swap or where.module.endswith(("_mod.lin", "modulation.lin")) or module.startswith("time_text_embed."):
        raise KeyError(f"not a Chroma transformer module (pruned from FLUX): {module!r}")
    return where


def chroma_to_original(state_dict: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """A full ``ChromaTransformer2DModel`` state dict in the original layout (the inverse of diffusers'
    ``convert_chroma_transformer_checkpoint_to_diffusers``), ``prefix`` in front of every key
    (``model.diffusion_model.`` as in ComfyUI's all-in-one files)."""
    flux = {k: v for k, v in state_dict.items() if not k.startswith(_APPROXIMATOR)}
    out = diffusers_to_bfl(flux)
    dims = FluxDims(0, 0)
    for key, tensor in state_dict.items():
        if key.startswith(_APPROXIMATOR):
            module, _, param = key.rpartition(".")
            out[chroma_slice(module, dims).param(param)] = tensor
    return {prefix + k: v for k, v in out.items()}


def original_to_chroma(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An original Chroma checkpoint (optionally ``model.diffusion_model.``-prefixed) in diffusers' names, at the widths
    its tensors have (diffusers' own converter assumes FLUX.1's)."""
    plain = {k.removeprefix("model.diffusion_model."): v for k, v in state_dict.items()}
    out = bfl_to_diffusers({k: v for k, v in plain.items() if not k.startswith(_APPROXIMATOR)})
    for key, tensor in plain.items():
        layer, norm = _ORIGINAL_LAYER.match(key), _ORIGINAL_NORM.match(key)
        if layer:
            index, side, param = layer.groups()
            out[f"{_APPROXIMATOR}layers.{index}.linear_{1 if side == 'in' else 2}.{param}"] = tensor
        elif norm:
            out[f"{_APPROXIMATOR}norms.{norm.group(1)}.weight"] = tensor
        elif key.startswith(_APPROXIMATOR):
            out[key] = tensor
    return out


def chroma_lora_slices(adapters: Mapping[str, Adapter]) -> dict[str, BflSlice]:
    """Where each adapted module of a Chroma LoRA (diffusers names) lives in the original layout, the fused parts'
    rows at the widths of the LoRA's own shapes. Raises ``ValueError`` naming a module that is not a linear layer of
    the Chroma transformer, or a part whose rows differ from those widths."""
    dims = flux_lora_dims(adapters)
    slices = {}
    for module, adapter in adapters.items():
        try:
            where = chroma_slice(module, dims)
        except KeyError:
            raise ValueError(
                f"{module}: not a linear layer of the Chroma transformer, so it has no ComfyUI name. Export in the "
                "diffusers format instead (--format diffusers)."
            ) from None
        if where.fused and adapter.out_features != where.size:
            raise ValueError(
                f"{module}: its adapter has {adapter.out_features} rows, the widths {dims} say {where.size}"
            )
        slices[module] = where
    return slices
