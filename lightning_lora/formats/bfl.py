"""Black Forest Labs' (BFL) names of the FLUX.1 and FLUX.2 transformers, against diffusers' names.

BFL's checkpoints (and the modules ComfyUI, Forge and kohya's sd-scripts build FLUX with) name the transformer as BFL's
own code does and fuse projections that diffusers keeps separate. This module is that layout, one table per model;
the families that use it (FLUX.1 for single files and its kohya/ComfyUI LoRA files, FLUX.2 for its ComfyUI LoRA files)
pick their table.

FLUX.1: two layouts of the same weights
---------------------------------------
``flux1-dev.safetensors`` (the file ComfyUI, Forge and kohya's sd-scripts load) uses BFL's own module names, and it
fuses some projections that diffusers keeps separate:

=============================================  ==================================================================
diffusers (``FluxTransformer2DModel``)         BFL
=============================================  ==================================================================
``x_embedder``                                 ``img_in``
``context_embedder``                           ``txt_in``
``time_text_embed.timestep_embedder.linear_1``  ``time_in.in_layer`` (``linear_2`` -> ``out_layer``)
``time_text_embed.text_embedder.*``            ``vector_in.*`` (the pooled CLIP vector)
``time_text_embed.guidance_embedder.*``        ``guidance_in.*`` (FLUX.1-dev only)
``transformer_blocks.i.attn.to_q/to_k/to_v``   ``double_blocks.i.img_attn.qkv`` -- fused: rows ``[q; k; v]``
``transformer_blocks.i.attn.add_{q,k,v}_proj`` ``double_blocks.i.txt_attn.qkv`` -- fused: rows ``[q; k; v]``
``transformer_blocks.i.attn.norm_q`` etc.      ``double_blocks.i.img_attn.norm.query_norm`` (param ``scale``)
``transformer_blocks.i.attn.to_out.0``         ``double_blocks.i.img_attn.proj`` (``to_add_out`` -> ``txt_attn.proj``)
``transformer_blocks.i.norm1.linear``          ``double_blocks.i.img_mod.lin`` (``norm1_context`` -> ``txt_mod``)
``transformer_blocks.i.ff.net.0.proj / .2``    ``double_blocks.i.img_mlp.0 / .2`` (``ff_context`` -> ``txt_mlp``)
``single_transformer_blocks.i.attn.to_q/k/v``  ``single_blocks.i.linear1`` -- fused: rows ``[q; k; v; mlp]``
``single_transformer_blocks.i.proj_mlp``       ``single_blocks.i.linear1`` (the last ``4 * inner_dim`` rows)
``single_transformer_blocks.i.proj_out``       ``single_blocks.i.linear2``
``single_transformer_blocks.i.norm.linear``    ``single_blocks.i.modulation.lin``
``proj_out``                                   ``final_layer.linear``
``norm_out.linear``                            ``final_layer.adaLN_modulation.1`` -- output halves swapped
=============================================  ==================================================================

The last row is the one trap: BFL's final modulation outputs ``(shift, scale)``, diffusers' ``AdaLayerNormContinuous``
``(scale, shift)``, so the two halves of the output rows (weight and bias) trade places. The swap is its own inverse.

One table for weights and for LoRA
----------------------------------
:func:`bfl_slice` answers, for one diffusers module name, where its output rows live in the BFL checkpoint (a
:class:`BflSlice`). :func:`diffusers_to_bfl` and :func:`bfl_to_diffusers` are built on it, and the round-trip test
through diffusers' own ``from_single_file`` checks the table. LoRA export uses the same answers: a LoRA on
``transformer_blocks.3.attn.to_k`` is a delta on rows ``[inner, 2*inner)`` of ``double_blocks.3.img_attn.qkv``; to write
one fused kohya/ComfyUI LoRA for the qkv module, stack the three ``lora_A``s and put the ``lora_B``s block-diagonally
at those row offsets (:func:`flux_lora_slices`; the algebra is in :mod:`lightning_lora.formats.kohya`).

FLUX.2
------
diffusers' ``Flux2Transformer2DModel`` and BFL's FLUX.2 checkpoint differ in names, and BFL fuses the double blocks'
q/k/v; the single blocks are fused in both (one input projection for q, k, v and the MLP, one output projection for
both):

==============================================  ==================================================================
diffusers                                       BFL (ComfyUI)
==============================================  ==================================================================
``x_embedder`` / ``context_embedder``           ``img_in`` / ``txt_in``
``time_guidance_embed.timestep_embedder.*``     ``time_in.in_layer`` / ``out_layer`` (``guidance_embedder``: dev's
                                                ``guidance_in``)
``double_stream_modulation_img.linear``         ``double_stream_modulation_img.lin`` (``_txt``; ``single_stream_``)
``transformer_blocks.i.attn.to_q/to_k/to_v``    ``double_blocks.i.img_attn.qkv`` -- fused: rows ``[q; k; v]``
``transformer_blocks.i.attn.add_{q,k,v}_proj``  ``double_blocks.i.txt_attn.qkv`` -- fused: rows ``[q; k; v]``
``transformer_blocks.i.attn.to_out.0``          ``double_blocks.i.img_attn.proj`` (``to_add_out``: ``txt_attn.proj``)
``transformer_blocks.i.attn.norm_q`` etc.       ``double_blocks.i.img_attn.norm.query_norm`` (parameter ``scale``)
``transformer_blocks.i.ff.linear_in / _out``    ``double_blocks.i.img_mlp.0 / .2`` (``ff_context``: ``txt_mlp``)
``single_transformer_blocks.i.attn.to_qkv_mlp_proj``  ``single_blocks.i.linear1``
``single_transformer_blocks.i.attn.to_out``     ``single_blocks.i.linear2``
``single_transformer_blocks.i.attn.norm_q/k``   ``single_blocks.i.norm.query_norm / key_norm`` (``scale``)
``proj_out``                                    ``final_layer.linear``
``norm_out.linear``                             ``final_layer.adaLN_modulation.1`` -- output halves swapped
==============================================  ==================================================================

diffusers' ``from_single_file`` reads the BFL layout (``convert_flux2_transformer_checkpoint_to_diffusers``);
:func:`flux2_diffusers_to_bfl` writes it (the tests check one against the other). :func:`flux2_slice` is the one
table, and :func:`flux2_lora_slices` places a LoRA's modules in it.

This module only needs torch; it does not import diffusers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_lora.formats.adapters import Adapter

__all__ = [
    "BFL_PREFIX_COMFY",
    "GLOBAL_MODULES",
    "BflSlice",
    "FluxDims",
    "bfl_slice",
    "bfl_to_diffusers",
    "diffusers_to_bfl",
    "flux2_diffusers_to_bfl",
    "flux2_lora_slices",
    "flux2_slice",
    "flux2_slices_of",
    "flux_dims_from_config",
    "flux_dims_from_state_dict",
    "flux_lora_dims",
    "flux_lora_slices",
    "flux_slices_of",
    "swap_halves",
]

#: Prefix of the transformer keys in ComfyUI's all-in-one checkpoints (plain ``flux1-dev.safetensors`` has none).
BFL_PREFIX_COMFY = "model.diffusion_model."


@dataclass(frozen=True)
class FluxDims:
    """The few sizes the mapping depends on.

    ``inner_dim`` is ``num_attention_heads * attention_head_dim`` (3072 for FLUX.1); ``mlp_hidden_dim`` is the width of
    a single block's MLP, ``4 * inner_dim`` in every FLUX.1 model (diffusers hard-codes ``mlp_ratio=4.0``).
    """

    inner_dim: int
    mlp_hidden_dim: int
    num_layers: int = 0
    num_single_layers: int = 0


@dataclass(frozen=True)
class BflSlice:
    """Where one diffusers module's parameters live in the BFL checkpoint.

    Attributes:
        module: the BFL module name, e.g. ``"double_blocks.3.img_attn.qkv"``.
        start: first output row (dim 0 of weight and bias) of the diffusers module inside the BFL tensor.
        size: number of output rows it owns; ``None`` when the BFL module is the diffusers module itself (not fused).
        total: number of output rows of the fused BFL tensor; ``None`` when not fused.
        swap: ``True`` for ``norm_out.linear`` -> ``final_layer.adaLN_modulation.1``, whose two output halves swap.
        weight_name: BFL's name for the ``weight`` parameter (``"scale"`` for the q/k RMSNorms).
    """

    module: str
    start: int = 0
    size: int | None = None
    total: int | None = None
    swap: bool = False
    weight_name: str = "weight"

    @property
    def fused(self) -> bool:
        """True when the BFL tensor also holds other diffusers modules' rows."""
        return self.size is not None

    def param(self, diffusers_param: str) -> str:
        """The BFL parameter key for ``diffusers_param`` (``"weight"`` or ``"bias"``) of this module."""
        return f"{self.module}.{self.weight_name if diffusers_param == 'weight' else diffusers_param}"


