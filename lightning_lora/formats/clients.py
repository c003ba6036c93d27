"""Which layers of a LoRA file each tool applies, by the key rules of its loader.

A LoRA file is only as good as what the tools that read it make of it, and they differ: a file can load without an
error and apply nothing, or apply some layers and skip others with a log line nobody reads. This module writes down
what each of three loaders does with each adapted layer, so that export can say it (``lightning-lora export`` and the
training run's ``LoraExport`` print it, and the file's ``lightning_lora.loads_in`` records the tools that apply every
layer exactly). The rules, with where each comes from (each family applies those for its files in its
``lora_coverage``, :meth:`lightning_lora.families.base.DiffusionFamily.lora_coverage`):

ComfyUI (``comfy/lora.py`` ``model_lora_keys_unet`` builds a map from LoRA key prefixes to model weights;
``load_lora`` reads ``<prefix>.lora_up.weight`` / ``.lora_B.weight`` / ``.lokr_w1`` / ``.hada_w1_a``..., ``.alpha`` and
``.dora_scale``; anything else is logged "lora key not loaded" and ignored):

* every weight of the model as ComfyUI builds it, under ``lora_unet_<name with _>`` and ``diffusion_model.<name>``, in
  every release (the ComfyUI layout: :mod:`lightning_lora.formats.comfyui`): FLUX, FLUX.2 and Chroma in BFL names,
  Z-Image in its original ones, SDXL and SD1.x in the original (LDM/SGM) names; and, through ``comfy/utils.py``
  ``unet_to_diffusers``, SD UNets' diffusers names as ``lora_unet_<name with _>`` too (so sd-scripts' SD1.x names
  load);
* diffusers names with a ``unet.`` prefix only in the *old attention-processor* spelling: ``...attn1.processor.to_q``
  and ``...attn1.processor.to_out`` (``.to_`` replaced by ``.processor.to_``, ``to_out.0`` by ``to_out``). peft's
  ``unet.<...>.attn1.to_q.lora_A.weight`` is not in the map: a diffusers-layout SD/SDXL file loses every attention
  layer there (the convolutions, ``proj_in/out`` and feed-forward layers load);
* FLUX diffusers names under ``transformer.`` (and ``lycoris_``, ``lora_transformer_``), each mapped by
  ``comfy/utils.py`` ``flux_to_diffusers`` to its *row slice* of the fused BFL weight (``to_k`` -> ``(img_attn.qkv, 0,
  hidden, hidden)``), ``norm_out.linear`` with the scale/shift swap: a diffusers-layout FLUX file loads exactly, part
  by part. ComfyUI's FLUX.2 and Chroma models are kinds of its FLUX model, so these rules map the layers of theirs that
  have FLUX.1's diffusers names too;
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
not as trained, each with the reason. Z-Image's and FLUX.2's rules are in their families' modules, with the key maps
they come from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["COMFY_DORA", "COMFY_PEFT_DORA", "DIFFUSERS_DORA", "TOOLS", "TOOL_NAMES", "Coverage", "rules_unknown"]

TOOLS = ("diffusers", "ComfyUI", "kohya")
"""The loaders :class:`Coverage` speaks for: diffusers' ``load_lora_weights``, ComfyUI's LoRA loader, kohya's sd-scripts
(with LyCORIS for DoRA, LoKr, LoHa)."""

TOOL_NAMES = {"diffusers": "diffusers", "ComfyUI": "ComfyUI", "kohya": "kohya's sd-scripts"}
"""Each of :data:`TOOLS` as messages name it."""

COMFY_DORA = "ComfyUI divides an output-axis dora_scale by the base weight's row norms, not the patched weight's"
DIFFUSERS_DORA = "diffusers drops kohya files' dora_scale (the layer loads as a plain LoRA)"
COMFY_PEFT_DORA = "ComfyUI reads dora_scale, not peft's lora_magnitude_vector (the layer loads as a plain LoRA)"
"""Why a DoRA layer loads close to, not as, trained: the reasons :class:`Coverage` gives (:data:`COMFY_DORA` for a kohya
file in ComfyUI, :data:`DIFFUSERS_DORA` for one in diffusers, this one for a diffusers file in ComfyUI)."""


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


def rules_unknown(family: str, format: str, variants: Mapping[str, str]) -> Coverage:
    """The :class:`Coverage` of a ``format`` file of a family whose loaders' key rules lightning-lora does not know:
    diffusers loads its own layout; the other tools' rules are unknown (reported as not loaded)."""
    coverage = Coverage()
    for tool in ("ComfyUI", "kohya"):
        coverage.skip(tool, variants, f"lightning-lora knows no {tool} key rules for the {family} family")
    if format != "diffusers":
        coverage.skip("diffusers", variants, f"lightning-lora knows no diffusers rules for {format} files")
    return coverage
