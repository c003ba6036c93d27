"""Which layers of a LoRA file each tool applies, by the key rules of its loader.

A LoRA file is only as good as what the tools that read it make of it, and they differ: a file can load without an
error and apply nothing, or apply some layers and skip others with a log line nobody reads. This module writes down,
per family and layout, what each of three loaders does with each adapted layer, so that export can say it
(``lightning-lora export`` and the training run's ``LoraExport`` print it, and the file's ``lightning_lora.loads_in``
records the tools that apply every layer exactly). The rules, with where each comes from:

ComfyUI (``comfy/lora.py`` ``model_lora_keys_unet`` builds a map from LoRA key prefixes to model weights;
``load_lora`` reads ``<prefix>.lora_up.weight`` / ``.lora_B.weight`` / ``.lokr_w1`` / ``.hada_w1_a``..., ``.alpha`` and
``.dora_scale``; anything else is logged "lora key not loaded" and ignored):

* every weight of the model as ComfyUI builds it, under ``lora_unet_<name with _>``: FLUX in BFL names, SDXL and SD1.x
  in the original (LDM/SGM) names; and, through ``comfy/utils.py`` ``unet_to_diffusers``, SD UNets' diffusers names as
  ``lora_unet_<name with _>`` too (so sd-scripts' SD1.x names load);
* diffusers names with a ``unet.`` prefix only in the *old attention-processor* spelling: ``...attn1.processor.to_q``
  and ``...attn1.processor.to_out`` (``.to_`` replaced by ``.processor.to_``, ``to_out.0`` by ``to_out``). peft's
  ``unet.<...>.attn1.to_q.lora_A.weight`` is not in the map: a diffusers-layout SD/SDXL file loses every attention
  layer there (the convolutions, ``proj_in/out`` and feed-forward layers load);
* FLUX diffusers names under ``transformer.`` (and ``lycoris_``, ``lora_transformer_``), each mapped by
  ``comfy/utils.py`` ``flux_to_diffusers`` to its *row slice* of the fused BFL weight (``to_k`` -> ``(img_attn.qkv, 0,
  hidden, hidden)``), ``norm_out.linear`` with the scale/shift swap: a diffusers-layout FLUX file loads exactly, part
  by part;
* Qwen-Image (``isinstance(model, QwenImage)``), whose modules ComfyUI names as diffusers does: ``transformer.<module>``
  (a diffusers-layout file), ``<module>`` and ``lycoris_<module with _>``, each onto the whole weight; with the
  generic ``lora_unet_<module with _>``, a kohya/musubi-tuner file loads too, LyCORIS tensors included;
* DoRA: only ``dora_scale`` is read (``weight_adapter/base.py`` ``weight_decompose``), never peft's
  ``lora_magnitude_vector``; for an output-axis ``dora_scale`` it divides by the row norms of the base weight instead
  of the patched one (ComfyUI PR #15458), so a DoRA file applies close to, not exactly, the trained weights.

diffusers 0.42 (``pipe.load_lora_weights``, ``loaders/lora_pipeline.py`` and ``loaders/lora_conversion_utils.py``):

* its own layout: every LoRA and DoRA layer; LoKr and LoHa files are refused ("Invalid LoRA checkpoint");
* kohya FLUX files (``_convert_kohya_flux_lora_to_diffusers``): the block layers; ``img_in``, ``txt_in``,
  ``time_in``, ``vector_in``, ``guidance_in`` and ``final_layer`` are converted to keys without the ``transformer.``
  prefix and silently not loaded. It also hard-codes FLUX.1's widths (``dims=[3072, 3072, 3072, 12288]``);
* kohya SD/SDXL files (``_convert_non_diffusers_lora_to_diffusers``): every LoRA layer;
* kohya Qwen-Image files (``_convert_non_diffusers_qwen_lora_to_diffusers``): every LoRA layer (``alpha / rank``
  folded in); a file with LyCORIS tensors is refused as a whole ("`state_dict` should be empty at this point");
* ``dora_scale`` is filtered out with a warning (the layer loads as a plain LoRA); LoKr / LoHa tensors are not read.

kohya's sd-scripts (``create_network_from_weights``, then ``load_state_dict``: unknown keys are reported as unexpected
and skipped):

* ``networks/lora.py`` (SD, SDXL) creates LoRA modules only inside ``Transformer2DModel``, ``ResnetBlock2D``,
  ``Downsample2D`` and ``Upsample2D``: ``conv_in``, ``conv_out``, ``time_embedding`` and ``add_embedding`` are not
  loaded;
* ``networks/lora_flux.py`` creates them inside the double and single blocks (outside only with ``in_dims`` network
  args, which a file does not carry): ``img_in``, ``txt_in``, ``time_in``, ``vector_in``, ``guidance_in`` and
  ``final_layer`` are not loaded;
* neither has DoRA, LoKr or LoHa: those load through LyCORIS (``--network_module lycoris.kohya``,
  ``lycoris/kohya.py`` ``create_network_from_weights``), which makes a module for every ``lora_unet_<name>`` that is a
  module of the model;
* it reads only ``lora_unet_`` names: a diffusers-layout file loads nothing.
* it has no Qwen-Image network (kohya's musubi-tuner trains Qwen-Image: ``networks.lora_qwen_image``, whose
  ``lora_unet_<diffusers module with _>`` names the kohya layout of this family uses).

:class:`Coverage` is the answer for one file: per tool, the layers it skips and the layers it applies only
not as trained, each with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["TOOLS", "Coverage", "flux_coverage", "qwenimage_coverage", "unet_coverage"]

TOOLS = ("diffusers", "ComfyUI", "kohya")
"""The loaders :class:`Coverage` speaks for: diffusers' ``load_lora_weights``, ComfyUI's LoRA loader, kohya's sd-scripts
(with LyCORIS for DoRA, LoKr, LoHa)."""

_FLUX_GLOBAL = re.compile(r"^(x_embedder|context_embedder|time_text_embed\..+|proj_out|norm_out\.linear)$")
_UNET_OUTSIDE_BLOCKS = re.compile(r"^(conv_in|conv_out|time_embedding\..+|add_embedding\..+|class_embedding\..+)$")
_UNET_ATTENTION = re.compile(r"\.to_(q|k|v|out\.0)$")

_COMFY_DORA = "ComfyUI divides an output-axis dora_scale by the base weight's row norms, not the patched weight's"
_DIFFUSERS_DORA = "diffusers drops kohya files' dora_scale (the layer loads as a plain LoRA)"
_COMFY_PEFT_DORA = "ComfyUI reads dora_scale, not peft's lora_magnitude_vector (the layer loads as a plain LoRA)"


@dataclass
class Coverage:
    """What each tool (:data:`TOOLS`) makes of one LoRA file."""

    skipped: dict[str, dict[str, str]] = field(default_factory=lambda: {t: {} for t in TOOLS})
    """Tool -> {layer (diffusers name): why it is not applied}."""
    approximate: dict[str, dict[str, str]] = field(default_factory=lambda: {t: {} for t in TOOLS})
    """Tool -> {layer: why it is applied, but not as trained (close, or without its DoRA magnitude)}."""

    def skip(self, tool: str, modules: Iterable[str], why: str) -> None:
        for module in modules:
            self.skipped[tool].setdefault(module, why)

    def approx(self, tool: str, modules: Iterable[str], why: str) -> None:
        for module in modules:
            if module not in self.skipped[tool]:
                self.approximate[tool].setdefault(module, why)

    def exact(self, tool: str) -> bool:
        """Whether ``tool`` applies every layer of the file as trained."""
        return not self.skipped[tool] and not self.approximate[tool]

    @property
    def loads_in(self) -> list[str]:
        """The tools that apply every layer exactly."""
        return [t for t in TOOLS if self.exact(t)]

    def notes(self, file: str = "this file") -> list[str]:
        """One line per tool that skips or approximates layers: how many, a few names, and why."""
        lines = []
        for tool in TOOLS:
            for what, found in (
                ("does not load", self.skipped[tool]),
                ("does not apply as trained", self.approximate[tool]),
            ):
                if not found:
                    continue
                reasons: dict[str, list[str]] = {}
                for module, why in found.items():
                    reasons.setdefault(why, []).append(module)
                for why, modules in reasons.items():
                    names = ", ".join(modules[:3]) + (", ..." if len(modules) > 3 else "")
                    lines.append(f"{tool} {what} {len(modules)} layer(s) of {file} ({names}): {why}")
        return lines


def flux_coverage(format: str, variants: Mapping[str, str]) -> Coverage:
    """The :class:`Coverage` of a FLUX LoRA file of ``format`` whose layers (diffusers names) have these
    ``variants`` (``{module: "LoRA" | "DoRA" | "LoKr" | "LoHa"}``)."""
    c = Coverage()
    modules = list(variants)
    outside = [m for m in modules if _FLUX_GLOBAL.match(m)]
    dora = [m for m, v in variants.items() if v == "DoRA"]
    lycoris = [m for m, v in variants.items() if v in ("LoKr", "LoHa")]
    if format == "diffusers":
        c.approx("ComfyUI", dora, _COMFY_PEFT_DORA)
        c.skip("kohya", modules, "sd-scripts reads lora_unet_<BFL module> keys, not diffusers names")
        return c
    from lightning_lora.formats.kohya import flux_separate_parts

    separate = sorted(flux_separate_parts(variants))
    c.skip("diffusers", lycoris, "diffusers' kohya converter reads lora_down/lora_up only")
    c.skip("diffusers", separate, "diffusers' kohya converter reads lora_unet_ keys only")
    c.skip(
        "kohya", separate, "no fused form (LoKr, or DoRA on part of q/k/v/mlp): written under ComfyUI's per-part names"
    )
    c.skip("diffusers", outside, "diffusers' kohya FLUX converter drops the layers outside the blocks")
    c.approx("diffusers", dora, _DIFFUSERS_DORA)
    c.approx("ComfyUI", dora, _COMFY_DORA)
    plain = [m for m in outside if variants[m] == "LoRA"]  # DoRA/LoKr/LoHa load through LyCORIS: every module
    c.skip("kohya", plain, "networks/lora_flux.py makes LoRA modules inside the double/single blocks only")
    return c


def unet_coverage(format: str, variants: Mapping[str, str]) -> Coverage:
    """The :class:`Coverage` of an SDXL or SD1.x UNet LoRA file of ``format`` (see :func:`flux_coverage`)."""
    c = Coverage()
    modules = list(variants)
    dora = [m for m, v in variants.items() if v == "DoRA"]
    lycoris = [m for m, v in variants.items() if v in ("LoKr", "LoHa")]
    if format == "diffusers":
        c.skip(
            "ComfyUI",
            [m for m in modules if _UNET_ATTENTION.search(m)],
            "ComfyUI maps diffusers attention layers only in the old '.processor.to_q' spelling",
        )
        c.approx("ComfyUI", dora, _COMFY_PEFT_DORA)
        c.skip("kohya", modules, "sd-scripts reads lora_unet_<module> keys, not diffusers/peft keys")
        return c
    c.skip("diffusers", lycoris, "diffusers' kohya converter reads lora_down/lora_up only")
    c.approx("diffusers", dora, _DIFFUSERS_DORA)
    c.approx("ComfyUI", dora, _COMFY_DORA)
    plain = [m for m, v in variants.items() if v == "LoRA"]  # DoRA/LoKr/LoHa load through LyCORIS: every module
    c.skip(
        "kohya",
        [m for m in plain if _UNET_OUTSIDE_BLOCKS.match(m)],
        "networks/lora.py makes LoRA modules inside the transformer, ResNet and resampler blocks only",
    )
    return c


def qwenimage_coverage(format: str, variants: Mapping[str, str]) -> Coverage:
    """The :class:`Coverage` of a Qwen-Image LoRA file of ``format`` (see :func:`flux_coverage`): ComfyUI maps both
    layouts onto its own (diffusers-named) modules, diffusers reads both (a kohya file as plain LoRA), kohya's
    sd-scripts reads neither."""
    c = Coverage()
    modules = list(variants)
    dora = [m for m, v in variants.items() if v == "DoRA"]
    lycoris = [m for m, v in variants.items() if v in ("LoKr", "LoHa")]
    c.skip("kohya", modules, "kohya's sd-scripts has no Qwen-Image network (musubi-tuner trains Qwen-Image LoRAs)")
    if format == "diffusers":
        c.approx("ComfyUI", dora, _COMFY_PEFT_DORA)
        return c
    c.skip("diffusers", lycoris, "diffusers' Qwen-Image converter reads lora_down/lora_up only (it refuses the file)")
    c.approx("diffusers", dora, _DIFFUSERS_DORA)
    c.approx("ComfyUI", dora, _COMFY_DORA)
    return c