# diffusers module name -> BFL module name, outside the blocks.
_GLOBAL = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
GLOBAL_MODULES: tuple[str, ...] = tuple(_GLOBAL)
"""The diffusers modules of the FLUX transformer outside its blocks (``x_embedder``, ..., ``norm_out.linear``)."""
# Inside ``transformer_blocks.i`` -> ``double_blocks.i``: unfused modules.
_DOUBLE = {
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
}
# The norms and fused q/k/v of a double block, and a single block's norms: the same names in FLUX.2.
_DOUBLE_NORMS = {
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
}
# Fused: diffusers module -> (BFL module, index of the part among [q, k, v]).
_DOUBLE_QKV = {
    "attn.to_q": ("img_attn.qkv", 0),
    "attn.to_k": ("img_attn.qkv", 1),
    "attn.to_v": ("img_attn.qkv", 2),
    "attn.add_q_proj": ("txt_attn.qkv", 0),
    "attn.add_k_proj": ("txt_attn.qkv", 1),
    "attn.add_v_proj": ("txt_attn.qkv", 2),
}
# Inside ``single_transformer_blocks.i`` -> ``single_blocks.i``.
_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
_SINGLE_NORMS = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}
_SINGLE_LINEAR1 = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")  # row order inside linear1
# Modules whose LoRA input is the transformer width (``inner_dim``) and that are parts of a fused BFL layer.
_FUSED_PART = re.compile(r"(^|\.)(attn\.(to_[qkv]|add_[qkv]_proj)|proj_mlp)$")

