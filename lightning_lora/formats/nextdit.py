"""The NextDiT layout: Z-Image's original names (Tongyi-MAI's checkpoint, ComfyUI's model), against diffusers' names.

Two layouts of the transformer
------------------------------
diffusers' ``ZImageTransformer2DModel`` and the original Tongyi-MAI checkpoint (the single file ComfyUI users download,
``z_image_turbo_bf16.safetensors``; ComfyUI builds the model as its Lumina2 ``NextDiT``) differ in a few names, and
the original fuses the attention's q/k/v:

==============================================  =================================================================
diffusers                                       original (ComfyUI)
==============================================  =================================================================
``all_x_embedder.2-1``                          ``x_embedder`` (patch 2, frame patch 1: the only one Z-Image has)
``all_final_layer.2-1.*``                       ``final_layer.*``
``<block>.attention.to_q / to_k / to_v``        ``<block>.attention.qkv`` -- fused: rows ``[q; k; v]``, ``dim`` each
``<block>.attention.to_out.0``                  ``<block>.attention.out``
``<block>.attention.norm_q / norm_k``           ``<block>.attention.q_norm / k_norm``
everything else                                 the same name
==============================================  =================================================================

where ``<block>`` is ``layers.i`` (the main blocks), ``noise_refiner.i`` (image tokens only, before the main blocks)
or ``context_refiner.i`` (caption tokens only; no modulation). Every block has q/k/v of ``dim`` rows each (Z-Image's
``n_kv_heads`` equals ``n_heads``). diffusers' ``from_single_file`` reads the original layout
(``convert_z_image_transformer_checkpoint_to_diffusers``); :func:`diffusers_to_original` writes it (the tests check
one against the other).

LoRA files: the diffusers layout is also ComfyUI's
-------------------------------------------------
ComfyUI has key rules for Z-Image LoRAs: ``comfy/lora.py`` ``model_lora_keys_unet``, for a ``Lumina2`` model, maps
each diffusers weight name that ``comfy/utils.py`` ``z_image_to_diffusers`` lists -- with the prefixes
``transformer.``, ``diffusion_model.``, ``lycoris_`` (dots as ``_``) or none -- onto the original weight, q/k/v onto
their rows of the fused ``qkv`` (offsets ``0``, ``dim``, ``2 * dim``). The list covers every linear layer of the model
(:func:`comfy_target`). ``comfy/weight_adapter/lora.py`` reads ``<key>.lora_B.weight`` / ``.lora_A.weight`` with no
``.alpha`` as scale 1, which is how lightning-lora's diffusers files are written (``alpha / rank`` folded into
``lora_B``). So the diffusers file (``transformer.<module>.lora_A/B.weight``) applies exactly in ComfyUI, part by
part, like FLUX's; a second, ComfyUI-specific layout would hold the same numbers under other names, and
lightning-lora writes none for Z-Image. kohya's sd-scripts reads only ``lora_unet_`` names, so it loads nothing of a
diffusers file (the family's ``lora_coverage``: :class:`lightning_lora.families.ZImage`).

This module only needs torch; it does not import diffusers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["comfy_target", "diffusers_to_original", "original_name"]

_BLOCK = r"(?:layers|noise_refiner|context_refiner)\.\d+"
_QKV = re.compile(rf"^({_BLOCK})\.attention\.to_([qkv])$")
_RENAMES = (
    (re.compile(r"^all_x_embedder\.2-1\b"), "x_embedder"),
    (re.compile(r"^all_final_layer\.2-1\b"), "final_layer"),
    (re.compile(rf"^({_BLOCK})\.attention\.to_out\.0\b"), r"\1.attention.out"),
    (re.compile(rf"^({_BLOCK})\.attention\.norm_([qk])\b"), r"\1.attention.\2_norm"),
)
# The diffusers linear layers comfy/utils.py z_image_to_diffusers maps (besides q/k/v): per block, then global.
_COMFY_LINEAR = re.compile(
    rf"^(?:{_BLOCK}\.(?:attention\.to_out\.0|feed_forward\.w[123]|adaLN_modulation\.0)"
    r"|all_final_layer\.2-1\.(?:linear|adaLN_modulation\.1)|all_x_embedder\.2-1|cap_embedder\.1|t_embedder\.mlp\.[02])$"
)


def original_name(module: str) -> str:
    """The original (ComfyUI) name of a diffusers module or parameter path that is not one of q/k/v (those share the
    fused ``attention.qkv``: see :func:`comfy_target`)."""
    for pattern, replacement in _RENAMES:
        module = pattern.sub(replacement, module)
    return module


def comfy_target(module: str, dim: int) -> tuple[str, tuple[int, int] | None] | None:
    """Where ComfyUI applies a LoRA on the diffusers linear layer ``module`` of a model ``dim`` wide: the original
    weight (``diffusion_model.`` left out) and, for q/k/v, its rows ``(start, count)`` of the fused ``qkv``; None when
    ComfyUI's Z-Image key map has no entry for it (not a linear layer of the model)."""
    qkv = _QKV.match(module)
    if qkv:
        return f"{qkv.group(1)}.attention.qkv.weight", ("qkv".index(qkv.group(2)) * dim, dim)
    if _COMFY_LINEAR.match(module):
        return f"{original_name(module)}.weight", None
    return None


def diffusers_to_original(state_dict: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """A full ``ZImageTransformer2DModel`` state dict in the original layout (the inverse of diffusers'
    ``convert_z_image_transformer_checkpoint_to_diffusers``): q/k/v concatenated in that row order into
    ``attention.qkv``, the other names renamed. ``prefix`` goes in front of every key (``"model.diffusion_model."`` as
    in ComfyUI's all-in-one files). Raises ``ValueError`` when a block lacks one of q/k/v."""
    out: dict[str, Tensor] = {}
    parts: dict[str, dict[str, Tensor]] = {}
    for key, tensor in state_dict.items():
        module, _, param = key.rpartition(".")
        qkv = _QKV.match(module)
        if qkv:
            parts.setdefault(f"{qkv.group(1)}.attention.qkv.{param}", {})[qkv.group(2)] = tensor
        else:
            out[prefix + original_name(key)] = tensor
    for target, found in parts.items():
        if sorted(found) != ["k", "q", "v"]:
            raise ValueError(f"{target}: got {sorted(found)} of q, k, v (an unfused part is absent)")
        out[prefix + target] = torch.cat([found["q"], found["k"], found["v"]], dim=0)
    return out
