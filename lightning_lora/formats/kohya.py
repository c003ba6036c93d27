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

SDXL and SD1.5
--------------
UNet LoRAs need no fusing: every peft module becomes one kohya module. Only the names differ, per family as in
sd-scripts:

* SD1.x: sd-scripts trains on a diffusers-structured UNet (``library/original_unet.py``), so the names are the diffusers
  ones with ``_`` (``lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q``);
* SDXL: sd-scripts trains on Stability AI's original UNet (``library/sdxl_original_unet.py``), so the names are the
  SGM ones (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``, see :mod:`lightning_lora.formats.ldm`).

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

Files made elsewhere are read back by :mod:`lightning_lora.formats.kohya_read`. This module is pure tensor code
(torch only). The families call it from
:meth:`~lightning_lora.families.base.DiffusionFamily.kohya_lora` and
:meth:`~lightning_lora.families.base.DiffusionFamily.kohya_metadata`; :func:`lightning_lora.export.export_lora` writes
the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_lora.formats.adapters import Adapter, adapters_from_peft, alpha_rank, cast
from lightning_lora.formats.bfl import BflSlice, FluxDims, bfl_slice, swap_halves
from lightning_lora.formats.ldm import SDXL_LAYOUT, UNetLayout, diffusers_to_ldm

__all__ = [
    "FLUX_NETWORK",
    "KOHYA_PREFIX",
    "LYCORIS_PREFIX",
    "SD15_NETWORK",
    "SDXL_NETWORK",
    "KohyaNetwork",
    "NetworkSummary",
    "adapter_to_kohya",
    "flux_lora_dims",
    "flux_separate_parts",
    "flux_to_kohya",
    "kohya_metadata",
    "kohya_name",
    "network_summary",
    "sd15_to_kohya",
    "sdxl_to_kohya",
    "unet_to_kohya",
]

#: Prefix of the denoiser's LoRA keys in kohya / ComfyUI files (text encoders use ``lora_te1_`` / ``lora_te2_``).
KOHYA_PREFIX = "lora_unet_"
#: Prefix of ComfyUI's per-part FLUX names (SimpleTuner's LyCORIS files: ``lycoris_<diffusers module with _>``,
#: ``comfy/lora.py`` ``model_lora_keys_unet``), used for the parts of fused layers that have no fused form.
LYCORIS_PREFIX = "lycoris_"

# Modules whose LoRA input is the transformer width (``inner_dim``) and that are parts of a fused BFL layer.
_FUSED_PART = re.compile(r"(^|\.)(attn\.(to_[qkv]|add_[qkv]_proj)|proj_mlp)$")
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


# --------------------------------------------------------------------------------------------- FLUX


def flux_lora_dims(adapters: Mapping[str, Adapter]) -> FluxDims:
    """The :class:`FluxDims` that the fused layers of a FLUX LoRA need, read from the LoRA's own shapes.

    Every part of a fused layer takes the transformer width as input (``inner_dim``); the single blocks' MLP width is
    ``proj_mlp``'s output when it has a LoRA and FLUX.1's ``4 * inner_dim`` otherwise. A LoRA without fused parts
    needs no dims (zeros are returned).
    """
    inner = next((a.in_features for m, a in adapters.items() if _FUSED_PART.search(m)), 0)
    mlp = next((a.out_features for m, a in adapters.items() if m.endswith(".proj_mlp")), 4 * inner)
    return FluxDims(inner_dim=inner, mlp_hidden_dim=mlp)


