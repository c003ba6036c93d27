"""Every LoRA file lightning-lora writes means the same in every tool that loads it: diffusers, ComfyUI, kohya.

For every registered family, every one of its LoRA presets and every adapter variant (LoRA, DoRA, LoKr, LoHa), a tiny
denoiser gets a peft adapter with random, non-zero values (alpha = rank / 2: a scale that is dropped or applied twice
shows), the trained weights are the model's own merged weights (peft's ``merge``), and each file in each of the
family's formats is applied by three witnesses:

* diffusers: ``pipe.load_lora_weights`` itself, on a pipeline holding the denoiser (diffusers' converters run);
* ComfyUI: :func:`comfy_apply`, its loader rebuilt from its source: the key map of ``comfy/lora.py``
  ``model_lora_keys_unet`` (``lora_unet_<original name>``; SD diffusers names via ``comfy/utils.py``
  ``unet_to_diffusers``, attention only as ``unet.<...>.processor.to_q``; FLUX diffusers names via
  ``flux_to_diffusers``, each onto its row slice of the fused weight, ``norm_out.linear`` with the scale/shift swap;
  Z-Image diffusers names via ``z_image_to_diffusers``, q/k/v onto their rows of the original fused ``qkv``;
  Qwen-Image, built with diffusers' names, under ``transformer.``, ``lycoris_`` and no prefix; FLUX.2 and Chroma,
  built with BFL's names, ComfyUI models of the FLUX kind, through FLUX's rules where they have FLUX.1's diffusers
  names; Krea 2, built with Krea's names, diffusers names via ``krea2_to_diffusers`` under four prefixes), as every
  ComfyUI release that runs the family has it (:func:`comfy_key_map`),
  the suffixes ``load_lora`` reads, and the deltas of ``comfy/weight_adapter/lora.py``, ``loha.py``, ``lokr.py`` and
  ``base.py`` ``weight_decompose`` (``alpha / mat2.shape[0]``, no alpha -> 1, LoKr's ``dim``, DoRA by axis);
* kohya's sd-scripts: :func:`kohya_apply`, ``networks/lora.py`` / ``networks/lora_flux.py``
  ``create_network_from_weights`` (dim from ``lora_down`` rows, alpha per module, modules only inside the blocks,
  ``LoRAInfModule.merge_to``), or LyCORIS' ``lycoris/kohya.py`` for DoRA/LoKr/LoHa (every module; ``wd_on_out``
  DoRA; LoKr's ``lora_dim`` from ``lokr_w1_a/lokr_w2_a``, scale 1 for two full factors; LoHa's from ``hada_w1_b``).

Each witness's merged weights are compared layer by layer with the trained ones: a layer the family's
:meth:`~lightning_lora.families.base.DiffusionFamily.lora_coverage` says a tool applies must come out exact, a layer it
says the tool skips must be untouched, and the file's ``lightning_lora.loads_in`` must name exactly the tools that
apply everything. Then: the round trip kohya -> diffusers' converter -> ours -> kohya is exact; the default output of
every shipped config has a file ComfyUI applies at the trained strength; the metadata tools read is there.
"""

from __future__ import annotations

import copy
import datetime
import inspect
import json
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import diffusers
import pytest
import torch
import yaml
from helpers import REPO, diffusers_kohya_reads_flux_widths
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from lightning_lora.callbacks.evaluation import FixedEvalLoss
from lightning_lora.callbacks.lora_export import LoraExport
from lightning_lora.data.recipe import DataRecipe
from lightning_lora.errors import ConfigError
from lightning_lora.export import convert_lora_file, export_lora, file_coverage, read_lora_file, read_metadata
from lightning_lora.families import FAMILIES, DiffusionFamily, ModelSource
from lightning_lora.formats import VARIANTS
from lightning_lora.formats.bfl import (
    FluxDims,
    bfl_slice,
    bfl_to_diffusers,
    diffusers_to_bfl,
    flux2_slice,
    flux_dims_from_state_dict,
    swap_halves,
)
from lightning_lora.formats.bfl import flux2_diffusers_to_bfl as flux2_to_bfl
from lightning_lora.formats.chroma import chroma_to_original, original_to_chroma
from lightning_lora.formats.clients import TOOLS
from lightning_lora.formats.krea2 import diffusers_to_original as krea2_to_original
from lightning_lora.formats.ldm import UNetLayout, diffusers_to_ldm
from lightning_lora.formats.nextdit import diffusers_to_original
from lightning_lora.lora import LoraOptions, parse_key, peft_config, resolve_targets

RANK, ALPHA = 4, 2.0  # alpha = rank / 2
VARIANT_NAMES = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}
CASES = [(name, preset) for name in sorted(FAMILIES) for preset in FAMILIES[name].architecture.lora_presets]
_ADAPTER = ("lora_", "lokr_", "hada_")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bases(tiny_pipeline: Callable[[str], Path]) -> dict[str, tuple[DiffusionFamily, torch.nn.Module]]:
    """Each family's tiny denoiser, frozen, float32 (copied by every test that adapts it)."""
    out = {}
    for name in sorted(FAMILIES):
        family = FAMILIES[name]()
        source = ModelSource(str(tiny_pipeline(name)), dtype=torch.float32)
        out[name] = (family, family.load_denoiser(source))
    return out


# ------------------------------------------------------------------------------------------ the trained adapter


