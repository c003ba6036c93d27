"""Krea 2's original names (Krea's checkpoint, ComfyUI's model), against diffusers' names.

Two layouts of the transformer
------------------------------
diffusers' ``Krea2Transformer2DModel`` and the original checkpoint (``raw.safetensors`` / ``turbo.safetensors`` of
krea/Krea-2-Raw and krea/Krea-2-Turbo, the files ComfyUI builds its ``SingleStreamDiT`` from: ``comfy/ldm/krea2``)
name the same weights differently; nothing is fused, and one tensor changes shape:

==================================================  =============================================================
diffusers                                           original (ComfyUI)
==================================================  =============================================================
``img_in``                                          ``first``
``time_embed.linear_1 / linear_2``                  ``tmlp.0 / tmlp.2``
``time_mod_proj``                                   ``tproj.1``
``txt_in.norm.weight / linear_1 / linear_2``        ``txtmlp.0.scale / txtmlp.1 / txtmlp.3``
``text_fusion.*``                                   ``txtfusion.*``
``transformer_blocks.i.*``                          ``blocks.i.*``
``final_layer.linear / norm.weight``                ``last.linear / last.norm.scale``
``final_layer.scale_shift_table`` ``[2, dim]``      ``last.modulation.lin`` (the same shape)
``<block>.attn.to_q / to_k / to_v / to_out.0``      ``<block>.attn.wq / wk / wv / wo``
``<block>.attn.to_gate``                            ``<block>.attn.gate``
``<block>.attn.norm_q / norm_k .weight``            ``<block>.attn.qknorm.qnorm / knorm .scale``
``<block>.ff.gate / up / down``                     ``<block>.mlp.gate / up / down``
``<block>.norm1 / norm2 .weight``                   ``<block>.prenorm / postnorm .scale``
``transformer_blocks.i.scale_shift_table``          ``blocks.i.mod.lin``, flattened: ``[6 * dim]``
``[6, dim]``
==================================================  =============================================================

where ``<block>`` is one of the 28 transformer blocks or the text-fusion stage's 2 + 2 blocks
(``layerwise_blocks.i``, ``refiner_blocks.i``). diffusers' ``from_single_file`` reads the original layout
(``convert_krea2_transformer_checkpoint_to_diffusers``); :func:`diffusers_to_original` writes it (the tests check one
against the other).

LoRA files: the diffusers layout is also ComfyUI's
-------------------------------------------------
ComfyUI's Krea 2 support came with LoRA key rules for it (ComfyUI PR #14589, 2026-06-23, the commit that added the
model): ``comfy/lora.py`` ``model_lora_keys_unet``, for a ``Krea2`` model, maps each diffusers weight name that
``comfy/utils.py`` ``krea2_to_diffusers`` lists -- with the prefixes ``transformer.``, ``diffusion_model.``,
``lycoris_`` (dots as ``_``) or none -- onto the original weight. The list covers every linear layer of the model
(:func:`comfy_target`): the transformer blocks' and the text-fusion blocks' attention (q, k, v, gate, out) and SwiGLU
layers, the projector, and the six linear layers around them. ``comfy/weight_adapter/lora.py`` reads
``<key>.lora_B.weight`` / ``.lora_A.weight`` with no ``.alpha`` as scale 1, which is how lightning-lora's diffusers
files are written (``alpha / rank`` folded into ``lora_B``). So every ComfyUI that loads Krea 2 applies the diffusers
file (``transformer.<module>.lora_A/B.weight``) exactly, layer by layer; its generic rule also maps the original
names (``diffusion_model.<original>``, ``lora_unet_<original with _>``: kohya's musubi-tuner writes the latter).

This module only needs torch; it does not import diffusers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import Tensor

__all__ = ["comfy_target", "diffusers_to_original", "original_name"]

_BLOCK = r"(?:transformer_blocks|blocks|(?:text_fusion|txtfusion)\.(?:layerwise|refiner)_blocks)"
# Whole-name prefixes (the first that matches), then renames inside a block, as diffusers' converter maps them back.
_PREFIXES = (
    ("img_in.", "first."),
    ("time_embed.linear_1.", "tmlp.0."),
    ("time_embed.linear_2.", "tmlp.2."),
    ("time_mod_proj.", "tproj.1."),
    ("txt_in.norm.weight", "txtmlp.0.scale"),
    ("txt_in.linear_1.", "txtmlp.1."),
    ("txt_in.linear_2.", "txtmlp.3."),
    ("text_fusion.", "txtfusion."),
    ("transformer_blocks.", "blocks."),
    ("final_layer.linear.", "last.linear."),
    ("final_layer.norm.weight", "last.norm.scale"),
    ("final_layer.scale_shift_table", "last.modulation.lin"),
)
_IN_BLOCK = (
    (".attn.to_q.", ".attn.wq."),
    (".attn.to_k.", ".attn.wk."),
    (".attn.to_v.", ".attn.wv."),
    (".attn.to_out.0.", ".attn.wo."),
    (".attn.to_gate.", ".attn.gate."),
    (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"),
    (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
    (".ff.", ".mlp."),
    (".norm1.weight", ".prenorm.scale"),
    (".norm2.weight", ".postnorm.scale"),
    (".scale_shift_table", ".mod.lin"),
)
# The diffusers linear layers comfy/utils.py krea2_to_diffusers maps: per block, then the ones around the blocks.
_COMFY_LINEAR = re.compile(
    r"^(?:(?:transformer_blocks|text_fusion\.(?:layerwise|refiner)_blocks)\.\d+\."
    r"(?:attn\.(?:to_q|to_k|to_v|to_gate|to_out\.0)|ff\.(?:gate|up|down))"
    r"|img_in|time_embed\.linear_[12]|time_mod_proj|txt_in\.linear_[12]|text_fusion\.projector|final_layer\.linear)$"
)


def original_name(name: str) -> str:
    """The original (ComfyUI) name of a diffusers module or parameter path (``transformer_blocks.0.attn.to_q`` ->
    ``blocks.0.attn.wq``)."""
    dotted = name + "."  # a module path ends like a parameter's prefix: the renames match both
    for old, new in _PREFIXES:
        if dotted.startswith(old):
            dotted = new + dotted[len(old) :]
            break
    if re.match(rf"^{_BLOCK}\.\d+\.", dotted):
        for old, new in _IN_BLOCK:
            dotted = dotted.replace(old, new)
    return dotted.removesuffix(".")


def comfy_target(module: str) -> str | None:
    """Where ComfyUI applies a LoRA on the diffusers linear layer ``module``: the original weight (``diffusion_model.``
    left out); None when ComfyUI's Krea 2 key map has no entry for it (not a linear layer of the model)."""
    return f"{original_name(module)}.weight" if _COMFY_LINEAR.match(module) else None


def diffusers_to_original(state_dict: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """A full ``Krea2Transformer2DModel`` state dict in the original layout (the inverse of diffusers'
    ``convert_krea2_transformer_checkpoint_to_diffusers``): renamed, each block's ``[6, dim]`` modulation table
    flattened. ``prefix`` goes in front of every key (``"model.diffusion_model."`` as in ComfyUI's files)."""
    out: dict[str, Tensor] = {}
    for key, tensor in state_dict.items():
        name = original_name(key)
        if name.startswith("blocks.") and name.endswith(".mod.lin"):
            tensor = tensor.reshape(-1)
        out[prefix + name] = tensor
    return out
