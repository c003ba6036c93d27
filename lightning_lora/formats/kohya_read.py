"""Reading kohya-layout LoRA files made elsewhere back into peft state dicts, through diffusers' own converters.

``lightning-lora export some_kohya_lora.safetensors --format diffusers`` needs the inverse of
:mod:`lightning_lora.formats.kohya`: kohya names to diffusers names, fused FLUX modules split into their parts, each
module's ``alpha / rank`` folded into its weights. diffusers already does that for ``pipe.load_lora_weights``
(``FluxLoraLoaderMixin.lora_state_dict`` -> ``_convert_kohya_flux_lora_to_diffusers``;
``StableDiffusionLoraLoaderMixin.lora_state_dict`` -> ``_maybe_map_sgm_blocks_to_diffusers`` and
``_convert_non_diffusers_lora_to_diffusers``), and using it means a converted file is what diffusers itself would
have loaded. Two gaps are closed here:

* FLUX layers outside the blocks (``img_in`` ... ``final_layer``): diffusers' converter returns them without the
  ``transformer.`` prefix (so ``load_lora_weights`` drops them) and ``final_layer`` without its alpha; they map one to
  one, so they are converted here (``final_layer.adaLN_modulation.1`` with its output halves swapped back);
* zero rank components: a fused module that is not an exact block-diagonal of equal parts comes out of diffusers'
  converter as every part holding the whole ``lora_down`` (:func:`drop_unused_ranks`).

Plain LoRA only: diffusers' converters read ``lora_down`` / ``lora_up`` / ``alpha`` (they drop ``dora_scale`` and do not
read LyCORIS' LoKr / LoHa tensors). diffusers is imported when a function runs.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from lightning_lora.formats.adapters import adapters_from_peft
from lightning_lora.formats.bfl import GLOBAL_MODULES, FluxDims, bfl_slice, swap_halves
from lightning_lora.formats.kohya import kohya_name
from lightning_lora.formats.ldm import UNetLayout

__all__ = ["drop_unused_ranks", "flux_from_kohya", "unet_from_kohya"]


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


def unet_from_kohya(tensors: Mapping[str, Tensor], layout: UNetLayout | None) -> dict[str, Tensor]:
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