def adapted(
    family: DiffusionFamily,
    base: torch.nn.Module,
    targets: str | list[str],
    variant: str,
    seed: int = 0,
    alpha: float = ALPHA,
) -> tuple[torch.nn.Module, LoraOptions]:
    """A copy of ``base`` with the one peft adapter training builds (:func:`lightning_lora.lora.peft_config`) for
    these options, every adapter tensor random and non-zero (DoRA's magnitude: the weight norms, scaled by 1 +- 10%)."""
    model = copy.deepcopy(base)
    options = LoraOptions(rank=RANK, alpha=alpha, targets=targets, variant=variant)  # type: ignore[arg-type]
    model.add_adapter(peft_config(options, resolve_targets(targets, family, model)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif any(part.startswith(_ADAPTER) for part in name.split(".")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval(), options


def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``model`` with its adapter merged the way peft merges it, under the base model's keys."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {
        k.replace(".base_layer", ""): v.detach().clone()
        for k, v in model.state_dict().items()
        if not any(part.startswith(_ADAPTER) for part in k.split("."))
    }


def base_weights(base: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in base.state_dict().items()}


# ------------------------------------------------------------------------------------------ diffusers


def diffusers_apply(family: DiffusionFamily, base: torch.nn.Module, file: Path) -> dict[str, torch.Tensor] | None:
    """``pipe.load_lora_weights(file)`` on a pipeline holding a copy of ``base`` (its other components None); the
    denoiser's merged weights, or None when diffusers refuses the file."""
    cls = getattr(diffusers, family.architecture.pipeline_classes[0])
    parameters = inspect.signature(cls.__init__).parameters
    components: dict[str, Any] = {n: None for n, p in parameters.items() if n != "self" and p.default is p.empty}
    components[family.architecture.denoiser_subfolder] = copy.deepcopy(base)
    pipe = cls(**components)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe.load_lora_weights(file)
    except (ValueError, KeyError) as e:
        refusals = (
            "Invalid LoRA checkpoint",
            "Incompatible keys detected",  # FLUX's kohya converter: Chroma's approximator layers
            "not found in the base model",  # Z-Image: a ComfyUI-layout LoKr file's names (peft)
            "not been correctly renamed",
            "should be empty at this point",
            "are not LyCORIS Flux2 LoKr keys",  # FLUX.2: a LoKr file with per-part and fused names
        )
        if any(refusal in str(e) for refusal in refusals):
            return None
        raise
    return merged_weights(getattr(pipe, family.architecture.denoiser_subfolder))


# ------------------------------------------------------------------------------------------ ComfyUI


def _is_flux(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "FluxTransformer2DModel"


def _is_flux2(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "Flux2Transformer2DModel"


def _is_qwenimage(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "QwenImageTransformer2DModel"


def _is_zimage(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "ZImageTransformer2DModel"


def _is_chroma(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "ChromaTransformer2DModel"


def _zimage_key_map(base: torch.nn.Module) -> dict[str, Any]:
    """ComfyUI's ``Lumina2`` branch of ``model_lora_keys_unet``: the diffusers names ``comfy/utils.py``
    ``z_image_to_diffusers`` lists, under four prefixes, each onto its original weight (q/k/v: rows of ``qkv``)."""
    dim, entries = base.config.dim, {}
    blocks = [f"{kind}.{i}" for kind in ("layers", "context_refiner", "noise_refiner") for i in range(32)]
    for block in blocks:
        for i, part in enumerate("qkv"):
            entries[f"{block}.attention.to_{part}"] = (f"{block}.attention.qkv", (0, i * dim, dim))
        entries[f"{block}.attention.to_out.0"] = (f"{block}.attention.out", None)
        for same in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaLN_modulation.0"):
            entries[f"{block}.{same}"] = (f"{block}.{same}", None)
    for diffusers_name, comfy in (
        ("all_final_layer.2-1.linear", "final_layer.linear"),
        ("all_final_layer.2-1.adaLN_modulation.1", "final_layer.adaLN_modulation.1"),
        ("all_x_embedder.2-1", "x_embedder"),
        ("cap_embedder.1", "cap_embedder.1"),
        ("t_embedder.mlp.0", "t_embedder.mlp.0"),
        ("t_embedder.mlp.2", "t_embedder.mlp.2"),
    ):
        entries[diffusers_name] = (comfy, None)
    key_map: dict[str, Any] = {}
    for name, (comfy, offset) in entries.items():
        to = (f"diffusion_model.{comfy}.weight", offset, None)
        for key in (f"diffusion_model.{name}", f"transformer.{name}", "lycoris_" + name.replace(".", "_"), name):
            key_map[key] = to
    return key_map


def _is_krea2(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "Krea2Transformer2DModel"


def _krea2_key_map(base: torch.nn.Module) -> dict[str, Any]:
    """ComfyUI's ``Krea2`` branch of ``model_lora_keys_unet``: the diffusers names ``comfy/utils.py``
    ``krea2_to_diffusers`` lists (the blocks' and the 2 + 2 text-fusion blocks' attention and SwiGLU layers, and eight
    layers around them), under four prefixes, each onto its weight in Krea's names."""
    block = {
        "attn.to_q": "attn.wq",
        "attn.to_k": "attn.wk",
        "attn.to_v": "attn.wv",
        "attn.to_gate": "attn.gate",
        "attn.to_out.0": "attn.wo",
        "attn.to_out": "attn.wo",
        "ff.gate": "mlp.gate",
        "ff.up": "mlp.up",
        "ff.down": "mlp.down",
    }
    entries = {}
    blocks = [(f"transformer_blocks.{i}", f"blocks.{i}") for i in range(base.config.num_layers)]
    blocks += [
        (f"text_fusion.{k}_blocks.{i}", f"txtfusion.{k}_blocks.{i}") for k in ("layerwise", "refiner") for i in (0, 1)
    ]
    for to, origin in blocks:
        entries.update({f"{to}.{d}": f"{origin}.{c}" for d, c in block.items()})
    entries.update(
        {
            "img_in": "first",
            "time_embed.linear_1": "tmlp.0",
            "time_embed.linear_2": "tmlp.2",
            "time_mod_proj": "tproj.1",
            "txt_in.linear_1": "txtmlp.1",
            "txt_in.linear_2": "txtmlp.3",
            "text_fusion.projector": "txtfusion.projector",
            "final_layer.linear": "last.linear",
        }
    )
    key_map: dict[str, Any] = {}
    for name, comfy in entries.items():
        for key in (f"diffusion_model.{name}", f"transformer.{name}", "lycoris_" + name.replace(".", "_"), name):
            key_map[key] = f"diffusion_model.{comfy}.weight"
    return key_map


def comfy_weights(base: torch.nn.Module) -> tuple[dict[str, torch.Tensor], Callable[[dict], dict]]:
    """The denoiser's weights as ComfyUI holds them (``diffusion_model.<original name>``: BFL for FLUX, LDM/SGM for
    the UNets) and the function back to diffusers names."""
    sd = base_weights(base)
    if _is_qwenimage(base):  # ComfyUI's Qwen-Image has diffusers' names
        return {f"diffusion_model.{k}": v for k, v in sd.items()}, lambda s: {
            k.removeprefix("diffusion_model."): v for k, v in s.items()
        }
    if _is_flux2(base):  # BFL's names; back through diffusers' own single-file converter
        from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers as back2

        bfl2 = {f"diffusion_model.{k}": v for k, v in flux2_to_bfl(sd).items()}
        return bfl2, lambda s: back2({k.removeprefix("diffusion_model."): v for k, v in s.items()})
    if _is_krea2(base):  # Krea's names; back through diffusers' own single-file converter
        from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers as krea2

        krea = {f"diffusion_model.{k}": v for k, v in krea2_to_original(sd).items()}
        return krea, lambda s: krea2({k.removeprefix("diffusion_model."): v for k, v in s.items()})
    if _is_zimage(base):  # the original names; back through diffusers' own single-file converter
        from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers as back

        original = {f"diffusion_model.{k}": v for k, v in diffusers_to_original(sd).items()}
        return original, lambda s: back({k.removeprefix("diffusion_model."): v for k, v in s.items()})
    if _is_chroma(base):  # FLUX's names without the modulation layers, and the approximator's
        original = {f"diffusion_model.{k}": v for k, v in chroma_to_original(sd).items()}
        return original, lambda s: original_to_chroma({k.removeprefix("diffusion_model."): v for k, v in s.items()})
    if _is_flux(base):
        bfl = {f"diffusion_model.{k}": v for k, v in diffusers_to_bfl(sd).items()}
        return bfl, lambda s: bfl_to_diffusers({k.removeprefix("diffusion_model."): v for k, v in s.items()})
    layout = UNetLayout.from_config(base.config)
    names = {k: "diffusion_model." + diffusers_to_ldm(k, layout) for k in sd}
    back = {v: k for k, v in names.items()}
    return {names[k]: v for k, v in sd.items()}, lambda s: {back[k]: v for k, v in s.items()}


def comfy_key_map(
    base: torch.nn.Module, model_sd: Mapping[str, torch.Tensor], every_release: bool = True
) -> dict[str, Any]:
    """ComfyUI's LoRA key map (``comfy/lora.py`` ``model_lora_keys_unet``): LoRA key prefix -> target weight, or
    ``(target, offset, function)``. ``every_release``: the rules of every ComfyUI release that runs the model (what a
    file's ``loads_in`` claims); False: the latest release's (Z-Image's and Qwen-Image's diffusers names, FLUX.2's MLP
    and single-block entries of ``flux_to_diffusers``, which came later).

    The rules, as read in ComfyUI's source: every weight ``diffusion_model.<name>.weight`` of the model as ComfyUI
    builds it is mapped from ``diffusion_model.<name>`` and ``lora_unet_<name with _>`` (generic, every model and
    release); SD UNets' diffusers names (``unet_to_diffusers``); a model of the FLUX kind (FLUX.1, FLUX.2, Chroma)
    maps FLUX.1's diffusers names under ``transformer.``, ``lycoris_`` and ``lora_transformer_`` onto the BFL weight,
    q/k/v onto their rows (``flux_to_diffusers``); Qwen-Image, since its rule came (ComfyUI PR #9208, in 0.3.50: 0.3.49
    ran Qwen-Image without it), its own (diffusers) names under three prefixes; Z-Image, since its rule came, the
    diffusers names ``z_image_to_diffusers`` lists under four prefixes."""
    key_map: dict[str, Any] = {}
    for k in model_sd:
        if k.startswith("diffusion_model.") and k.endswith(".weight"):
            key_map["lora_unet_" + k[len("diffusion_model.") : -len(".weight")].replace(".", "_")] = k
            key_map[k[: -len(".weight")]] = k
    if _is_zimage(base):
        return key_map if every_release else {**key_map, **_zimage_key_map(base)}
    if _is_krea2(base):  # comfy/lora.py: isinstance(model, Krea2), in every release that runs Krea 2
        return {**key_map, **_krea2_key_map(base)}
    if _is_qwenimage(base):  # comfy/lora.py: isinstance(model, QwenImage), since 0.3.50 (0.3.49 ran it without)
        if every_release:
            return key_map
        for k in model_sd:
            if k.startswith("diffusion_model.") and k.endswith(".weight"):
                module = k[len("diffusion_model.") : -len(".weight")]
                for key in (module, f"transformer.{module}", "lycoris_" + module.replace(".", "_")):
                    key_map[key] = k
        return key_map
    sd = base.state_dict()
    if _is_flux(base) or _is_flux2(base) or _is_chroma(base):  # comfy/utils.py flux_to_diffusers: FLUX.1's names
        inner = base.config.num_attention_heads * base.config.attention_head_dim  # unet_config's hidden_size
        dims = FluxDims(inner, flux_dims_from_state_dict(sd).mlp_hidden_dim if _is_flux(base) else 4 * inner)
        for k in sd:
            if not k.endswith(".weight"):
                continue
            module = k[: -len(".weight")]
            try:
                where = bfl_slice(module, dims)
            except KeyError:
                if every_release or not _is_flux2(base) or not _FLUX2_LATER.search(module):
                    continue
                where = flux2_slice(module, inner)  # whole weights: later releases' FLUX.2 entries
            offset = (0, where.start, where.size) if where.fused else None
            entry = ("diffusion_model." + where.param("weight"), offset, swap_halves if where.swap else None)
            for key in (
                f"transformer.{module}",
                "lycoris_" + module.replace(".", "_"),
                "lora_transformer_" + module.replace(".", "_"),
            ):
                key_map[key] = entry
        return key_map
    layout = UNetLayout.from_config(base.config)  # comfy/utils.py unet_to_diffusers
    for k in sd:
        if not k.endswith(".weight"):
            continue
        target = "diffusion_model." + diffusers_to_ldm(k, layout)
        name = k[: -len(".weight")]
        key_map["lora_unet_" + name.replace(".", "_")] = target
        key_map["lycoris_" + name.replace(".", "_")] = target
        for prefix in ("", "unet."):
            old = prefix + name.replace(".to_", ".processor.to_")
            key_map[old[:-2] if old.endswith(".to_out.0") else old] = target
    return key_map


_FLUX2_LATER = re.compile(
    r"(ff|ff_context)\.linear_(in|out)$|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)$"
)
"""The FLUX.2 diffusers names ``flux_to_diffusers`` maps in later releases only."""


def comfy_apply(
    base: torch.nn.Module, lora: Mapping[str, torch.Tensor], dora_norm: str = "base", every_release: bool = True
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """ComfyUI's loader on ``lora``: the denoiser's patched weights (diffusers names) and the keys it did not load
    ("lora key not loaded"). ``dora_norm``: ``base`` divides an output-axis ``dora_scale`` by the base weight's row
    norms (``weight_adapter/base.py`` today), ``patched`` by the patched weight's (ComfyUI PR #15458).
    ``every_release``: :func:`comfy_key_map`'s."""
    model_sd, back = comfy_weights(base)
    key_map = comfy_key_map(base, model_sd, every_release)
    patches: dict[str, list[tuple[Any, ...]]] = {}
    loaded: set[str] = set()
    for x, to in key_map.items():  # comfy/lora.py load_lora
        alpha = float(lora[f"{x}.alpha"]) if f"{x}.alpha" in lora else None
        dora = lora.get(f"{x}.dora_scale")
        found = [k for k in lora if k.startswith(x + ".")]
        if not found:
            continue
        adapter: tuple[Any, ...] | None = None
        for up, down in (("lora_up.weight", "lora_down.weight"), ("lora_B.weight", "lora_A.weight")):
            if f"{x}.{up}" in lora:
                adapter = ("lora", lora[f"{x}.{up}"], lora[f"{x}.{down}"])
                loaded |= {f"{x}.{up}", f"{x}.{down}"}
                break
        if f"{x}.hada_w1_a" in lora:
            names = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
            adapter = ("loha", *(lora.get(f"{x}.{n}") for n in names))
            loaded |= {f"{x}.{n}" for n in names if f"{x}.{n}" in lora}
        names = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
        if any(f"{x}.{n}" in lora for n in names[:4]):
            adapter = ("lokr", *(lora.get(f"{x}.{n}") for n in names))
            loaded |= {f"{x}.{n}" for n in names if f"{x}.{n}" in lora}
        if adapter is None:
            continue
        loaded |= {k for k in (f"{x}.alpha", f"{x}.dora_scale") if k in lora}
        target, offset, function = (to, None, None) if isinstance(to, str) else to
        patches.setdefault(target, []).append((adapter, alpha, dora, offset, function))
    out = {k: v.clone() for k, v in model_sd.items()}
    for target, items in patches.items():
        for adapter, alpha, dora, offset, function in items:
            weight = out[target]
            if offset is not None:
                weight = weight.narrow(offset[0], offset[1], offset[2])
            diff, scale = _comfy_diff(adapter, alpha, weight.shape)
            function = function or (lambda a: a)
            if dora is None:
                weight += function(scale * diff)
                continue
            calc = weight + function(scale * diff)  # weight_decompose
            if dora.shape[0] == calc.shape[0]:
                source = weight if dora_norm == "base" else calc
                norm = source.reshape(source.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (calc.dim() - 1))
            else:
                norm = calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1, keepdim=True)
                norm = norm.reshape(calc.shape[1], *[1] * (calc.dim() - 1)).transpose(0, 1)
            weight[:] = calc * (dora / (norm + torch.finfo(calc.dtype).eps))
    return back(out), set(lora) - loaded


def _comfy_diff(adapter: tuple[Any, ...], alpha: float | None, shape: torch.Size) -> tuple[torch.Tensor, float]:
    """(delta before scale, scale) of one ComfyUI weight adapter (``weight_adapter/{lora,loha,lokr}.py``)."""
    kind = adapter[0]
    if kind == "lora":
        up, down = adapter[1].float(), adapter[2].float()
        return (up.flatten(1) @ down.flatten(1)).reshape(shape), (alpha / down.shape[0] if alpha is not None else 1.0)
    if kind == "loha":
        w1a, w1b, w2a, w2b, t1, t2 = (t.float() if t is not None else None for t in adapter[1:])
        if t1 is not None:
            m1 = torch.einsum("i j k l, j r, i p -> p r k l", t1, w1b, w1a)
            m2 = torch.einsum("i j k l, j r, i p -> p r k l", t2, w2b, w2a)
        else:
            m1, m2 = w1a @ w1b, w2a @ w2b
        return (m1 * m2).reshape(shape), (alpha / w1b.shape[0] if alpha is not None else 1.0)
    w1, w2, w1a, w1b, w2a, w2b, t2 = (t.float() if t is not None else None for t in adapter[1:])
    dim = None
    if w1 is None:
        dim, w1 = w1b.shape[0], w1a @ w1b
    if w2 is None:
        dim = w2b.shape[0]
        w2 = torch.einsum("i j k l, j r, i p -> p r k l", t2, w2b, w2a) if t2 is not None else w2a @ w2b
    if w2.dim() == 4:
        w1 = w1.unsqueeze(2).unsqueeze(2)
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return torch.kron(w1, w2).reshape(shape), scale


# ------------------------------------------------------------------------------------------ kohya's sd-scripts


def kohya_apply(
    base: torch.nn.Module, lora: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """kohya's sd-scripts loading ``lora`` (``create_network_from_weights``, then merging each module): the patched
    weights (diffusers names) and the unexpected keys. ``ss_network_module: lycoris.kohya`` loads through LyCORIS."""
    if not any(k.startswith("lora_unet_") for k in lora):  # sd-scripts reads lora_unet_ names only
        return base_weights(base), set(lora)
    if _is_qwenimage(base) or _is_flux2(base) or _is_chroma(base) or _is_krea2(base):  # no sd-scripts network known
        return base_weights(base), set(lora)
    model_sd, back = comfy_weights(base)  # sd-scripts builds the same modules: BFL, SGM; SD1.x in diffusers names
    flux = _is_flux(base)
    sd15 = not flux and not any(k.startswith("diffusion_model.label_emb") for k in model_sd)
    diffusers_name = {v: k for k, v in back({k: k for k in model_sd}).items()} if sd15 else {}  # LDM -> diffusers
    names: dict[str, str] = {}  # lora name -> target weight key
    for k in model_sd:
        if k.endswith(".weight"):
            module = (diffusers_name[k] if sd15 else k.removeprefix("diffusion_model."))[: -len(".weight")]
            names["lora_unet_" + module.replace(".", "_")] = k
    lycoris = metadata.get("ss_network_module") == "lycoris.kohya"

    def created(lora_name: str) -> bool:
        if lycoris:  # lycoris/kohya.py: every module of the model
            return True
        body = lora_name.removeprefix("lora_unet_")
        inside = ("double_blocks_", "single_blocks_") if flux else ("down_blocks_", "mid_block_", "up_blocks_")
        if not flux and not sd15:
            inside = ("input_blocks_", "middle_block_", "output_blocks_")
            if body.startswith("input_blocks_0_0"):
                return False
        return body.startswith(inside)

    out = {k: v.clone() for k, v in model_sd.items()}
    loaded: set[str] = set()
    for lora_name, target in names.items():
        keys = [k for k in lora if k.startswith(lora_name + ".")]
        if not keys or not created(lora_name):
            continue
        loaded.update(keys)
        get = {k.split(".", 1)[1]: v.float() for k, v in lora.items() if k in keys}
        alpha = float(get["alpha"]) if "alpha" in get else None
        weight = out[target]
        if "lora_down.weight" in get:
            down, up = get["lora_down.weight"], get["lora_up.weight"]
            dim = down.shape[0]
            diff = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape) * ((alpha or dim) / dim)
        elif "hada_w1_a" in get:
            dim = get["hada_w1_b"].shape[0]  # lycoris/modules/loha.py: w1b.size(0)
            diff = ((get["hada_w1_a"] @ get["hada_w1_b"]) * (get["hada_w2_a"] @ get["hada_w2_b"])).reshape(weight.shape)
            diff = diff * ((alpha or dim) / dim)
        else:  # lycoris/modules/lokr.py make_module_from_state_dict
            w1 = get.get("lokr_w1", get["lokr_w1_a"] @ get["lokr_w1_b"] if "lokr_w1_a" in get else None)
            w2 = get.get("lokr_w2", get["lokr_w2_a"] @ get["lokr_w2_b"] if "lokr_w2_a" in get else None)
            dim = (
                get["lokr_w1_a"].shape[1]
                if "lokr_w1_a" in get
                else get["lokr_w2_a"].shape[1]
                if "lokr_w2_a" in get
                else 1
            )
            full = "lokr_w1" in get and "lokr_w2" in get
            assert w1 is not None and w2 is not None
            if w2.dim() == 4:
                w1 = w1.unsqueeze(2).unsqueeze(2)
            diff = torch.kron(w1, w2).reshape(weight.shape) * (1.0 if full else (alpha or dim) / dim)
        if "dora_scale" in get:  # LyCORIS wd_on_out: the norm of each output row of W + delta
            calc = weight + diff
            norm = calc.reshape(calc.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (calc.dim() - 1))
            out[target] = calc * get["dora_scale"] / (norm + torch.finfo(calc.dtype).eps)
        else:
            out[target] = weight + diff
    return back(out), set(lora) - loaded


def apply_tool(tool: str, family: DiffusionFamily, base: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The denoiser's weights after ``tool`` loads the file at ``path`` (which it must load)."""
    if tool == "diffusers":
        got = diffusers_apply(family, base, path)
        assert got is not None, f"diffusers refused {path.name}"
        return got
    if tool == "ComfyUI":
        return comfy_apply(base, load_file(path))[0]
    return kohya_apply(base, load_file(path), read_metadata(path))[0]


# ------------------------------------------------------------------------------------------ the comparison


def check_tool(
    tool: str,
    got: Mapping[str, torch.Tensor] | None,
    expected: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    coverage: Any,
    modules: list[str],
) -> None:
    """Layers the coverage says ``tool`` applies are the trained ones; layers it says it skips are the base ones."""
    for module in modules:
        key = f"{module}.weight"
        delta = (expected[key] - base[key]).abs().max()
        assert delta > 1e-4, f"{module}: the adapter does not change the weight (a weak test)"
        if module in coverage.approximate[tool]:
            continue
        if got is None:
            assert module in coverage.skipped[tool], f"{tool} refused the file, but {module} is said to load"
            continue
        if module in coverage.skipped[tool]:
            assert torch.equal(got[key], base[key]), f"{tool} applied {module}, said to be skipped"
            continue
        torch.testing.assert_close(
            got[key], expected[key], atol=1e-5, rtol=1e-4, msg=lambda m, t=tool, k=key: f"{t} {k}: {m}"
        )
    if got is not None:  # nothing else changed
        others = [k for k in base if k not in {f"{m}.weight" for m in modules} and k in got]
        assert all(torch.equal(got[k], base[k]) for k in others), f"{tool} changed a layer that was not trained"


@pytest.mark.parametrize("variant", list(VARIANT_NAMES))
@pytest.mark.parametrize(("name", "preset"), CASES)
def test_every_file_means_the_same_in_every_tool(
    bases: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, preset: str, variant: str
) -> None:
    family, base = bases[name]
    model, options = adapted(family, base, preset, variant)
    state = get_peft_model_state_dict(model)
    expected, before = merged_weights(model), base_weights(base)
    modules = sorted({parsed.module for k in state if (parsed := parse_key(k)) is not None})
    diffusers_kohya_reads_flux_widths(monkeypatch)
    written = 0
    for fmt in family.lora_files.formats:
        path = tmp_path / f"{fmt}.safetensors"
        if VARIANT_NAMES[variant] not in VARIANTS[fmt]:
            with pytest.raises(ConfigError, match=rf"--format {fmt}: the LoRA is a {VARIANT_NAMES[variant]} adapter"):
                export_lora(state, path, format=fmt, lora=options, family=family, info={})  # type: ignore[arg-type]
            assert not path.exists()
            continue
        export_lora(state, path, format=fmt, lora=options, family=family, info={})  # type: ignore[arg-type]
        written += 1
        coverage = file_coverage(state, family, fmt)
        assert json.loads(read_metadata(path)["lightning_lora.loads_in"]) == coverage.loads_in
        tensors, metadata = load_file(path), read_metadata(path)
        results = {
            "diffusers": diffusers_apply(family, base, path),
            "ComfyUI": comfy_apply(base, tensors)[0],
            "kohya": kohya_apply(base, tensors, metadata)[0],
        }
        for tool in TOOLS:
            check_tool(tool, results[tool], expected, before, coverage, modules)
        # The claim is ComfyUI's key map itself: claimed exactly when every key of the file is mapped (DoRA, which no
        # ComfyUI release applies as trained, is never claimed).
        if variant != "dora":
            claimed = "ComfyUI" in json.loads(metadata["lightning_lora.loads_in"])
            assert claimed == (not comfy_apply(base, tensors)[1]), f"{fmt}: ComfyUI claimed {claimed}"
        # Layers ComfyUI applies only approximately (DoRA) are exact under the fix of ComfyUI PR #15458: the file's
        # dora_scale has the right convention; only ComfyUI's norm differs today.
        if fmt == "kohya" and coverage.approximate["ComfyUI"]:
            patched = comfy_apply(base, tensors, dora_norm="patched")[0]
            for module in coverage.approximate["ComfyUI"]:
                torch.testing.assert_close(
                    patched[f"{module}.weight"], expected[f"{module}.weight"], atol=1e-5, rtol=1e-4
                )
    assert written or "kohya" not in family.lora_files.formats, "no format holds this variant"


def test_which_comfyui_releases_map_a_diffusers_file(bases: dict, tmp_path: Path) -> None:
    """The minimum versions the families' coverage names: a Z-Image (Qwen-Image) diffusers file is mapped whole by the
    ComfyUI releases that have its Z-Image (Qwen-Image) rule and not at all by the earlier ones (the ComfyUI-layout
    (kohya-layout) file by both); a FLUX.2 diffusers file's double-block attention by every release, its MLPs and single
    blocks by the later ones only, its modulation by none."""
    for name, other in (("zimage", "comfyui"), ("qwenimage", "kohya")):
        family, base = bases[name]
        model, options = adapted(family, base, "all_linear" if name == "zimage" else "attention", "lora")
        state = get_peft_model_state_dict(model)
        files = {f: tmp_path / f"{name}.{f}.safetensors" for f in ("diffusers", other)}
        for fmt, path in files.items():
            export_lora(state, path, format=fmt, lora=options, family=family, info={})  # type: ignore[arg-type]
        diffusers_file, other_file = load_file(files["diffusers"]), load_file(files[other])
        assert comfy_apply(base, diffusers_file)[1] == set(diffusers_file), name  # every release: none of it
        assert comfy_apply(base, diffusers_file, every_release=False)[1] == set(), name
        assert comfy_apply(base, other_file)[1] == set(), name
        assert "ComfyUI" not in file_coverage(state, family, "diffusers").loads_in, name

    family, base = bases["flux2"]
    linear = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)]
    targets = [n for n in linear if n.startswith(("transformer_blocks.0.", "single_transformer_blocks.0."))]
    model, options = adapted(family, base, [*targets, "double_stream_modulation_img.linear"], "lora")
    state = get_peft_model_state_dict(model)
    path = export_lora(state, tmp_path / "f.safetensors", format="diffusers", lora=options, family=family, info={})
    modules = {k.rsplit(".", 2)[0].removeprefix("transformer.") for k in load_file(path)}
    unloaded = {k.rsplit(".", 2)[0].removeprefix("transformer.") for k in comfy_apply(base, load_file(path))[1]}
    later = {
        k.rsplit(".", 2)[0].removeprefix("transformer.")
        for k in comfy_apply(base, load_file(path), every_release=False)[1]
    }
    attention = {m for m in modules if ".attn." in m and not m.startswith("single")}
    assert attention and not attention & unloaded and unloaded - attention == modules - attention
    assert later and all("modulation" in m for m in later)
    assert set(file_coverage(state, family, "diffusers").skipped["ComfyUI"]) == unloaded


def test_comfyui_skips_peft_attention_names_of_a_unet(bases: dict, tmp_path: Path) -> None:
    """The issue as measured: a diffusers-layout SD1.5 LoCon file leaves ComfyUI 2 keys per attention layer unloaded,
    and our coverage says so (the kohya file of the same LoRA loads every key)."""
    family, base = bases["sd15"]
    model, options = adapted(family, base, "locon", "lora")
    state = get_peft_model_state_dict(model)
    attention = {k.rsplit(".", 2)[0] for k in state if ".to_" in k}
    paths = {
        f: export_lora(state, tmp_path / f"{f}.safetensors", format=f, lora=options, family=family, info={})
        for f in ("diffusers", "kohya")
    }
    _, not_loaded = comfy_apply(base, load_file(paths["diffusers"]))
    assert {k.removeprefix("unet.").rsplit(".", 2)[0] for k in not_loaded} == attention and len(not_loaded) == 2 * len(
        attention
    )
    assert set(file_coverage(state, family, "diffusers").skipped["ComfyUI"]) == attention
    assert comfy_apply(base, load_file(paths["kohya"]))[1] == set()


# ------------------------------------------------------------------------------------------ round trips


def writes_kohya(name: str) -> None:
    """Skip a test of the kohya layout for a family that writes none (Z-Image: ComfyUI reads its diffusers files;
    tests/families/test_zimage.py checks their metadata)."""
    if "kohya" not in FAMILIES[name].lora_files.formats:
        pytest.skip(f"the {name} family writes no kohya layout")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_kohya_to_diffusers_to_kohya_is_exact(
    bases: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    writes_kohya(name)
    """A kohya file (ours, every preset's layers, alpha != rank) -> diffusers' own converter -> ours -> kohya: the
    same weights in every tool each file names (to float32 rounding); and diffusers -> kohya -> diffusers the same
    tensors."""
    family, base = bases[name]
    targets = "|".join(f"(?:{p})" for p in family.architecture.lora_presets.values())
    model, options = adapted(family, base, targets, "lora", seed=3)
    state = get_peft_model_state_dict(model)
    diffusers_kohya_reads_flux_widths(monkeypatch)
    first = export_lora(state, tmp_path / "a.kohya.safetensors", format="kohya", lora=options, family=family, info={})
    as_diffusers = convert_lora_file(first, tmp_path / "b.safetensors", format="diffusers")
    again = convert_lora_file(as_diffusers, tmp_path / "c.kohya.safetensors", format="kohya")
    assert read_metadata(as_diffusers)["lightning_lora.converted_from"] == "a.kohya.safetensors"
    expected = merged_weights(model)
    for path in (first, as_diffusers, again):  # each file, in every tool it says applies all of it
        tools = json.loads(read_metadata(path)["lightning_lora.loads_in"])
        assert "ComfyUI" in tools or "diffusers" in tools
        for tool in tools:
            got = apply_tool(tool, family, base, path)
            for key, value in expected.items():
                torch.testing.assert_close(
                    got[key],
                    value,
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m, p=path, k=key, t=tool: f"{p.name} in {t}: {k}: {m}",
                )
    a, c = load_file(first), load_file(again)
    deltas = lambda t: {k.rsplit(".", 2)[0] for k in t}  # noqa: E731
    assert deltas(a) == deltas(c)
    lora = read_lora_file(again)
    assert lora.family.name == name and lora.layout == "kohya"
    back = convert_lora_file(again, tmp_path / "d.safetensors", format="diffusers")
    one, two = load_file(as_diffusers), load_file(back)
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(one[key], two[key], atol=1e-6, rtol=1e-6)


def test_converting_a_fused_flux_file_gives_back_the_trained_adapters(
    bases: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """diffusers' converter turns a fused linear1 with only q/k/v trained into four dense adapters (each part the
    whole 3r-row lora_down, and a zero proj_mlp); the conversion drops the zero rank components: the trained
    adapters come back, rank r each, no proj_mlp."""
    family, base = bases["flux"]
    model, options = adapted(family, base, "attention", "lora")
    state = get_peft_model_state_dict(model)
    diffusers_kohya_reads_flux_widths(monkeypatch)
    kohya_file = export_lora(state, tmp_path / "k.safetensors", format="kohya", lora=options, family=family, info={})
    back = read_lora_file(kohya_file)
    assert {k.rsplit(".", 2)[0] for k in back.state} == {k.rsplit(".", 2)[0] for k in state}
    assert all(t.shape[0] == RANK for k, t in back.state.items() if k.endswith("lora_A.weight"))


def test_a_kohya_file_made_by_sd_scripts_converts_exactly(bases: dict, tmp_path: Path) -> None:
    """A kohya file as sd-scripts writes one (per-module alphas that differ, a LoCon conv layer, no metadata):
    converted to diffusers and back it applies the same weights in ComfyUI and in diffusers."""
    family, base = bases["sdxl"]
    g = torch.Generator().manual_seed(5)
    sd = base.state_dict()
    layout = UNetLayout.from_config(base.config)
    tensors = {}
    for i, module in enumerate(
        [
            "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
            "down_blocks.0.resnets.0.conv1",
            "up_blocks.0.attentions.0.proj_out",
        ]
    ):
        w = sd[f"{module}.weight"]
        r = 2 + i
        name = "lora_unet_" + diffusers_to_ldm(module, layout).replace(".", "_")
        tensors[f"{name}.lora_down.weight"] = 0.3 * torch.randn(r, *w.shape[1:], generator=g)
        tensors[f"{name}.lora_up.weight"] = 0.3 * torch.randn(w.shape[0], r, *([1] * (w.dim() - 2)), generator=g)
        tensors[f"{name}.alpha"] = torch.tensor(float(i + 1))
    save_file(tensors, tmp_path / "theirs.safetensors")
    reference, _ = comfy_apply(base, tensors)
    converted = convert_lora_file(
        tmp_path / "theirs.safetensors", tmp_path / "ours.safetensors", format="diffusers", family=family
    )
    from_diffusers = diffusers_apply(family, base, converted)
    back = convert_lora_file(converted, tmp_path / "back.kohya.safetensors", format="kohya")
    assert from_diffusers is not None
    from_back, unloaded = comfy_apply(base, load_file(back))
    assert not unloaded
    for key in reference:
        torch.testing.assert_close(from_diffusers[key], reference[key], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(from_back[key], reference[key], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ FLUX: exact and compact


def test_flux_diffusers_file_is_the_compact_exact_comfyui_file(bases: dict, tmp_path: Path) -> None:
    """For FLUX, ComfyUI maps every diffusers name onto its rows of the fused weight: the diffusers file applies
    exactly there, and is a fraction of the fused kohya file (whose linear1 lora_up has all 3 inner + mlp rows)."""
    family, base = bases["flux"]
    model, options = adapted(family, base, "attention", "lora")
    state = get_peft_model_state_dict(model)
    paths = {
        f: export_lora(state, tmp_path / f"{f}.safetensors", format=f, lora=options, family=family, info={})
        for f in ("diffusers", "kohya")
    }
    assert "ComfyUI" in json.loads(read_metadata(paths["diffusers"])["lightning_lora.loads_in"])
    got, unloaded = comfy_apply(base, load_file(paths["diffusers"]))
    assert not unloaded
    expected = merged_weights(model)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-4)
    size = {f: sum(t.numel() for t in load_file(p).values()) for f, p in paths.items()}
    assert size["kohya"] > 2 * size["diffusers"]
    meta = read_metadata(paths["kohya"])
    ranks = json.loads(meta["lightning_lora.module_ranks"])
    assert (
        ranks["lora_unet_double_blocks_0_img_attn_qkv"] == 3 * RANK
        and ranks["lora_unet_single_blocks_0_linear1"] == 3 * RANK
    )
    assert meta["ss_network_dim"] == str(RANK)


def test_flux_lokr_on_fused_parts_goes_per_part(bases: dict, tmp_path: Path) -> None:
    """A LoKr on q/k/v has no fused form: the kohya file holds those parts under ComfyUI's per-part lycoris_ names
    (ComfyUI applies them exactly, checked above), and export says sd-scripts will not load them."""
    family, base = bases["flux"]
    model, options = adapted(family, base, "attention", "lokr")
    state = get_peft_model_state_dict(model)
    path = export_lora(state, tmp_path / "k.safetensors", format="kohya", lora=options, family=family, info={})
    keys = load_file(path)
    assert any(k.startswith("lycoris_transformer_blocks_0_attn_to_q.lokr_") for k in keys)
    assert not any("img_attn_qkv" in k for k in keys)
    coverage = file_coverage(state, family, "kohya")
    assert "transformer_blocks.0.attn.to_q" in coverage.skipped["kohya"] and coverage.loads_in == ["ComfyUI"]
    assert any("per-part" in line for line in coverage.notes())


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_custom_targets_outside_the_blocks_are_named(bases: dict, tmp_path: Path, name: str) -> None:
    writes_kohya(name)
    """Layers outside the blocks load in ComfyUI, not in sd-scripts (nor, for FLUX kohya files, in diffusers), and
    export says which tool skips which layer."""
    family, base = bases[name]
    outside = {
        "flux": ["x_embedder", "norm_out.linear"],
        "flux_kontext": ["x_embedder", "norm_out.linear"],  # FLUX.1's transformer
        "flux2": ["x_embedder", "norm_out.linear"],
        "qwenimage": ["img_in", "norm_out.linear"],
        "qwenimage_edit": ["img_in", "norm_out.linear"],  # Qwen-Image's transformer
        "qwenimage_edit_plus": ["img_in", "norm_out.linear"],
    }.get(name, ["conv_in", "time_embedding.linear_1"])
    model, options = adapted(family, base, outside, "lora")
    state = get_peft_model_state_dict(model)
    coverage = file_coverage(state, family, "kohya")
    layers = {k.rsplit(".", 2)[0] for k in state}
    assert set(coverage.skipped["kohya"]) == layers and coverage.exact("ComfyUI")
    notes = "\n".join(coverage.notes("k.safetensors"))
    assert "kohya does not load 2 layer(s) of k.safetensors" in notes
    path = export_lora(state, tmp_path / "k.safetensors", format="kohya", lora=options, family=family, info={})
    assert json.loads(read_metadata(path)["lightning_lora.loads_in"]) == (
        ["ComfyUI"]
        if name in ("flux", "flux_kontext", "flux2")
        else ["diffusers", "ComfyUI"]  # converters drop norm_out
    )


def test_lokr_and_loha_are_refused_by_the_diffusers_format_with_the_reason(bases: dict, tmp_path: Path) -> None:
    family, base = bases["sdxl"]
    for variant in ("lokr", "loha"):
        model, options = adapted(family, base, "attention", variant)
        state = get_peft_model_state_dict(model)
        with pytest.raises(ConfigError, match=r"holds LoRA and DoRA only.*Export it with --format kohya"):
            export_lora(state, tmp_path / "d.safetensors", format="diffusers", lora=options, family=family, info={})  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ metadata


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_metadata_tools_read(bases: dict, tmp_path: Path, name: str) -> None:
    writes_kohya(name)
    family, base = bases[name]
    preset = "locon" if "locon" in family.architecture.lora_presets else "attention"
    model, options = adapted(family, base, preset, "lora")
    state = get_peft_model_state_dict(model)
    info = {"resolution": 768, "trigger": "sks dog", "title": "my-lora", "steps": 12}
    kohya = read_metadata(
        export_lora(
            state, tmp_path / "my-lora.kohya.safetensors", format="kohya", lora=options, family=family, info=info
        )
    )
    ours = read_metadata(
        export_lora(state, tmp_path / "my-lora.safetensors", format="diffusers", lora=options, family=family, info=info)
    )
    for meta in (kohya, ours):
        assert meta["modelspec.architecture"] == family.lora_files.modelspec["architecture"]
        assert meta["modelspec.implementation"] == family.lora_files.modelspec["implementation"]
        assert meta["modelspec.title"] == "my-lora" and meta["modelspec.resolution"] == "768x768"
        assert meta["modelspec.trigger_phrase"] == "sks dog" and meta["modelspec.sai_model_spec"] == "1.0.1"
        assert datetime.datetime.fromisoformat(meta["modelspec.date"]).date() == datetime.date.today()
        assert (meta["lightning_lora.rank"], meta["lightning_lora.alpha"]) == (str(RANK), str(ALPHA))
        assert meta["lightning_lora.variant"] == "LoRA" and meta["lightning_lora.trigger"] == "sks dog"
    assert kohya["ss_output_name"] == "my-lora" and kohya["ss_network_dim"] == str(RANK)
    assert float(kohya["ss_network_alpha"]) == ALPHA
    networks = {  # musubi-tuner's for Qwen; FLUX.2 has none in sd-scripts (its names follow FLUX.1's network)
        "flux": "networks.lora_flux",
        "flux_kontext": "networks.lora_flux",
        "flux2": "networks.lora_flux2",
        "qwenimage": "networks.lora_qwen_image",
        "qwenimage_edit": "networks.lora_qwen_image",
        "qwenimage_edit_plus": "networks.lora_qwen_image",
    }
    assert kohya["ss_network_module"] == networks.get(name, "networks.lora")
    args = json.loads(kohya.get("ss_network_args", "{}"))
    assert args == ({"conv_dim": str(RANK), "conv_alpha": str(ALPHA)} if preset == "locon" else {})
    assert "lora_adapter_metadata" not in kohya and not any(k.startswith("ss_") for k in ours)
    adapter = json.loads(ours["lora_adapter_metadata"])
    prefix = family.architecture.denoiser_subfolder
    assert adapter[f"{prefix}.r"] == RANK and adapter[f"{prefix}.lora_alpha"] == RANK  # the scale is in lora_B


def test_variant_metadata_names_lycoris(bases: dict, tmp_path: Path) -> None:
    family, base = bases["sd15"]
    for variant, args in (
        ("dora", {"algo": "lora", "dora_wd": "True", "wd_on_output": "True"}),
        ("lokr", {"algo": "lokr", "factor": "-1"}),
        ("loha", {"algo": "loha"}),
    ):
        model, options = adapted(family, base, "attention", variant)
        state = get_peft_model_state_dict(model)
        meta = read_metadata(
            export_lora(
                state, tmp_path / f"{variant}.safetensors", format="kohya", lora=options, family=family, info={}
            )
        )
        assert meta["ss_network_module"] == "lycoris.kohya" and json.loads(meta["ss_network_args"]) == args
        assert meta["lightning_lora.variant"] == VARIANT_NAMES[variant]


# ------------------------------------------------------------------------------------------ what a run writes


SHIPPED = sorted(p for p in (REPO / "configs").glob("*.yaml") if "LoraExport" in p.read_text() and "tiny" not in p.name)


@pytest.mark.parametrize("config", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_default_output_of_a_shipped_config_loads_in_comfyui(bases: dict, tmp_path: Path, config: Path) -> None:
    """The files the shipped config's LoraExport writes (its own options, its LoRA rank/alpha/targets, on the tiny
    model of its family): one of them is applied by ComfyUI at the trained strength, and the final line says which."""
    data = yaml.safe_load(config.read_text())
    model_section = data["model"]
    family_path = (model_section.get("family") or {}).get("class_path", "lightning_lora.families.Flux")
    name = next(n for n, c in FAMILIES.items() if family_path.endswith(c.__qualname__))
    family, base = bases[name]
    lora = model_section["lora"]
    export_args = next(
        cb["init_args"] for cb in data["trainer"]["callbacks"] if cb["class_path"].endswith("LoraExport")
    )
    alpha = RANK * lora["alpha"] / lora["rank"]  # the config's alpha / rank, on the tiny model's rank
    model, options = adapted(family, base, lora["targets"], lora.get("variant", "lora"), alpha=alpha)
    callback = LoraExport(**export_args)
    module = SimpleNamespace(family=family, lora=options, denoiser=model, source=ModelSource("tiny"))
    trainer = SimpleNamespace(
        default_root_dir=str(tmp_path),
        global_step=7,
        is_global_zero=True,
        datamodule=SimpleNamespace(recipe=DataRecipe(resolutions=(1024,))),
        strategy=SimpleNamespace(barrier=lambda name: None),
        callbacks=[FixedEvalLoss(), callback],  # the shipped configs' evaluation judges their best LoRA
    )
    callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    callback.on_fit_start(trainer, module)  # type: ignore[arg-type]
    callback.export(trainer, module, callback.name)  # type: ignore[arg-type]
    files = dict(zip(callback.formats, callback.written, strict=True))
    assert set(files) == set(family.lora_files.formats)
    comfy = [f for f, p in files.items() if "ComfyUI" in json.loads(read_metadata(p)["lightning_lora.loads_in"])]
    assert comfy, f"no file for ComfyUI among {files}"
    expected, before = merged_weights(model), base_weights(base)
    for fmt in comfy:
        got, unloaded = comfy_apply(base, load_file(files[fmt]))
        assert not unloaded
        for key in expected:  # bf16 files: the trained strength within bf16 rounding
            delta = (expected[key] - before[key]).abs().max()
            assert (got[key] - expected[key]).abs().max() <= 0.02 * delta + 1e-6, (fmt, key)
    assert any("ComfyUI" in line for line in callback.summary_lines())


def _stub_run(tmp_path: Path, family: DiffusionFamily, model: torch.nn.Module, options: LoraOptions) -> tuple[Any, Any]:
    module = SimpleNamespace(family=family, lora=options, denoiser=model, source=ModelSource("tiny"))
    trainer = SimpleNamespace(
        default_root_dir=str(tmp_path),
        global_step=3,
        is_global_zero=True,
        datamodule=SimpleNamespace(recipe=DataRecipe(resolutions=(64,))),
        strategy=SimpleNamespace(barrier=lambda name: None),
    )
    return trainer, module


def test_a_run_writes_the_formats_that_hold_its_variant(bases: dict, tmp_path: Path) -> None:
    """By default a LoKr run writes only the kohya file (diffusers cannot load LoKr) and says so before training;
    asking for the diffusers format by name stops the run at setup, naming the variant."""
    family, base = bases["sd15"]
    model, options = adapted(family, base, "attention", "lokr")
    trainer, module = _stub_run(tmp_path, family, model, options)
    callback = LoraExport()
    callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match=r"LoraExport: diffusers will not apply \d+ trained layer\(s\) .* from any"):
        callback.on_fit_start(trainer, module)  # type: ignore[arg-type]
    assert callback.formats == ["kohya"] and callback.loads_in == {"kohya": ["ComfyUI", "kohya"]}
    callback.export(trainer, module, "lora")  # type: ignore[arg-type]
    assert [p.name for p in callback.written] == ["lora.kohya.safetensors"]
    with pytest.raises(ConfigError, match=r"LoraExport\.formats: a diffusers file cannot hold a LoKr adapter"):
        LoraExport(formats=["diffusers"]).setup(trainer, module, "fit")  # type: ignore[arg-type]


def test_a_run_warns_before_training_about_layers_no_file_brings_to_a_tool(bases: dict, tmp_path: Path) -> None:
    family, base = bases["sdxl"]
    model, options = adapted(family, base, ["conv_in", "to_q"], "lora")
    trainer, module = _stub_run(tmp_path, family, model, options)
    callback = LoraExport()
    callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match=r"kohya's sd-scripts will not apply 1 trained layer\(s\) .*\(conv_in\)"):
        callback.on_fit_start(trainer, module)  # type: ignore[arg-type]
    assert callback.loads_in == {"diffusers": ["diffusers"], "kohya": ["diffusers", "ComfyUI"]}


@pytest.mark.parametrize("name", ["zimage", "qwenimage", "flux2", "krea2"])
def test_a_tool_without_support_for_the_family_is_no_warning(bases: dict, tmp_path: Path, name: str, caplog) -> None:
    """sd-scripts has no Z-Image, Qwen-Image, FLUX.2 or Krea 2 network: every run would warn that it loads nothing.
    That is a fact of the family (logged once), not a warning about the run; the written files still say where they
    load."""
    family, base = bases[name]
    model, options = adapted(family, base, "attention", "lora")
    trainer, module = _stub_run(tmp_path, family, model, options)
    callback = LoraExport()
    callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level("INFO", logger="lightning_lora.callbacks.lora_export"):
            callback.on_fit_start(trainer, module)  # type: ignore[arg-type]
    assert f"kohya's sd-scripts does not load {name} LoRAs" in caplog.text
    assert all("kohya" not in tools for tools in callback.loads_in.values())
    assert any("ComfyUI" in tools for tools in callback.loads_in.values())
