"""The kohya / ComfyUI LoRA layout: ``lora_unet_<module>`` keys, one ``.alpha`` per module, LyCORIS' variant tensors.

The format
----------
kohya's sd-scripts and ComfyUI name a LoRA after the module of the model *as their own code builds it*, dots replaced
by underscores, with a ``lora_unet_`` prefix: FLUX by the original Black Forest Labs modules
(:mod:`lightning_lora.formats.bfl`), SDXL by Stability AI's original (SGM) UNet, SD1.x by the diffusers UNet (see
below). Each module holds its variant's tensors and one ``alpha``::

    lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight   [R, in]     (peft's lora_A)
    lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight     [out, R]    (peft's lora_B)
    lora_unet_double_blocks_0_img_attn_qkv.alpha              []          the update is up @ down * alpha / R

Every loader computes the scale itself as ``alpha / R`` with ``R`` read from the tensors' shapes (sd-scripts
``networks/lora.py`` and ``networks/lora_flux.py`` ``create_network_from_weights``: ``dim = lora_down.size()[0]``;
ComfyUI ``comfy/weight_adapter/lora.py`` ``calculate_weight``: ``alpha / mat2.shape[0]``; diffusers
``_convert_kohya_flux_lora_to_diffusers``: ``alpha / down_weight.shape[0]``), so the file says the trained strength
without any config. Variants use LyCORIS' tensors, which ComfyUI (``comfy/lora.py`` ``load_lora``,
``comfy/weight_adapter/*``) and LyCORIS (``lycoris/kohya.py`` ``create_network_from_weights``, the network module
sd-scripts trains them with) read:

* DoRA: ``lora_down`` / ``lora_up`` / ``alpha`` plus ``dora_scale`` = peft's magnitude vector shaped ``[out, 1]``
  (``[out, 1, 1, 1]`` for a convolution): LyCORIS' ``wd_on_out=True`` convention (``modules/locon.py``: the norm of
  each *output* row of ``W + delta``), the one peft's DoRA uses. ComfyUI recognises it by ``dora_scale.shape[0] ==
  weight.shape[0]`` (``weight_adapter/base.py`` ``weight_decompose``) but divides by the row norms of the *base* weight
  there, not of ``W + delta`` (fix proposed in ComfyUI PR #15458): the result is close to the trained DoRA, not equal,
  and export says so. LyCORIS' older input-axis convention (``dora_scale [1, in]``) is a different function.
* LoKr: ``lokr_w1`` (or ``lokr_w1_a`` / ``lokr_w1_b``), ``lokr_w2`` (or ``_a`` / ``_b``, ``lokr_t2``), same shapes as
  peft's. ``alpha`` is divided by the low-rank factor's rank; with two full factors the loaders apply no scale, so the
  scale is folded into ``lokr_w1`` and ``alpha`` is 1.
* LoHa: ``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b`` (``hada_t1/t2``), same shapes as peft's; ``alpha``
  is divided by ``hada_w1_b.shape[0]``.

Fusing separate FLUX LoRAs into one BFL module, exactly
-------------------------------------------------------
diffusers keeps q, k and v (and, in a single block, the MLP input) as separate layers, so a peft LoRA has one adapter
per part; BFL has one fused layer (``img_attn.qkv`` = rows ``[q; k; v]``, ``single_blocks.i.linear1`` = rows
``[q; k; v; mlp]``). With parts ``i`` of rank ``r`` and the same scale ``s``, the fused delta is::

    [s B_q A_q x; s B_k A_k x; s B_v A_v x]  =  s * U @ D @ x,   D = [A_q; A_k; A_v]   (stacked: 3r x in)
                                                                U = blockdiag(B_q, B_k, B_v) at the parts' rows

so ``lora_down = D``, ``lora_up = U`` (zeros off the diagonal blocks, and zero rows for a part that had no LoRA) and
the fused rank is ``R = n r`` with ``alpha_fused = s R``. The result is the same function, not an approximation.
This is the layout sd-scripts itself writes for FLUX (``networks/lora_flux.py``: its ``split_qkv`` networks train
per-part LoRAs and ``LoRANetwork.state_dict`` merges them into exactly this block-diagonal form), because its loader
only knows BFL's modules: per-part keys would be "unexpected". The price is size: a fused ``linear1.lora_up`` has all
``3 * inner + mlp`` rows (21,504 for FLUX.1) even when only q, k, v were trained. The compact per-part file for FLUX
is the diffusers layout, which ComfyUI maps part by part onto row slices of the fused weights
(``comfy/utils.py`` ``flux_to_diffusers``: ``to_q`` -> ``(linear1, offset 0, size hidden)``), see
:mod:`lightning_lora.formats.clients`.

LoHa fuses the same way (block-diagonal ``hada_w1_a`` and ``hada_w2_a``, stacked ``_b``: the element-wise product
of the stacked rows is the stacked products). A Kronecker product does not split into row blocks, so a LoKr on a part
of a fused module has no exact BFL form; a DoRA magnitude needs every row of the fused weight, so DoRA on some but not
all of a fused module's parts has none either. Those parts are written one by one under ComfyUI's per-part names
(``lycoris_transformer_blocks_0_attn_to_q.lokr_w1``...: ``comfy/lora.py`` maps ``lycoris_<diffusers name>`` of FLUX to
the part's row slice), which ComfyUI applies exactly and sd-scripts / LyCORIS do not load (export says so:
:mod:`lightning_lora.formats.clients`).

The other layers map one to one (``to_out.0`` -> ``img_attn.proj``, ``proj_out`` -> ``linear2``, ...), except
``norm_out.linear`` -> ``final_layer.adaLN_modulation.1``, whose output halves swap: its output rows swap too.

Renamed layers: the UNets, Qwen-Image
------------------------------------
UNet LoRAs need no fusing: every peft module becomes one kohya module (:func:`unet_to_kohya`). Only the names differ,
as in sd-scripts:

* SD1.x: sd-scripts trains on a diffusers-structured UNet (``library/original_unet.py``), so the names are the diffusers
  ones with ``_`` (``lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q``);
* SDXL: sd-scripts trains on Stability AI's original UNet (``library/sdxl_original_unet.py``), so the names are the
  SGM ones (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``, see :mod:`lightning_lora.formats.ldm`).

kohya's musubi-tuner names Qwen-Image's modules as diffusers does (``networks.lora_qwen_image``), the SD1.x way.

Convolution LoRAs (the ``locon`` preset) keep their 4-D shapes (``lora_down [r, in, k, k]``, ``lora_up [out, r, 1,
1]``), as sd-scripts' LoCon ("LoRA-C3Lier") files have them.

Metadata
--------
:func:`kohya_metadata` writes the ``ss_*`` keys sd-scripts writes (``train_network.py``) and that UIs show:
``ss_network_module`` (``networks.lora`` / ``networks.lora_flux``, or ``lycoris.kohya`` for DoRA, LoKr, LoHa),
``ss_network_dim`` / ``ss_network_alpha`` (the trained rank and alpha), ``ss_network_args`` (``conv_dim`` /
``conv_alpha`` when convolutions are adapted, as sd-scripts' ``--network_args`` for LoCon; LyCORIS' ``algo``,
``dora_wd``...), ``ss_base_model_version``, ``ss_output_name``. A kohya file must *not* carry diffusers'
``lora_adapter_metadata``: diffusers converts a kohya file to peft keys with alpha already folded into the weights and
would then apply that config's ``lora_alpha`` a second time (0.42 refuses the combination outright).

Reading files made elsewhere
----------------------------
``lightning-lora export some_kohya_lora.safetensors --format diffusers`` needs the inverse: kohya names to diffusers
names, fused modules split into their parts, each module's ``alpha / rank`` folded into its weights. diffusers already
does that for ``pipe.load_lora_weights`` (``FluxLoraLoaderMixin.lora_state_dict`` ->
``_convert_kohya_flux_lora_to_diffusers``; ``StableDiffusionLoraLoaderMixin.lora_state_dict`` ->
``_maybe_map_sgm_blocks_to_diffusers`` and ``_convert_non_diffusers_lora_to_diffusers``; the FLUX.2 and Qwen-Image
loaders' own), and using it means a converted file is what diffusers itself would have loaded. Two gaps are closed
here (:func:`flux_from_kohya`):

* FLUX layers outside the blocks (``img_in`` ... ``final_layer``): diffusers' converter returns them without the
  ``transformer.`` prefix (so ``load_lora_weights`` drops them) and ``final_layer`` without its alpha; they map one to
  one, so they are converted here (``final_layer.adaLN_modulation.1`` with its output halves swapped back);
* zero rank components: a fused module that is not an exact block-diagonal of equal parts comes out of diffusers'
  converter as every part holding the whole ``lora_down`` (:func:`drop_unused_ranks`).

Plain LoRA only: diffusers' converters read ``lora_down`` / ``lora_up`` / ``alpha`` (they drop ``dora_scale`` and do not
read LyCORIS' LoKr / LoHa tensors). diffusers is imported when a reading function runs.

One layout, every family
------------------------
This module names no family. A family that writes this layout lists a :class:`KohyaLayout` in its
``lora_files.layouts``: its kohya network (:class:`KohyaNetwork`), its names (:func:`fused_to_kohya` with its table of
:mod:`lightning_lora.formats.bfl`, or :func:`unet_to_kohya`) and its reader; :func:`lightning_lora.export.export_lora`
writes the file through it. Apart from the readers, this module is pure tensor code (torch only).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_lora.errors import first_line
from lightning_lora.formats import FileFacts, LoraFormat
from lightning_lora.formats.adapters import Adapter, adapters_from_peft, alpha_rank, cast
from lightning_lora.formats.bfl import GLOBAL_MODULES, BflSlice, FluxDims, bfl_slice, swap_halves
from lightning_lora.formats.ldm import UNetLayout, diffusers_to_ldm

__all__ = [
    "KOHYA_PREFIX",
    "LYCORIS_PREFIX",
    "KohyaLayout",
    "KohyaNetwork",
    "NetworkSummary",
    "Slices",
    "adapter_to_kohya",
    "drop_unused_ranks",
    "flux_from_kohya",
    "from_kohya_by",
    "fused_to_kohya",
    "is_kohya_file",
    "kohya_metadata",
    "kohya_name",
    "network_summary",
    "separate_parts",
    "unet_from_kohya",
    "unet_to_kohya",
    "with_base_model_version",
]

#: Prefix of the denoiser's LoRA keys in kohya / ComfyUI files (text encoders use ``lora_te1_`` / ``lora_te2_``).
KOHYA_PREFIX = "lora_unet_"
#: Prefix of ComfyUI's per-part FLUX names (SimpleTuner's LyCORIS files: ``lycoris_<diffusers module with _>``,
#: ``comfy/lora.py`` ``model_lora_keys_unet``), used for the parts of fused layers that have no fused form.
LYCORIS_PREFIX = "lycoris_"

# Convolutions with a kernel larger than 1x1 in a diffusers UNet (sd-scripts' "conv" LoRA; a 1x1 convolution is a
# linear LoRA there: networks/lora.py ``is_conv2d_1x1``).
_CONV3 = re.compile(r"(^|\.)(conv_in|conv_out|conv1|conv2|conv)$")


def kohya_name(module: str) -> str:
    """``double_blocks.0.img_attn.qkv`` -> ``lora_unet_double_blocks_0_img_attn_qkv``."""
    return KOHYA_PREFIX + module.replace(".", "_")


# --------------------------------------------------------------------------------------------- one module


def adapter_to_kohya(
    adapter: Adapter, scale: float, *, dtype: torch.dtype | None = None, swap: bool = False, module: str = ""
) -> dict[str, Tensor]:
    """One module's tensors in the kohya / LyCORIS layout (suffixes: ``lora_down.weight``, ``lora_up.weight``,
    ``alpha``, ``dora_scale``, ``lokr_w1``, ``hada_w1_a``...).

    ``scale`` is peft's ``alpha / r``; ``alpha`` is written so that the loaders' ``alpha / rank`` gives it back (see
    :mod:`lightning_lora.formats.adapters`). ``swap`` swaps the two halves of the output rows (FLUX's final modulation).
    ``alpha`` and ``dora_scale`` stay float32, whatever ``dtype`` the weights are cast to.
    """
    v = adapter.variant
    out: dict[str, Tensor] = {}
    if v in ("LoRA", "DoRA"):
        b = adapter["lora_B"]
        out["lora_down.weight"] = cast(adapter["lora_A"], dtype)
        out["lora_up.weight"] = cast(swap_halves(b) if swap else b, dtype)
        out["alpha"] = _alpha(scale * adapter["lora_A"].shape[0])
        if v == "DoRA":
            out["dora_scale"] = _dora_scale(adapter["lora_magnitude_vector"], b, swap)
        return out
    if v == "LoHa":
        for name, tensor in adapter.tensors.items():
            if swap and name in ("hada_w1_a", "hada_w2_a"):
                if "hada_t1" in adapter.tensors:
                    raise ValueError(f"{module}: a Tucker LoHa on a layer whose output halves swap")
                tensor = swap_halves(tensor)
            out[name] = cast(tensor, dtype)
        out["alpha"] = _alpha(scale * adapter["hada_w1_b"].shape[0])
        return out
    tensors = dict(adapter.tensors)  # LoKr
    rank = alpha_rank(adapter)
    if swap:
        first = "lokr_w1" if "lokr_w1" in tensors else "lokr_w1_a"
        if tensors[first].shape[0] % 2:
            raise ValueError(f"{module}: a LoKr whose first factor has an odd number of rows cannot swap output halves")
        tensors[first] = swap_halves(tensors[first])
    if rank is None:  # two full factors: the loaders apply no scale (ComfyUI lokr.py, LyCORIS lokr.py)
        tensors["lokr_w1"] = tensors["lokr_w1"] * scale
    out.update({name: cast(t, dtype) for name, t in tensors.items()})
    out["alpha"] = _alpha(scale * rank if rank is not None else 1.0)
    return out


def _alpha(value: float) -> Tensor:
    return torch.tensor(float(value), dtype=torch.float32)


def _dora_scale(magnitude: Tensor, lora_b: Tensor, swap: bool = False) -> Tensor:
    """peft's magnitude vector ``[out]`` (``[1, out, 1, 1]`` for a convolution) as LyCORIS' ``dora_scale``
    ``[out, 1]`` (``[out, 1, 1, 1]``)."""
    m = magnitude.detach().reshape(-1).to(torch.float32)
    if swap:
        m = swap_halves(m)
    return m.reshape(-1, *([1] * (lora_b.ndim - 1)))


# --------------------------------------------------------------------------------------------- fused layers (BFL)

Slices = Callable[[Mapping[str, Adapter]], Mapping[str, BflSlice]]
"""Where each adapted module of a LoRA (diffusers names) lives in a layout that fuses some of them
(:func:`lightning_lora.formats.bfl.flux_lora_slices`...); ``ValueError`` naming a module that has no place there."""


def fused_to_kohya(
    state: Mapping[str, Tensor],
    scale: float,
    dtype: torch.dtype | None = None,
    *,
    slices: Slices,
    name: Callable[[str], str] = kohya_name,
) -> dict[str, Tensor]:
    """A LoRA from peft keys to kohya / ComfyUI keys in a layout that fuses some of its layers (BFL's FLUX.1 and
    FLUX.2; see the module docstring).

    Args:
        state: a peft state dict without prefix or adapter name (``transformer_blocks.0.attn.to_q.lora_A.weight``;
            DoRA, LoKr and LoHa tensors too).
        scale: every module's update is multiplied by this (peft's ``alpha / r``).
        dtype: dtype of the weights (default: as given). ``alpha`` and ``dora_scale`` stay float32. The fusing itself
            only copies values.
        slices: where each module lives in the layout (the family's table, e.g. ``bfl.flux_lora_slices``).
        name: a fused or whole module's key (:func:`kohya_name`; the ComfyUI layout's ``diffusion_model.<module>``).

    Returns:
        ``{"lora_unet_<module>.<tensor>": tensor}`` (``name``'s keys) in module order; the parts of a fused layer that
        have no exact fused form under ComfyUI's per-part ``lycoris_<diffusers name>`` names.

    Raises:
        ValueError: naming the module, for one ``slices`` places nowhere, a LoKr on a part of a fused layer, a DoRA on
        some but not all parts of one, or parts of different variants.
    """
    adapters = adapters_from_peft(state)
    placed = slices(adapters)
    groups: dict[str, list[tuple[BflSlice, str, Adapter]]] = {}
    for module, adapter in adapters.items():
        groups.setdefault(placed[module].module, []).append((placed[module], module, adapter))
    separate = separate_parts({m: a.variant for m, a in adapters.items()}, placed)
    out: dict[str, Tensor] = {}
    for fused_module, parts in groups.items():
        where, module, adapter = parts[0]
        if where.fused and module in separate:
            for _, part, part_adapter in parts:  # no exact fused form: ComfyUI's per-part names (module docstring)
                tensors = adapter_to_kohya(part_adapter, scale, dtype=dtype, module=part)
                out.update({f"{LYCORIS_PREFIX}{part.replace('.', '_')}.{s}": t for s, t in tensors.items()})
            continue
        if where.fused:
            tensors = _fuse(fused_module, parts, scale, dtype)
        else:
            tensors = adapter_to_kohya(adapter, scale, dtype=dtype, swap=where.swap, module=module)
        key = name(fused_module)
        out.update({f"{key}.{suffix}": t for suffix, t in tensors.items()})
    return out


def separate_parts(variants: Mapping[str, str], slices: Mapping[str, BflSlice]) -> set[str]:
    """The parts of fused layers (diffusers names) that have no exact fused form and are written one by one under
    ComfyUI's per-part names: every part of a fused layer that has a LoKr on some part, or DoRA on some but not all of
    its parts (module docstring). ``variants``: ``{module: variant}``; ``slices``: where they live (modules without a
    slice are not parts)."""
    groups: dict[str, list[str]] = {}
    for module in variants:
        where = slices.get(module)
        if where is not None and where.fused:
            groups.setdefault(where.module, []).append(module)
    separate: set[str] = set()
    for parts in groups.values():
        kinds = {variants[p] for p in parts}
        complete = sum(slices[p].size or 0 for p in parts) == slices[parts[0]].total
        if "LoKr" in kinds or ("DoRA" in kinds and not complete):
            separate.update(parts)
    return separate


def _fuse(
    bfl_module: str, parts: list[tuple[BflSlice, str, Adapter]], scale: float, dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """One fused BFL module's tensors from the adapters of the diffusers modules it is made of (module docstring)."""
    parts = sorted(parts, key=lambda part: part[0].start)
    variants = {adapter.variant for _, _, adapter in parts}
    names = ", ".join(module for _, module, _ in parts)
    if len(variants) > 1:
        raise ValueError(f"{bfl_module}: its parts ({names}) are adapters of different variants ({variants})")
    variant = variants.pop()
    total = parts[0][0].total or 0
    if variant == "DoRA" and sum(adapter.out_features for _, _, adapter in parts) != total:
        raise ValueError(f"{bfl_module}: DoRA on {names} does not cover all rows (write the parts separately)")
    lora = variant in ("LoRA", "DoRA")
    pairs = [("lora_B", "lora_A")] if lora else [("hada_w1_a", "hada_w1_b"), ("hada_w2_a", "hada_w2_b")]
    rank = sum(adapter[pairs[0][1]].shape[0] for _, _, adapter in parts)
    fused: dict[str, Tensor] = {}
    for up_name, down_name in pairs:
        dtype_up = torch.promote_types(torch.float32, parts[0][2][up_name].dtype)
        up = torch.zeros(total, rank, dtype=dtype_up, device=parts[0][2][up_name].device)
        column = 0
        for where, _, adapter in parts:
            b, r = adapter[up_name], adapter[down_name].shape[0]
            up[where.start : where.start + b.shape[0], column : column + r] = b
            column += r
        down = torch.cat([adapter[down_name].to(dtype_up) for _, _, adapter in parts], dim=0)
        fused[up_name], fused[down_name] = cast(up, dtype), cast(down, dtype)
    if variant == "LoHa":
        return {**fused, "alpha": _alpha(scale * rank)}
    out = {"lora_down.weight": fused["lora_A"], "lora_up.weight": fused["lora_B"], "alpha": _alpha(scale * rank)}
    if variant == "DoRA":
        magnitude = torch.cat([adapter["lora_magnitude_vector"].reshape(-1) for _, _, adapter in parts])
        out["dora_scale"] = magnitude.to(torch.float32).reshape(-1, 1)
    return out


# --------------------------------------------------------------------------------------------- renamed layers


def unet_to_kohya(
    state: Mapping[str, Tensor], scale: float, dtype: torch.dtype | None = None, *, layout: UNetLayout | None = None
) -> dict[str, Tensor]:
    """A LoRA from peft keys to kohya / ComfyUI keys, one kohya module per peft module (see the module docstring): the
    UNets, and any model whose kohya names are its diffusers names.

    Args:
        state: a peft state dict without prefix or adapter name (``down_blocks.1.attentions.0.proj_in.lora_A.weight``;
            DoRA, LoKr and LoHa tensors too).
        scale: every module's update is multiplied by this (peft's ``alpha / r``).
        dtype: dtype of the weights (default: as given).
        layout: name modules by the original (SGM/LDM) UNet of this layout (SDXL's,
            :data:`~lightning_lora.formats.ldm.SDXL_LAYOUT`); ``None`` keeps the diffusers names (SD1.x, Qwen-Image).
    """
    out: dict[str, Tensor] = {}
    for module, adapter in adapters_from_peft(state).items():
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
        prefix = kohya_name(name)
        tensors = adapter_to_kohya(adapter, scale, dtype=dtype, module=module)
        out.update({f"{prefix}.{suffix}": t for suffix, t in tensors.items()})
    return out


# --------------------------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class KohyaNetwork:
    """A family's constants in kohya's metadata: the sd-scripts network module of a plain LoRA and
    ``ss_base_model_version`` (``library/train_util.py``, ``train_network.py``)."""

    network_module: str
    base_model_version: str


_ALGO = {"LoRA": "lora", "DoRA": "lora", "LoKr": "lokr", "LoHa": "loha"}


@dataclass(frozen=True)
class NetworkSummary:
    """What kohya's ``ss_network_*`` keys say about a file: how sd-scripts (or LyCORIS through it) would rebuild the
    network that wrote it."""

    rank: int
    """The trained rank (``ss_network_dim``)."""
    alpha: float
    """The trained alpha (``ss_network_alpha``)."""
    variant: str = "LoRA"
    """``LoRA``, ``DoRA``, ``LoKr`` or ``LoHa`` (the last three load through LyCORIS: ``lycoris.kohya``)."""
    conv: bool = False
    """Whether convolutions with a kernel larger than 1x1 are adapted (sd-scripts' ``conv_dim`` / ``conv_alpha``)."""
    module_ranks: dict[str, int] = field(default_factory=dict)
    """Kohya module -> its rank in the file, where it is not ``rank`` (FLUX's fused modules: ``n * rank``)."""
    output_name: str = ""
    """The file's name without suffix (``ss_output_name``)."""


def network_summary(
    kohya: Mapping[str, Tensor], state: Mapping[str, Tensor], rank: int, alpha: float, output_name: str = ""
) -> NetworkSummary:
    """The :class:`NetworkSummary` of a kohya file's tensors ``kohya``, made from the peft ``state``."""
    adapters = adapters_from_peft(state)
    variants = {a.variant for a in adapters.values()}
    variant = next((v for v in ("DoRA", "LoKr", "LoHa") if v in variants), "LoRA")
    conv = any(_CONV3.search(m) for m in adapters)
    ranks: dict[str, int] = {}
    for key, tensor in kohya.items():
        name, _, suffix = key.partition(".")
        if suffix in ("lora_down.weight", "hada_w1_b"):
            ranks[name] = int(tensor.shape[0])
    return NetworkSummary(
        rank=rank,
        alpha=alpha,
        variant=variant,
        conv=conv,
        module_ranks={n: r for n, r in ranks.items() if r != rank},
        output_name=output_name,
    )


def kohya_metadata(summary: NetworkSummary, network: KohyaNetwork) -> dict[str, str]:
    """kohya sd-scripts' header keys (``ss_*``) of a kohya file (safetensors metadata values are strings).

    ``ss_network_dim`` / ``ss_network_alpha`` are the trained rank and alpha; ``ss_network_args`` holds what
    ``--network_args`` would have to say to rebuild the network (LoCon's ``conv_dim`` / ``conv_alpha``; LyCORIS'
    ``algo``, ``dora_wd``, ``wd_on_output``...). Modules whose rank in the file differs (FLUX's fused q/k/v) are listed
    in ``lightning_lora.module_ranks``: each module's own ``.alpha`` and shapes are what loaders use, and sd-scripts
    continues training such a file with ``--dim_from_weights``.
    """
    args: dict[str, str] = {}
    lycoris = summary.variant != "LoRA"
    if lycoris:
        args["algo"] = _ALGO[summary.variant]
        if summary.variant == "DoRA":
            args.update(dora_wd="True", wd_on_output="True")
        if summary.variant == "LoKr":
            args["factor"] = "-1"
    if summary.conv:
        args.update(conv_dim=str(summary.rank), conv_alpha=str(float(summary.alpha)))
    meta = {
        "ss_network_module": "lycoris.kohya" if lycoris else network.network_module,
        "ss_network_dim": str(summary.rank),
        "ss_network_alpha": str(float(summary.alpha)),
        "ss_base_model_version": network.base_model_version,
        "ss_network_train_unet_only": "True",
    }
    if args:
        meta["ss_network_args"] = json.dumps(args)
    if summary.output_name:
        meta["ss_output_name"] = summary.output_name
    if summary.module_ranks:
        meta["lightning_lora.module_ranks"] = json.dumps(summary.module_ranks)
    return meta


# --------------------------------------------------------------------------------------------- reading


def flux_from_kohya(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A FLUX kohya LoRA file's tensors as a peft state dict (diffusers names), every module's ``alpha / rank`` folded
    into its weights.

    The block layers go through diffusers' own converter (``FluxLoraLoaderMixin.lora_state_dict``, which splits fused
    q/k/v back into parts); the layers outside the blocks (``img_in`` ... ``final_layer``), which that converter drops
    or loads without their alpha, are mapped here one to one (``final_layer.adaLN_modulation.1`` with its output
    halves swapped back). Like diffusers' converter, it expects FLUX.1's widths for ``linear1``.
    """
    from diffusers.loaders import FluxLoraLoaderMixin

    outside = {kohya_name(bfl_slice(m, FluxDims(0, 0)).module): m for m in GLOBAL_MODULES}
    rest = dict(tensors)
    state: dict[str, Tensor] = {}
    for name, module in outside.items():
        if f"{name}.lora_down.weight" not in rest:
            continue
        a, b = _scaled_pair(rest, name)
        state[f"{module}.lora_A.weight"] = a
        state[f"{module}.lora_B.weight"] = swap_halves(b) if module == "norm_out.linear" else b
    if rest:
        converted = FluxLoraLoaderMixin.lora_state_dict(rest)
        converted = converted[0] if isinstance(converted, tuple) else converted
        state.update({k.removeprefix("transformer."): v for k, v in converted.items()})
    return drop_unused_ranks(state)


def unet_from_kohya(tensors: Mapping[str, Tensor], *, layout: UNetLayout | None = None) -> dict[str, Tensor]:
    """An SD/SDXL kohya LoRA file's tensors as a peft state dict (diffusers names), every module's ``alpha / rank``
    folded into its weights, through diffusers' own converter (``StableDiffusionLoraLoaderMixin.lora_state_dict``,
    with the SGM block numbering of ``layout`` for SDXL names)."""
    from types import SimpleNamespace

    from diffusers.loaders import StableDiffusionLoraLoaderMixin
    from diffusers.utils import convert_unet_state_dict_to_peft

    config = SimpleNamespace(layers_per_block=layout.layers_per_block) if layout is not None else None
    converted, alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(dict(tensors), unet_config=config)
    alphas = alphas or {}
    state: dict[str, Tensor] = {}
    # diffusers' old names: <module>.lora.down.weight, <attention>.processor.to_q_lora.down.weight...
    for key, down in converted.items():
        if not key.endswith(".down.weight"):
            continue
        up = converted[key.removesuffix("down.weight") + "up.weight"]
        alpha = alphas.get(f"{key}.alpha", alphas.get(key.removesuffix(".lora.down.weight") + ".alpha"))
        scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
        (name,) = convert_unet_state_dict_to_peft({key: down})  # diffusers' own renaming to peft keys
        module = name.removeprefix("unet.").removesuffix(".lora_A.weight")
        state[f"{module}.lora_A.weight"] = down
        state[f"{module}.lora_B.weight"] = up if scale == 1 else (up.float() * scale).to(up.dtype)
    return drop_unused_ranks(state)


def drop_unused_ranks(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (plain LoRA) without the rank components that contribute nothing: the columns of ``lora_B`` that are
    all zero (and their rows of ``lora_A``), and the modules left with none. The same function, exactly; every tensor
    its own copy.

    A fused kohya module that is not an exact block-diagonal of equal parts (FLUX's ``linear1`` with only q, k, v
    trained: rank ``3r`` over four parts) comes out of diffusers' converter as every part holding the whole
    ``lora_down`` and its rows of ``lora_up``: mostly zero columns, and a ``proj_mlp`` adapter of zeros. Dropping them
    gives back one rank-``r`` adapter per trained part.
    """
    out: dict[str, Tensor] = {}
    for module, adapter in adapters_from_peft(state).items():
        a, b = adapter["lora_A"], adapter["lora_B"]
        used = b.reshape(b.shape[0], b.shape[1], -1).abs().amax(dim=(0, 2)) > 0  # per rank component
        if not bool(used.any()):
            continue
        if not bool(used.all()):
            a, b = a[used], b[:, used]
        out[f"{module}.lora_A.weight"] = a.clone()
        out[f"{module}.lora_B.weight"] = b.clone()
    return out