_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def bfl_slice(module: str, dims: FluxDims) -> BflSlice:
    """Where the diffusers FLUX transformer module ``module`` (e.g. ``"transformer_blocks.3.attn.to_q"``) lives in BFL.

    Only ``dims.inner_dim`` and ``dims.mlp_hidden_dim`` are used (for the row offsets of fused modules). Raises
    ``KeyError`` for a name that is not a parameterised module of ``FluxTransformer2DModel``.

    >>> bfl_slice("single_transformer_blocks.0.proj_mlp", FluxDims(inner_dim=3072, mlp_hidden_dim=12288))
    BflSlice(module='single_blocks.0.linear1', start=9216, size=12288, total=21504, swap=False, weight_name='weight')
    """
    if module in _GLOBAL:
        return BflSlice(_GLOBAL[module], swap=module == "norm_out.linear")
    match = _BLOCK.match(module)
    if match is None:
        raise KeyError(f"not a FLUX transformer module: {module!r}")
    kind, index, rest = match.groups()
    inner = dims.inner_dim
    if kind == "transformer_blocks":
        prefix = f"double_blocks.{index}."
        if rest in _DOUBLE:
            return BflSlice(prefix + _DOUBLE[rest])
        if rest in _DOUBLE_NORMS:
            return BflSlice(prefix + _DOUBLE_NORMS[rest], weight_name="scale")
        if rest in _DOUBLE_QKV:
            target, part = _DOUBLE_QKV[rest]
            return BflSlice(prefix + target, start=part * inner, size=inner, total=3 * inner)
    else:
        prefix = f"single_blocks.{index}."
        if rest in _SINGLE:
            return BflSlice(prefix + _SINGLE[rest])
        if rest in _SINGLE_NORMS:
            return BflSlice(prefix + _SINGLE_NORMS[rest], weight_name="scale")
        if rest in _SINGLE_LINEAR1:
            part = _SINGLE_LINEAR1.index(rest)
            size = dims.mlp_hidden_dim if rest == "proj_mlp" else inner
            return BflSlice(prefix + "linear1", start=part * inner, size=size, total=3 * inner + dims.mlp_hidden_dim)
    raise KeyError(f"not a FLUX transformer module: {module!r}")


