"""FLUX.2's two names for the same weights (diffusers and Black Forest Labs), and its ComfyUI LoRA layout.

Two layouts of the transformer
------------------------------
diffusers' ``Flux2Transformer2DModel`` and BFL's checkpoint (the single file ComfyUI users download, and the modules
ComfyUI builds FLUX.2 with) differ in names, and BFL fuses the double blocks' q/k/v; the single blocks are fused in
both (one input projection for q, k, v and the MLP, one output projection for both):

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
:func:`diffusers_to_bfl` writes it (the tests check one against the other). :func:`flux2_slice` is the one table.

The ComfyUI LoRA layout (``--format kohya``)
--------------------------------------------
ComfyUI's LoRA loader (``comfy/lora.py`` ``model_lora_keys_unet``) maps ``lora_unet_<module with _>`` onto every weight
of the model it built, for any model: with BFL's names that is ``lora_unet_double_blocks_0_img_attn_qkv``... The file
holds ``lora_down`` / ``lora_up`` / ``alpha`` per BFL module (LyCORIS tensors for DoRA and LoHa), the separate q/k/v
LoRAs fused exactly into one block-diagonal LoRA of rank ``3r`` (:mod:`lightning_lora.formats.kohya` explains the
algebra). diffusers reads the same file (``Flux2LoraLoaderMixin``: ``_convert_kohya_flux2_lora_to_diffusers``, which
splits a block-diagonal qkv back into rank-``r`` parts) except the modulation layers, dev's guidance embedder and the
final modulation, which it drops. A LoKr on q/k/v has no fused form: those parts are written one by one under
``lycoris_<diffusers name>``, which neither ComfyUI (as far as lightning-lora knows its FLUX.2 rules) nor diffusers
applies; export says so. kohya's sd-scripts has no FLUX.2 network.

Whether ComfyUI also maps diffusers-named FLUX.2 LoRAs (``transformer.<module>``) is not known to lightning-lora, so
:func:`flux2_coverage` reports the diffusers file as not loaded there: the kohya file is the one for ComfyUI.

This module only needs torch; it does not import diffusers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_lora.formats.adapters import Adapter, adapters_from_peft
from lightning_lora.formats.bfl import DOUBLE_NORMS, DOUBLE_QKV, SINGLE_NORMS, BflSlice, swap_halves
from lightning_lora.formats.clients import Coverage
from lightning_lora.formats.kohya import LYCORIS_PREFIX, KohyaNetwork, _fuse, adapter_to_kohya, kohya_name

__all__ = [
    "FLUX2_NETWORK",
    "diffusers_to_bfl",
    "flux2_coverage",
    "flux2_from_kohya",
    "flux2_separate_parts",
    "flux2_slice",
    "flux2_to_kohya",
]

FLUX2_NETWORK = KohyaNetwork("networks.lora_flux2", "flux2")
"""kohya metadata of a FLUX.2 file (sd-scripts has no FLUX.2 network: the names follow its FLUX.1 ones)."""

_GLOBAL = {
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
_DOUBLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
# The modules diffusers' kohya FLUX.2 converter reads (the rest it drops with a warning).
_DIFFUSERS_KOHYA = re.compile(
    r"^(transformer_blocks\.\d+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|(ff|ff_context)\.linear_(in|out))"
    r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)"
    r"|x_embedder|context_embedder|time_guidance_embed\.timestep_embedder\.linear_[12]|proj_out)$"
)
_COMFY_DORA = (
    "ComfyUI divides dora_scale by the row norms of the base weight, not of the patched one (ComfyUI PR #15458): close "
    "to the trained DoRA, not equal"
)
_DIFFUSERS_DORA = "diffusers drops dora_scale (the layer loads as a plain LoRA)"


def flux2_slice(module: str, inner_dim: int) -> BflSlice:
    """Where the diffusers FLUX.2 module ``module`` lives in BFL's layout (a model ``inner_dim`` wide: heads x head
    width). Raises ``KeyError`` for a name that is not a parameterised module of ``Flux2Transformer2DModel``."""
    if module in _GLOBAL:
        return BflSlice(_GLOBAL[module], swap=module == "norm_out.linear")
    match = _BLOCK.match(module)
    if match is None:
        raise KeyError(f"not a FLUX.2 transformer module: {module!r}")
    kind, index, rest = match.groups()
    if kind == "transformer_blocks":
        prefix = f"double_blocks.{index}."
        if rest in _DOUBLE:
            return BflSlice(prefix + _DOUBLE[rest])
        if rest in DOUBLE_NORMS:
            return BflSlice(prefix + DOUBLE_NORMS[rest], weight_name="scale")
        if rest in DOUBLE_QKV:
            target, part = DOUBLE_QKV[rest]
            return BflSlice(prefix + target, start=part * inner_dim, size=inner_dim, total=3 * inner_dim)
    else:
        prefix = f"single_blocks.{index}."
        if rest in _SINGLE:
            return BflSlice(prefix + _SINGLE[rest])
        if rest in SINGLE_NORMS:
            return BflSlice(prefix + SINGLE_NORMS[rest], weight_name="scale")
    raise KeyError(f"not a FLUX.2 transformer module: {module!r}")


def diffusers_to_bfl(state_dict: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
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


def flux2_separate_parts(variants: Mapping[str, str]) -> set[str]:
    """The parts of fused q/k/v layers (diffusers names) that have no exact fused form and are written one by one:
    every part of a fused layer with a LoKr on some part, or with DoRA on some but not all of its parts."""
    groups: dict[str, list[str]] = {}
    for module in variants:
        if _is_fused_part(module):
            groups.setdefault(flux2_slice(module, 1).module, []).append(module)
    separate: set[str] = set()
    for parts in groups.values():
        kinds = {variants[p] for p in parts}
        if "LoKr" in kinds or ("DoRA" in kinds and len(parts) < 3):
            separate.update(parts)
    return separate


def flux2_to_kohya(state: Mapping[str, Tensor], scale: float, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """A FLUX.2 transformer LoRA (peft keys without prefix or adapter name; DoRA, LoKr and LoHa tensors too) in the
    ComfyUI layout (module docstring): ``{"lora_unet_<BFL module>.<tensor>": tensor}``, every update multiplied by
    ``scale`` (peft's ``alpha / r``), weights cast to ``dtype`` when given. Raises ``ValueError`` naming a module that
    is not a linear layer of the FLUX.2 transformer."""
    adapters = adapters_from_peft(state)
    # Every q/k/v part takes the transformer width as input: the row offsets of the fused layers.
    inner = next((a.in_features for m, a in adapters.items() if _is_fused_part(m)), 0)
    groups: dict[str, list[tuple[BflSlice, str, Adapter]]] = {}
    for module, adapter in adapters.items():
        where = flux2_slice_or_none(module, inner)
        if where is None or (adapter.variant in ("LoRA", "DoRA") and adapter["lora_A"].ndim != 2):
            raise ValueError(
                f"{module}: not a linear layer of the FLUX.2 transformer, so it has no ComfyUI name. Export in the "
                "diffusers format instead (--format diffusers)."
            )
        groups.setdefault(where.module, []).append((where, module, adapter))
    separate = flux2_separate_parts({m: a.variant for m, a in adapters.items()})
    out: dict[str, Tensor] = {}
    for bfl_module, parts in groups.items():
        where, module, adapter = parts[0]
        if where.fused and module in separate:
            for _, part, part_adapter in parts:
                tensors = adapter_to_kohya(part_adapter, scale, dtype=dtype, module=part)
                out.update({f"{LYCORIS_PREFIX}{part.replace('.', '_')}.{s}": t for s, t in tensors.items()})
            continue
        if where.fused:
            tensors = _fuse(bfl_module, parts, scale, dtype)
        else:
            tensors = adapter_to_kohya(adapter, scale, dtype=dtype, swap=where.swap, module=module)
        out.update({f"{kohya_name(bfl_module)}.{suffix}": t for suffix, t in tensors.items()})
    return out


def flux2_slice_or_none(module: str, inner_dim: int) -> BflSlice | None:
    """:func:`flux2_slice`, or None for a name that is not a module of the FLUX.2 transformer."""
    try:
        return flux2_slice(module, inner_dim)
    except KeyError:
        return None


def _is_fused_part(module: str) -> bool:
    where = flux2_slice_or_none(module, 1)
    return where is not None and where.fused


def flux2_from_kohya(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A ComfyUI-layout FLUX.2 LoRA file (plain LoRA) as a peft state dict, through diffusers' own converter (which
    folds ``alpha / rank`` in and splits a block-diagonal q/k/v into its rank-``r`` parts)."""
    from diffusers.loaders import Flux2LoraLoaderMixin

    converted: dict[str, Tensor] = Flux2LoraLoaderMixin.lora_state_dict(dict(tensors))  # type: ignore[assignment]
    return {k.removeprefix("transformer."): v for k, v in converted.items()}


def flux2_coverage(format: str, variants: Mapping[str, str]) -> Coverage:
    """The :class:`~lightning_lora.formats.clients.Coverage` of a FLUX.2 LoRA file of ``format`` whose layers
    (diffusers names) have these ``variants``: see the module docstring."""
    c = Coverage()
    modules = list(variants)
    c.skip("kohya", modules, "kohya's sd-scripts has no FLUX.2 network")
    if format == "diffusers":
        c.skip(
            "ComfyUI",
            modules,
            "lightning-lora knows no ComfyUI rules for diffusers-named FLUX.2 LoRAs; the kohya-format file (BFL names) "
            "is ComfyUI's",
        )
        return c
    separate = sorted(flux2_separate_parts(variants))
    dora = [m for m, v in variants.items() if v == "DoRA" and m not in separate]
    lycoris = [m for m, v in variants.items() if v in ("LoKr", "LoHa")]
    c.skip("ComfyUI", separate, "no fused form (LoKr, or DoRA on part of q/k/v): written under per-part names")
    c.approx("ComfyUI", dora, _COMFY_DORA)
    c.skip("diffusers", lycoris, "diffusers' FLUX.2 kohya converter reads lora_down/lora_up only")
    c.skip("diffusers", [m for m in separate if m not in lycoris], "written under per-part names")
    outside = [m for m in modules if not _DIFFUSERS_KOHYA.match(m) and m not in lycoris]
    c.skip("diffusers", outside, "diffusers' kohya FLUX.2 converter drops it (modulation, guidance, final modulation)")
    c.approx("diffusers", [m for m in dora if m not in outside], _DIFFUSERS_DORA)
    return c
