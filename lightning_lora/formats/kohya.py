"""FLUX LoRA in the kohya / ComfyUI layout: BFL module names, fused q/k/v, one ``alpha`` per module.

The format
----------
kohya's sd-scripts (``networks/lora_flux.py``) and ComfyUI name a LoRA after the module of the *original* Black Forest
Labs checkpoint it modifies (``flux1-dev.safetensors``, see :mod:`lightning_lora.formats.bfl`), with the dots
replaced by underscores and a ``lora_unet_`` prefix. Each module has three tensors::

    lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight   [R, in]     (peft's lora_A)
    lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight     [out, R]    (peft's lora_B)
    lora_unet_double_blocks_0_img_attn_qkv.alpha              []          the update is up @ down * alpha / R

Fusing separate LoRAs into one, exactly
---------------------------------------
diffusers keeps q, k and v (and, in a single block, the MLP input) as separate layers, so a peft LoRA has one adapter
per part; BFL has one fused layer (``img_attn.qkv`` = rows ``[q; k; v]``, ``single_blocks.i.linear1`` = rows
``[q; k; v; mlp]``). With parts ``i`` of rank ``r`` and the same scale ``s = alpha / r``, the fused delta is::

    [s B_q A_q x; s B_k A_k x; s B_v A_v x]  =  s * U @ D @ x,   D = [A_q; A_k; A_v]   (stacked: 3r x in)
                                                                U = blockdiag(B_q, B_k, B_v) at the parts' rows

so ``lora_down = D``, ``lora_up = U`` (zeros off the diagonal blocks, and zero rows for a part that had no LoRA) and
the fused rank is ``R = n r`` with ``alpha_fused = s R``, which keeps ``alpha_fused / R == alpha / r``. The result is
the same function, not an approximation. (Parts of different rank would get their scales folded into their ``B``.)

The other layers map one to one (``to_out.0`` -> ``img_attn.proj``, ``proj_out`` -> ``linear2``, ...), except
``norm_out.linear`` -> ``final_layer.adaLN_modulation.1``, whose output halves swap: its ``lora_up`` rows swap too.

Who loads what
--------------
ComfyUI matches ``lora_unet_<name>`` against every weight of the BFL model, so every layer loads there. diffusers
(0.42) converts kohya files itself but only for the block layers: LoRAs on ``img_in``, ``txt_in``, ``time_in``,
``vector_in``, ``guidance_in`` and ``final_layer`` are skipped with a warning (our presets never target them; the
diffusers format keeps them). Its converter also hard-codes FLUX.1's widths, so it loads only full-size FLUX files.

Metadata
--------
The file carries kohya's ``ss_*`` keys and the ``modelspec.*`` architecture that UIs read. It must *not* carry
diffusers' ``lora_adapter_metadata``: diffusers converts a kohya file to peft keys with alpha already folded into the
weights and would then apply that config's ``lora_alpha`` a second time.

SDXL and SD1.5
--------------
UNet LoRAs need no fusing: every peft module becomes one kohya module with the same ``lora_down`` / ``lora_up`` and
``alpha`` (so ``alpha / rank`` is unchanged). Only the names differ, and they differ per family as in sd-scripts:

* SD1.x: sd-scripts trains on a diffusers-structured UNet, so the names are the diffusers ones with ``_``
  (``lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q``); diffusers' own
  ``convert_state_dict_to_kohya`` gives the same keys (but writes ``alpha = rank`` whatever the LoRA's alpha was);
* SDXL: sd-scripts trains on Stability AI's original UNet, so the names are the original (SGM) ones
  (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``, see :mod:`lightning_lora.formats.ldm`).

ComfyUI accepts both namings for both families; diffusers' ``load_lora_weights`` converts both. Convolution LoRAs
(the ``locon`` preset) keep their 4-D shapes (``lora_down [r, in, k, k]``, ``lora_up [out, r, 1, 1]``), as kohya's
LoCon files have them.

This module is pure tensor code (torch only). The families that have a kohya layout call it from
:meth:`~lightning_lora.families.base.DiffusionFamily.kohya_lora` and
:meth:`~lightning_lora.families.base.DiffusionFamily.kohya_metadata`; :func:`lightning_lora.export.export_lora`
writes the file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_lora.formats.bfl import BflSlice, FluxDims, bfl_slice, swap_halves
from lightning_lora.formats.ldm import SDXL_LAYOUT, UNetLayout, diffusers_to_ldm
from lightning_lora.lora import split_lora_state

__all__ = [
    "KOHYA_PREFIX",
    "flux_lora_dims",
    "flux_to_kohya",
    "kohya_flux_metadata",
    "kohya_name",
    "kohya_sd15_metadata",
    "kohya_sdxl_metadata",
    "sd15_to_kohya",
    "sdxl_to_kohya",
    "split_lora_state",
    "unet_to_kohya",
]

#: Prefix of the denoiser's LoRA keys in kohya / ComfyUI files (text encoders use ``lora_te1_`` / ``lora_te2_``).
KOHYA_PREFIX = "lora_unet_"

# Modules whose LoRA input is the transformer width (``inner_dim``) and that are parts of a fused BFL layer.
_FUSED_PART = re.compile(r"(^|\.)(attn\.(to_[qkv]|add_[qkv]_proj)|proj_mlp)$")


def flux_lora_dims(pairs: Mapping[str, tuple[Tensor, Tensor]]) -> FluxDims:
    """The :class:`FluxDims` that the fused layers of a FLUX LoRA need, read from the LoRA's own shapes.

    Every part of a fused layer takes the transformer width as input (``inner_dim = lora_A.shape[1]``); the single
    blocks' MLP width is ``proj_mlp``'s output when it has a LoRA and FLUX.1's ``4 * inner_dim`` otherwise. A LoRA
    without fused parts needs no dims (zeros are returned).
    """
    inner = next((a.shape[1] for m, (a, _) in pairs.items() if _FUSED_PART.search(m)), 0)
    mlp = next((b.shape[0] for m, (_, b) in pairs.items() if m.endswith(".proj_mlp")), 4 * inner)
    return FluxDims(inner_dim=inner, mlp_hidden_dim=mlp)


def kohya_name(bfl_module: str) -> str:
    """``double_blocks.0.img_attn.qkv`` -> ``lora_unet_double_blocks_0_img_attn_qkv``."""
    return KOHYA_PREFIX + bfl_module.replace(".", "_")


def flux_to_kohya(
    state: Mapping[str, Tensor], alpha: float, dims: FluxDims | None = None, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """Convert a FLUX transformer LoRA from peft keys to kohya / ComfyUI keys (see the module docstring).

    Args:
        state: peft keys without prefix or adapter name: ``transformer_blocks.0.attn.to_q.lora_A.weight``.
        alpha: the LoRA alpha; every module's update is scaled by ``alpha / rank`` as in peft.
        dims: FLUX widths for the row offsets of fused layers; default: read from the LoRA (:func:`flux_lora_dims`).
        dtype: dtype of ``lora_down`` / ``lora_up`` (default: as given). ``alpha`` stays float32 so that the scale is
            exact in any dtype. The fusing itself is done in float32 and only copies values.

    Returns:
        ``{"lora_unet_<bfl module>.lora_down.weight" | ".lora_up.weight" | ".alpha": tensor}`` in module order.
    """
    pairs = split_lora_state(state)
    dims = dims or flux_lora_dims(pairs)
    groups: dict[str, list[tuple[BflSlice, Tensor, Tensor]]] = {}
    for module, (a, b) in pairs.items():
        if a.ndim != 2:
            raise ValueError(f"{module}: a convolution LoRA; the FLUX transformer has no convolutions")
        try:
            where = bfl_slice(module, dims)
        except KeyError:
            raise ValueError(
                f"{module}: not a layer of the FLUX transformer, so it has no kohya/ComfyUI name. Export in the "
                "diffusers format instead (--format diffusers)."
            ) from None
        if where.fused and b.shape[0] != where.size:
            raise ValueError(f"{module}: lora_B has {b.shape[0]} rows, the FLUX widths {dims} say {where.size}")
        groups.setdefault(where.module, []).append((where, a, b))

    out: dict[str, Tensor] = {}
    for bfl_module, parts in groups.items():
        down, up, fused_alpha = _fuse(parts, alpha)
        name = kohya_name(bfl_module)
        out[f"{name}.lora_down.weight"] = down if dtype is None else down.to(dtype)
        out[f"{name}.lora_up.weight"] = up if dtype is None else up.to(dtype)
        out[f"{name}.alpha"] = torch.tensor(fused_alpha, dtype=torch.float32)
    return out


def _fuse(parts: list[tuple[BflSlice, Tensor, Tensor]], alpha: float) -> tuple[Tensor, Tensor, float]:
    """One BFL module's ``(lora_down, lora_up, alpha)`` from the LoRAs of the diffusers modules it is made of."""
    where, a, b = parts[0]
    if not where.fused:
        return a, (swap_halves(b) if where.swap else b), float(alpha)
    parts = sorted(parts, key=lambda part: part[0].start)
    scale = alpha / parts[0][1].shape[0]  # alpha / r of the first part; the others' B absorb any difference
    rank = sum(a.shape[0] for _, a, _ in parts)
    dtype = torch.promote_types(torch.float32, b.dtype)
    up = torch.zeros(where.total or 0, rank, dtype=dtype, device=b.device)
    column = 0
    for part, a_i, b_i in parts:
        r = a_i.shape[0]
        ratio = (alpha / r) / scale
        up[part.start : part.start + b_i.shape[0], column : column + r] = b_i.to(dtype) * ratio if ratio != 1 else b_i
        column += r
    down = torch.cat([a.to(dtype) for _, a, _ in parts], dim=0)
    return down, up, scale * rank


