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

LoRA files: ComfyUI's rules, and since when
------------------------------------------
ComfyUI builds Z-Image with the original names, and its generic key rule (``comfy/lora.py`` ``model_lora_keys_unet``,
every release) maps ``diffusion_model.<original module>`` and ``lora_unet_<original module with _>`` onto its weights:
the ComfyUI layout (:mod:`lightning_lora.formats.comfyui`), q/k/v fused into one ``qkv`` LoRA
(:func:`zimage_lora_slices`), loads in every ComfyUI release that runs Z-Image. Its rules for diffusers names came
later: for a ``Lumina2`` model it maps each diffusers weight name that ``comfy/utils.py`` ``z_image_to_diffusers``
lists -- with the prefixes ``transformer.``, ``diffusion_model.``, ``lycoris_`` (dots as ``_``) or none -- onto the
original weight, q/k/v onto their rows of the fused ``qkv`` (offsets ``0``, ``dim``, ``2 * dim``), every linear layer
of the model (:func:`comfy_target`). That rule is ComfyUI PR #10978 ("Support some z image lora formats"), merged
after ComfyUI first ran Z-Image; the releases before it leave every key of a diffusers file "not loaded" (issue 51
reports the releases before 0.7). So a diffusers file (``transformer.<module>``) loads exactly in the releases with
that rule, and the ComfyUI-layout file in all of them. diffusers reads the ComfyUI-layout file only where an original
name is a diffusers name (its ``_convert_non_diffusers_z_image_lora_to_diffusers``: the ``diffusion_model.`` prefix
dropped, ``attention.out`` renamed, the fused ``qkv`` and the renamed embedder and final layer left unloaded);
kohya's sd-scripts reads only ``lora_unet_`` names. :meth:`lightning_lora.families.ZImage.lora_coverage` says it.
:func:`zimage_from_comfy` reads a ComfyUI-layout file made elsewhere, under original or diffusers names (ostris'
Z-Image-Turbo training adapter is ``diffusion_model.<diffusers module>.lora_A/B``).

This module only needs torch; it does not import diffusers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_lora.formats.adapters import Adapter
from lightning_lora.formats.bfl import BflSlice
from lightning_lora.formats.kohya import drop_unused_ranks

__all__ = [
    "comfy_target",
    "diffusers_name",
    "diffusers_to_original",
    "original_name",
    "zimage_from_comfy",
    "zimage_lora_slices",
    "zimage_slice",
]

_BLOCK = r"(?:layers|noise_refiner|context_refiner)\.\d+"
_QKV = re.compile(rf"^({_BLOCK})\.attention\.to_([qkv])$")
_RENAMES = (
    (re.compile(r"^all_x_embedder\.2-1\b"), "x_embedder"),
    (re.compile(r"^all_final_layer\.2-1\b"), "final_layer"),
    (re.compile(rf"^({_BLOCK})\.attention\.to_out\.0\b"), r"\1.attention.out"),
    (re.compile(rf"^({_BLOCK})\.attention\.norm_([qk])\b"), r"\1.attention.\2_norm"),
)
_BACK = (
    (re.compile(r"^x_embedder\b"), "all_x_embedder.2-1"),
    (re.compile(r"^final_layer\b"), "all_final_layer.2-1"),
    (re.compile(rf"^({_BLOCK})\.attention\.out\b"), r"\1.attention.to_out.0"),
    (re.compile(rf"^({_BLOCK})\.attention\.([qk])_norm\b"), r"\1.attention.norm_\2"),
)
_FUSED_QKV = re.compile(rf"^({_BLOCK})\.attention\.qkv$")
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


def diffusers_name(module: str) -> str:
    """The diffusers name of an original module or parameter path that is not the fused ``qkv`` (the inverse of
    :func:`original_name`); a diffusers name is returned as it is."""
    for pattern, replacement in _BACK:
        module = pattern.sub(replacement, module)
    return module


def zimage_lora_slices(adapters: Mapping[str, Adapter]) -> dict[str, BflSlice]:
    """Where each adapted module of a Z-Image LoRA (diffusers names) lives in the original layout: q/k/v on their
    thirds of the fused ``qkv``, the others under their original names. Raises ``ValueError`` naming a module that is
    not a linear layer of the model (ComfyUI's model has no other place for it) or q/k/v of another width."""
    dim = next((a.out_features for m, a in adapters.items() if _QKV.match(m)), 0)
    slices = {}
    for module, adapter in adapters.items():
        try:
            where = zimage_slice(module, dim)
        except KeyError:
            raise ValueError(
                f"{module}: not a linear layer of the Z-Image transformer, so it has no ComfyUI name. Export in the "
                "diffusers format instead (--format diffusers)."
            ) from None
        if where.fused and adapter.out_features != dim:
            raise ValueError(f"{module}: its adapter has {adapter.out_features} rows, q has {dim}")
        slices[module] = where
    return slices


def zimage_slice(module: str, dim: int) -> BflSlice:
    """Where the diffusers linear layer ``module`` of a Z-Image ``dim`` wide lives in ComfyUI's model
    (:func:`comfy_target`); ``KeyError`` for a name that is not a linear layer of the model."""
    target = comfy_target(module, dim)
    if target is None:
        raise KeyError(f"not a linear layer of the Z-Image transformer: {module!r}")
    weight, rows = target
    name = weight.removesuffix(".weight")
    return BflSlice(name) if rows is None else BflSlice(name, start=rows[0], size=dim, total=3 * dim)


def zimage_from_comfy(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A Z-Image LoRA file under ``diffusion_model.`` keys (original or diffusers module names; ``lora_down`` /
    ``lora_up`` / ``alpha`` or ``lora_A`` / ``lora_B``) as a peft state dict in diffusers names, each module's ``alpha /
    rank`` folded in; a fused ``qkv`` LoRA split into q, k and v (each the whole ``lora_down`` and its third of
    ``lora_up``, then the rank components that give a part nothing dropped). ``ValueError`` for a file it cannot
    read."""
    modules: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        if not key.startswith("diffusion_model."):
            raise ValueError(f"{key!r} is not a diffusion_model.<module> key")
        body = key.removeprefix("diffusion_model.")
        for suffix, name in (
            (".lora_down.weight", "down"),
            (".lora_up.weight", "up"),
            (".lora_A.weight", "down"),
            (".lora_B.weight", "up"),
            (".alpha", "alpha"),
        ):
            if body.endswith(suffix):
                modules.setdefault(body.removesuffix(suffix), {})[name] = tensor
                break
        else:
            raise ValueError(f"{key!r}: a tensor lightning-lora does not read (plain LoRA files are read)")
    state: dict[str, Tensor] = {}
    for module, parts in modules.items():
        if "down" not in parts or "up" not in parts:
            raise ValueError(f"{module}: lacks lora_down or lora_up")
        down, up = parts["down"], parts["up"]
        scale = float(parts["alpha"]) / down.shape[0] if "alpha" in parts else 1.0
        up = up if scale == 1 else (up.float() * scale).to(up.dtype)
        fused = _FUSED_QKV.match(module)
        if fused:
            for part, rows in zip("qkv", up.chunk(3, dim=0), strict=True):
                state[f"{fused.group(1)}.attention.to_{part}.lora_A.weight"] = down
                state[f"{fused.group(1)}.attention.to_{part}.lora_B.weight"] = rows
        else:
            state[f"{diffusers_name(module)}.lora_A.weight"] = down
            state[f"{diffusers_name(module)}.lora_B.weight"] = up
    return drop_unused_ranks(state)