def _scaled_pair(tensors: dict[str, Tensor], name: str) -> tuple[Tensor, Tensor]:
    """Pop one kohya module's ``(lora_down, lora_up * alpha / rank)``."""
    down, up = tensors.pop(f"{name}.lora_down.weight"), tensors.pop(f"{name}.lora_up.weight")
    alpha = tensors.pop(f"{name}.alpha", None)
    scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
    return down, up if scale == 1 else (up.float() * scale).to(up.dtype)


def from_kohya_by(tensors: Mapping[str, Tensor], *, loader: str) -> dict[str, Tensor]:
    """A kohya-layout LoRA file (plain LoRA) as a peft state dict, through the ``lora_state_dict`` of the diffusers
    loader ``loader`` (``Flux2LoraLoaderMixin``, ``QwenImageLoraLoaderMixin``: each folds ``alpha / rank`` in and
    splits fused layers back into their parts)."""
    import diffusers.loaders

    converted: Any = getattr(diffusers.loaders, loader).lora_state_dict(dict(tensors))
    return {k.removeprefix("transformer."): v for k, v in converted.items()}


def is_kohya_file(tensors: Mapping[str, Tensor]) -> bool:
    """Whether every key is a kohya / ComfyUI module's (``lora_unet_<module>.*``, ComfyUI's per-part ``lycoris_``)."""
    return bool(tensors) and all(k.startswith((KOHYA_PREFIX, LYCORIS_PREFIX)) for k in tensors)