def swap_halves(tensor: Tensor) -> Tensor:
    """Swap the two halves of dim 0: ``(shift, scale)`` <-> ``(scale, shift)``. Its own inverse."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def flux_dims_from_config(config: Mapping) -> FluxDims:
    """:class:`FluxDims` from a ``FluxTransformer2DModel`` config (``model.config`` or its ``config.json``)."""
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    return FluxDims(inner, 4 * inner, int(config["num_layers"]), int(config["num_single_layers"]))


def flux_dims_from_state_dict(state_dict: Mapping[str, Tensor]) -> FluxDims:
    """:class:`FluxDims` read from the shapes of a diffusers *or* BFL FLUX transformer state dict."""
    if "x_embedder.weight" in state_dict:
        inner = state_dict["x_embedder.weight"].shape[0]
        proj_mlp = _first(state_dict, r"^single_transformer_blocks\.\d+\.proj_mlp\.weight$")
        mlp = proj_mlp.shape[0] if proj_mlp is not None else 4 * inner
        double, single = r"^transformer_blocks\.(\d+)\.", r"^single_transformer_blocks\.(\d+)\."
    else:
        state_dict = _strip_prefix(state_dict)
        inner = state_dict["img_in.weight"].shape[0]
        linear1 = _first(state_dict, r"^single_blocks\.\d+\.linear1\.weight$")
        mlp = linear1.shape[0] - 3 * inner if linear1 is not None else 4 * inner
        double, single = r"^double_blocks\.(\d+)\.", r"^single_blocks\.(\d+)\."
    return FluxDims(inner, mlp, _count(state_dict, double), _count(state_dict, single))


def diffusers_to_bfl(state_dict: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """Convert a full ``FluxTransformer2DModel`` state dict to the BFL layout (the inverse of diffusers'
    ``convert_flux_transformer_checkpoint_to_diffusers``).

    Fused tensors are concatenated in row order; ``norm_out.linear`` has its halves swapped. ``prefix`` is put in
    front of every key (``BFL_PREFIX_COMFY`` for ComfyUI's all-in-one layout). Raises ``KeyError`` on keys that are
    not FLUX transformer parameters (for example peft's ``base_layer``/``lora_A``: merge or strip LoRA first) and
    ``ValueError`` when the parts of a fused tensor are incomplete.
    """
    dims = flux_dims_from_state_dict(state_dict)
    out: dict[str, Tensor] = {}
    fused: dict[str, list[tuple[int, Tensor]]] = {}
    totals: dict[str, int] = {}
    for key, tensor in state_dict.items():
        module, _, param = key.rpartition(".")
        where = bfl_slice(module, dims)
        target = where.param(param)
        if where.fused:
            fused.setdefault(target, []).append((where.start, tensor))
            totals[target] = where.total or 0
        else:
            out[target] = swap_halves(tensor) if where.swap else tensor
    for target, parts in fused.items():
        parts.sort(key=lambda part: part[0])
        rows = 0
        for start, tensor in parts:
            if start != rows:
                raise ValueError(f"{target}: missing rows [{rows}, {start}) (an unfused part is absent)")
            rows += tensor.shape[0]
        if rows != totals[target]:
            raise ValueError(f"{target}: got {rows} rows of {totals[target]} (an unfused part is absent)")
        out[target] = torch.cat([tensor for _, tensor in parts], dim=0)
    return {prefix + key: out[key] for key in sorted(out, key=_natural)}


def bfl_to_diffusers(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Convert a BFL FLUX transformer state dict (optionally ``model.diffusion_model.``-prefixed) to diffusers keys.

    Unlike diffusers' own converter this does not assume FLUX.1's 3072 width, so it also loads tiny test models.
    """
    bfl = _strip_prefix(state_dict)
    dims = flux_dims_from_state_dict(bfl)
    names = list(_GLOBAL)
    for i in range(dims.num_layers):
        names += [f"transformer_blocks.{i}.{rest}" for rest in [*_DOUBLE, *_DOUBLE_NORMS, *_DOUBLE_QKV]]
    for i in range(dims.num_single_layers):
        names += [f"single_transformer_blocks.{i}.{rest}" for rest in [*_SINGLE, *_SINGLE_NORMS, *_SINGLE_LINEAR1]]
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for module in names:
        where = bfl_slice(module, dims)
        for param in ("weight", "bias"):
            source = where.param(param)
            if source not in bfl:
                continue  # guidance_in in schnell, bias of the RMSNorms
            tensor = bfl[source]
            if where.fused and where.size is not None:
                tensor = tensor[where.start : where.start + where.size]
            elif where.swap:
                tensor = swap_halves(tensor)
            out[f"{module}.{param}"] = tensor.clone() if where.fused else tensor
            used.add(source)
    unused = sorted(set(bfl) - used)
    if unused:
        more = "..." if len(unused) > 5 else ""
        raise KeyError(f"BFL keys that are not FLUX transformer parameters: {unused[:5]}{more}")
    return out


# --------------------------------------------------------------------------------------------- FLUX.1 LoRA


def flux_lora_dims(adapters: Mapping[str, Adapter]) -> FluxDims:
    """The :class:`FluxDims` that the fused layers of a FLUX LoRA need, read from the LoRA's own shapes.

    Every part of a fused layer takes the transformer width as input (``inner_dim``); the single blocks' MLP width is
    ``proj_mlp``'s output when it has a LoRA and FLUX.1's ``4 * inner_dim`` otherwise. A LoRA without fused parts
    needs no dims (zeros are returned).
    """
    inner = next((a.in_features for m, a in adapters.items() if _FUSED_PART.search(m)), 0)
    mlp = next((a.out_features for m, a in adapters.items() if m.endswith(".proj_mlp")), 4 * inner)
    return FluxDims(inner_dim=inner, mlp_hidden_dim=mlp)


def flux_lora_slices(adapters: Mapping[str, Adapter]) -> dict[str, BflSlice]:
    """Where each adapted module of a FLUX.1 LoRA (diffusers names) lives in BFL's layout, the fused parts' rows at the
    widths of the LoRA's own shapes (:func:`flux_lora_dims`). Raises ``ValueError`` naming a module that is not a layer
    of the FLUX transformer, a convolution, or a part whose rows differ from those widths."""
    dims = flux_lora_dims(adapters)
    slices = {}
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
        slices[module] = where
    return slices


def flux_slices_of(modules: Iterable[str]) -> dict[str, BflSlice]:
    """:func:`bfl_slice` of each of ``modules`` that is a FLUX transformer module, at unit widths (which parts share a
    fused layer, and whether they cover it, is all a name tells)."""
    slices = {}
    for module in modules:
        try:
            slices[module] = bfl_slice(module, FluxDims(1, 4))
        except KeyError:
            continue
    return slices


# --------------------------------------------------------------------------------------------- FLUX.2

_FLUX2_GLOBAL = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
_FLUX2_DOUBLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
_FLUX2_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}


def flux2_slice(module: str, inner_dim: int) -> BflSlice:
    """Where the diffusers FLUX.2 module ``module`` lives in BFL's layout (a model ``inner_dim`` wide: heads x head
    width). Raises ``KeyError`` for a name that is not a parameterised module of ``Flux2Transformer2DModel``."""
    if module in _FLUX2_GLOBAL:
        return BflSlice(_FLUX2_GLOBAL[module], swap=module == "norm_out.linear")
    match = _BLOCK.match(module)
    if match is None:
        raise KeyError(f"not a FLUX.2 transformer module: {module!r}")
    kind, index, rest = match.groups()
    if kind == "transformer_blocks":
        prefix = f"double_blocks.{index}."
        if rest in _FLUX2_DOUBLE:
            return BflSlice(prefix + _FLUX2_DOUBLE[rest])
        if rest in _DOUBLE_NORMS:
            return BflSlice(prefix + _DOUBLE_NORMS[rest], weight_name="scale")
        if rest in _DOUBLE_QKV:
            target, part = _DOUBLE_QKV[rest]
            return BflSlice(prefix + target, start=part * inner_dim, size=inner_dim, total=3 * inner_dim)
    else:
        prefix = f"single_blocks.{index}."
        if rest in _FLUX2_SINGLE:
            return BflSlice(prefix + _FLUX2_SINGLE[rest])
        if rest in _SINGLE_NORMS:
            return BflSlice(prefix + _SINGLE_NORMS[rest], weight_name="scale")
    raise KeyError(f"not a FLUX.2 transformer module: {module!r}")


def flux2_diffusers_to_bfl(state_dict: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """A full ``Flux2Transformer2DModel`` state dict in BFL's layout (the inverse of diffusers'
    ``convert_flux2_transformer_checkpoint_to_diffusers``): q/k/v concatenated in that row order, ``norm_out.linear``
    with its halves swapped, ``prefix`` in front of every key (``model.diffusion_model.`` in ComfyUI's all-in-one
    files). Raises ``KeyError`` on a key that is not a FLUX.2 transformer parameter."""
    inner = state_dict["x_embedder.weight"].shape[0]
    out: dict[str, Tensor] = {}
    fused: dict[str, dict[int, Tensor]] = {}
    for key, tensor in state_dict.items():
        module, _, param = key.rpartition(".")
        where = flux2_slice(module, inner)
        target = where.param(param)
        if where.fused:
            fused.setdefault(target, {})[where.start] = tensor
        else:
            out[target] = swap_halves(tensor) if where.swap else tensor
    for target, parts in fused.items():
        if sorted(parts) != [0, inner, 2 * inner]:
            raise ValueError(f"{target}: got rows {sorted(parts)} of q, k, v (an unfused part is absent)")
        out[target] = torch.cat([parts[start] for start in sorted(parts)], dim=0)
    return {prefix + key: value for key, value in out.items()}


def flux2_lora_slices(adapters: Mapping[str, Adapter]) -> dict[str, BflSlice]:
    """Where each adapted module of a FLUX.2 LoRA (diffusers names) lives in BFL's layout, the q/k/v parts' rows at the
    transformer width their inputs have. Raises ``ValueError`` naming a module that is not a linear layer of the
    FLUX.2 transformer."""
    at_unit = flux2_slices_of(adapters)
    inner = next((adapters[m].in_features for m, where in at_unit.items() if where.fused), 0)
    slices = {}
    for module, adapter in adapters.items():
        if module not in at_unit or (adapter.variant in ("LoRA", "DoRA") and adapter["lora_A"].ndim != 2):
            raise ValueError(
                f"{module}: not a linear layer of the FLUX.2 transformer, so it has no ComfyUI name. Export in the "
                "diffusers format instead (--format diffusers)."
            )
        slices[module] = flux2_slice(module, inner)
    return slices


def flux2_slices_of(modules: Iterable[str]) -> dict[str, BflSlice]:
    """:func:`flux2_slice` of each of ``modules`` that is a FLUX.2 transformer module, at unit width."""
    slices = {}
    for module in modules:
        try:
            slices[module] = flux2_slice(module, 1)
        except KeyError:
            continue
    return slices


def _strip_prefix(state_dict: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """Keys under ``model.diffusion_model.`` without it, if there are any (ComfyUI's all-in-one files also hold the
    VAE and text encoders under other prefixes: those are dropped); otherwise ``state_dict`` itself."""
    if any(key.startswith(BFL_PREFIX_COMFY) for key in state_dict):
        n = len(BFL_PREFIX_COMFY)
        return {key[n:]: value for key, value in state_dict.items() if key.startswith(BFL_PREFIX_COMFY)}
    return state_dict


def _first(state_dict: Mapping[str, Tensor], pattern: str) -> Tensor | None:
    regex = re.compile(pattern)
    return next((value for key, value in state_dict.items() if regex.search(key)), None)


def _count(state_dict: Mapping[str, Tensor], pattern: str) -> int:
    regex = re.compile(pattern)
    indices = {int(m.group(1)) for key in state_dict if (m := regex.search(key))}
    return max(indices) + 1 if indices else 0


def _natural(key: str) -> list[tuple[int, int, str]]:
    """Sort key that puts ``blocks.2`` before ``blocks.10``."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in key.split(".")]