def flux_to_kohya(
    state: Mapping[str, Tensor], scale: float, dims: FluxDims | None = None, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """Convert a FLUX transformer LoRA from peft keys to kohya / ComfyUI keys (see the module docstring).

    Args:
        state: a peft state dict without prefix or adapter name (``transformer_blocks.0.attn.to_q.lora_A.weight``;
            DoRA, LoKr and LoHa tensors too).
        scale: every module's update is multiplied by this (peft's ``alpha / r``).
        dims: FLUX widths for the row offsets of fused layers; default: read from the LoRA (:func:`flux_lora_dims`).
        dtype: dtype of the weights (default: as given). ``alpha`` and ``dora_scale`` stay float32. The fusing itself
            only copies values.

    Returns:
        ``{"lora_unet_<bfl module>.<tensor>": tensor}`` in module order.

    Raises:
        ValueError: naming the module, for a module that is not a layer of the FLUX transformer, a convolution, a
        LoKr on a part of a fused layer, a DoRA on some but not all parts of one, or parts of different variants.
    """
    adapters = adapters_from_peft(state)
    dims = dims or flux_lora_dims(adapters)
    groups: dict[str, list[tuple[BflSlice, str, Adapter]]] = {}
    for module, adapter in adapters.items():
        if adapter.variant in ("LoRA", "DoRA") and adapter["lora_A"].ndim != 2:
            raise ValueError(f"{module}: a convolution LoRA; the FLUX transformer has no convolutions")
        try:
            where = bfl_slice(module, dims)
        except KeyError:
            raise ValueError(
                f"{module}: not a layer of the FLUX transformer, so it has no kohya/ComfyUI name. Export in the "
                "diffusers format instead (--format diffusers)."
            ) from None
        if where.fused and adapter.out_features != where.size:
            raise ValueError(
                f"{module}: its adapter has {adapter.out_features} rows, the FLUX widths {dims} say {where.size}"
            )
        groups.setdefault(where.module, []).append((where, module, adapter))

    separate = flux_separate_parts({m: a.variant for m, a in adapters.items()})
    out: dict[str, Tensor] = {}
    for bfl_module, parts in groups.items():
        where, module, adapter = parts[0]
        if where.fused and module in separate:
            for _, part, part_adapter in parts:  # no exact fused form: ComfyUI's per-part names (module docstring)
                tensors = adapter_to_kohya(part_adapter, scale, dtype=dtype, module=part)
                out.update({f"{LYCORIS_PREFIX}{part.replace('.', '_')}.{s}": t for s, t in tensors.items()})
            continue
        if where.fused:
            tensors = _fuse(bfl_module, parts, scale, dtype)
        else:
            tensors = adapter_to_kohya(adapter, scale, dtype=dtype, swap=where.swap, module=module)
        name = kohya_name(bfl_module)
        out.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
    return out


def flux_separate_parts(variants: Mapping[str, str]) -> set[str]:
    """The parts of fused FLUX layers (diffusers names) that have no exact fused form and are written one by one
    under ComfyUI's per-part names: every part of a fused layer that has a LoKr on some part, or DoRA on some but not
    all of its parts (module docstring). ``variants``: ``{module: variant}``."""
    groups: dict[str, list[str]] = {}
    for module in variants:
        try:
            where = bfl_slice(module, FluxDims(1, 4))
        except KeyError:
            continue
        if where.fused:
            groups.setdefault(where.module, []).append(module)
    separate: set[str] = set()
    for bfl_module, parts in groups.items():
        kinds = {variants[p] for p in parts}
        complete = len(parts) == (4 if bfl_module.endswith("linear1") else 3)
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


# --------------------------------------------------------------------------------------------- SDXL, SD1.5


def unet_to_kohya(
    state: Mapping[str, Tensor], scale: float, layout: UNetLayout | None, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """Convert a UNet LoRA from peft keys to kohya / ComfyUI keys (see the module docstring).

    Args:
        state: a peft state dict without prefix or adapter name (``down_blocks.1.attentions.0.proj_in.lora_A.weight``;
            DoRA, LoKr and LoHa tensors too).
        scale: every module's update is multiplied by this (peft's ``alpha / r``).
        layout: name modules by the original (SGM/LDM) UNet of this layout (SDXL); ``None`` keeps the diffusers
            names (SD1.x).
        dtype: dtype of the weights (default: as given).
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


def sdxl_to_kohya(state: Mapping[str, Tensor], scale: float, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """An SDXL UNet LoRA in sd-scripts' SDXL names (the original SGM UNet's modules)."""
    return unet_to_kohya(state, scale, SDXL_LAYOUT, dtype=dtype)


def sd15_to_kohya(state: Mapping[str, Tensor], scale: float, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """An SD1.x UNet LoRA in sd-scripts' SD1 names (the diffusers modules with ``_``)."""
    return unet_to_kohya(state, scale, None, dtype=dtype)


# --------------------------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class KohyaNetwork:
    """The family's constants in kohya's metadata: the sd-scripts network module of a plain LoRA and
    ``ss_base_model_version`` (``library/train_util.py``, ``train_network.py``)."""

    network_module: str
    base_model_version: str


FLUX_NETWORK = KohyaNetwork("networks.lora_flux", "flux1")
SDXL_NETWORK = KohyaNetwork("networks.lora", "sdxl_base_v1-0")
SD15_NETWORK = KohyaNetwork("networks.lora", "sd_v1")

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