# --------------------------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class KohyaLayout:
    """The kohya / ComfyUI layout as one family serves it: the family's names in it, its kohya network, how files made
    elsewhere are read back. A family lists it in its ``lora_files.layouts``."""

    network: KohyaNetwork
    """What ``ss_network_module`` / ``ss_base_model_version`` say of the family's files."""
    to_kohya: Callable[..., dict[str, Tensor]]
    """``(state, scale, dtype)`` -> the file's tensors: :func:`fused_to_kohya` or :func:`unet_to_kohya` with the
    family's names."""
    from_kohya: Callable[[Mapping[str, Tensor]], dict[str, Tensor]]
    """A file's tensors (plain LoRA) -> a peft state dict, ``alpha / rank`` folded in (diffusers' converter for the
    family: :func:`flux_from_kohya`, :func:`unet_from_kohya`, :func:`from_kohya_by`)."""
    format: ClassVar[LoraFormat] = "kohya"

    def write(self, state: Mapping[str, Tensor], file: FileFacts) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The file's tensors and its ``ss_*`` header entries (:func:`kohya_metadata`)."""
        tensors = self.to_kohya(state, file.scale, file.dtype)
        summary = network_summary(tensors, state, file.rank, file.alpha, output_name=file.title)
        return tensors, kohya_metadata(summary, self.network)

    def read(self, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> dict[str, Tensor]:
        """A kohya file made elsewhere (plain LoRA) as a peft state dict; ``ValueError`` naming what it cannot read."""
        variants = sorted(
            {k.split(".", 1)[1] for k in tensors if not k.endswith(("lora_down.weight", "lora_up.weight", ".alpha"))}
        )
        if variants:
            raise ValueError(
                f"has {', '.join(variants[:3])} tensors (DoRA, LoKr or LoHa); lightning-lora converts kohya files of "
                "plain LoRA (diffusers' converter reads lora_down / lora_up / alpha only)."
            )
        try:
            return self.from_kohya(tensors)
        except (ValueError, KeyError, AssertionError) as e:
            raise ValueError(
                f"diffusers' converter could not read it as a kohya LoRA of this family ({first_line(e)})."
                + _not_for_diffusers(metadata)
            ) from None


def with_base_model_version(layouts: tuple[Any, ...], version: str) -> tuple[Any, ...]:
    """``layouts`` (a family's ``lora_files.layouts``) with the kohya layout's ``ss_base_model_version`` set to
    ``version``: a variant of a family (FLUX.1 Kontext of FLUX.1) writes its parent's files under a version of its
    own, so that a file made elsewhere that carries it is read as the variant's."""
    return tuple(
        dataclasses.replace(layout, network=dataclasses.replace(layout.network, base_model_version=version))
        if isinstance(layout, KohyaLayout)
        else layout
        for layout in layouts
    )


def _not_for_diffusers(metadata: Mapping[str, str]) -> str:
    """What to use instead, for a kohya file whose header (``lightning_lora.loads_in``, written by lightning-lora)
    says diffusers does not load it (a FLUX kohya file at other widths than FLUX.1's); "" for another file."""
    try:
        loads_in = json.loads(metadata.get("lightning_lora.loads_in", "null"))
    except ValueError:
        return ""
    if not isinstance(loads_in, list) or "diffusers" in loads_in:
        return ""
    from lightning_lora.formats.clients import TOOL_NAMES

    tools = ", ".join(TOOL_NAMES.get(str(tool), str(tool)) for tool in loads_in)
    return (
        f" Its header says it loads in {tools}, not diffusers: convert the run's checkpoint "
        "instead (lightning-lora export .../checkpoints/last.ckpt --format diffusers), or use the diffusers file "
        "written beside it."
    )