def kohya_flux_metadata(rank: int, alpha: float, title: str = "") -> dict[str, str]:
    """kohya sd-scripts / modelspec header keys for a FLUX.1 LoRA (safetensors metadata values are strings).

    ``ss_network_dim`` / ``ss_network_alpha`` are the trained rank and alpha; fused modules have a larger rank with
    their alpha scaled alike (each module's own ``.alpha`` tensor is what loaders use).
    """
    meta = {
        "ss_network_module": "networks.lora_flux",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(float(alpha)),
        "ss_base_model_version": "flux1",
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "flux-1-dev/lora",
        "modelspec.implementation": "https://github.com/black-forest-labs/flux",
    }
    if title:
        meta["modelspec.title"] = title
    return meta


# --------------------------------------------------------------------------------------------- SDXL, SD1.5


def unet_to_kohya(
    state: Mapping[str, Tensor], alpha: float, layout: UNetLayout | None, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """Convert a UNet LoRA from peft keys to kohya / ComfyUI keys (see the module docstring).

    Args:
        state: peft keys without prefix or adapter name: ``down_blocks.1.attentions.0.proj_in.lora_A.weight``.
        alpha: the LoRA alpha, written as every module's ``.alpha`` (float32).
        layout: name modules by the original (SGM/LDM) UNet of this layout (SDXL); ``None`` keeps the diffusers
            names (SD1.x).
        dtype: dtype of ``lora_down`` / ``lora_up`` (default: as given).
    """
    out: dict[str, Tensor] = {}
    for module, (a, b) in split_lora_state(state).items():
        if layout is None:
            name = module
        else:
            try:
                name = diffusers_to_ldm(module, layout)
            except KeyError as e:
                raise ValueError(
                    f"{module}: not a layer of a UNet with the SDXL layout, so it has no kohya name ({e.args[0]}). "
                    "Export in the diffusers format instead (--format diffusers)."
                ) from None
        name = kohya_name(name)
        out[f"{name}.lora_down.weight"] = a if dtype is None else a.to(dtype)
        out[f"{name}.lora_up.weight"] = b if dtype is None else b.to(dtype)
        out[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return out


def sdxl_to_kohya(state: Mapping[str, Tensor], alpha: float, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """An SDXL UNet LoRA in sd-scripts' SDXL names (the original SGM UNet's modules)."""
    return unet_to_kohya(state, alpha, SDXL_LAYOUT, dtype=dtype)


def sd15_to_kohya(state: Mapping[str, Tensor], alpha: float, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """An SD1.x UNet LoRA in sd-scripts' SD1 names (the diffusers modules with ``_``)."""
    return unet_to_kohya(state, alpha, None, dtype=dtype)


def _kohya_unet_metadata(rank: int, alpha: float, title: str, base: str, architecture: str) -> dict[str, str]:
    meta = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(float(alpha)),
        "ss_base_model_version": base,
        "ss_network_train_unet_only": "True",
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": architecture,
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
    }
    if title:
        meta["modelspec.title"] = title
    return meta


def kohya_sdxl_metadata(rank: int, alpha: float, title: str = "") -> dict[str, str]:
    """kohya sd-scripts / modelspec header keys for an SDXL LoRA."""
    return _kohya_unet_metadata(rank, alpha, title, "sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora")


def kohya_sd15_metadata(rank: int, alpha: float, title: str = "") -> dict[str, str]:
    """kohya sd-scripts / modelspec header keys for an SD1.x LoRA."""
    meta = _kohya_unet_metadata(rank, alpha, title, "sd_v1", "stable-diffusion-v1/lora")
    meta["modelspec.implementation"] = "https://github.com/CompVis/stable-diffusion"
    return meta
