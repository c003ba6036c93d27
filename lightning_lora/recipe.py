"""The model recipe: everything that decides how the trainable model is built, in one frozen object.

A user writes these as flat options of ``model:`` in the YAML (``model.lora.rank``, ``model.quantization.mode``,
``model.gradient_checkpointing``, ``model.offload_blocks``...); :class:`~lightning_lora.module.LoraModule` turns them
into one :class:`ModelRecipe` when it is created. From then on the recipe is what the rest of the code reads:

* :func:`~lightning_lora.assembly.build_lora_model` builds the model from it (load, freeze, quantize, inject LoRA,
  checkpointing, offloading, attention, compile);
* the memory planner (:mod:`lightning_lora.plan`) counts the same recipe on the meta device, and tries alternatives
  as ``recipe.replace(...)``: a new recipe, never a change to the live module;
* the strategy check (:func:`~lightning_lora.parallel.check_strategy`) asks it what the base is.

**Every cross-option check is here** (:meth:`ModelRecipe.check`, run when a recipe is created): an impossible
combination stops before any weight loads, with one message that names the options and the fix, and an alternative
the planner tries is refused by exactly the rule that refuses the user's config. Checks that need the model itself
(more offloaded blocks than it has, a LoRA target that matches no layer) run where the model is built.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.lora import LoraOptions
from lightning_lora.quant import QuantOptions

__all__ = ["AttentionBackend", "MEMORY_SETTINGS", "TRAINER_PRECISIONS", "ModelRecipe", "check_trainer_precision"]

MEMORY_SETTINGS = (
    "gradient_checkpointing",
    "checkpoint_every",
    "offload_activations",
    "offload_blocks",
    "quantization.mode",
)
"""The options ``model.memory`` may choose (they change memory and speed, never what is trained)."""

TRAINER_PRECISIONS = ("bf16-mixed", "16-mixed", "32-true")
"""The ``trainer.precision`` values that train a LoRA right. The frozen base's dtype is ``model.base_dtype`` and its
storage ``model.quantization.mode``; the trainer's precision only decides autocast. The others cast the whole module,
LoRA included: ``bf16-true`` / ``16-true`` would train the LoRA and keep its optimizer state in 16 bits (updates
smaller than a bf16 step of the weight are lost) and turn float8 base weights back into bf16; ``64-true`` doubles a
bf16 base; Lightning's ``transformer-engine`` and bitsandbytes plugins would quantize the adapters."""

AttentionBackend = Literal["auto", "sdpa", "flash", "efficient", "cudnn", "math", "xformers"]


@dataclass(frozen=True)
class ModelRecipe:
    """How the trainable model is built (see the module docstring). The fields mirror ``LoraModule``'s options.

    Attributes:
        family: the model family and its objective options.
        source: where the frozen weights come from, and their dtype.
        lora: the adapter.
        quantization: the base's storage format.
        gradient_checkpointing: recompute block activations in the backward pass.
        checkpoint_every: with checkpointing, one block in this many is recomputed.
        attention: the attention kernel.
        compile_blocks: regional ``torch.compile`` of the repeated blocks.
        offload_blocks: this many repeated blocks' frozen weights wait in CPU memory.
        offload_activations: checkpointed blocks' saved inputs wait in CPU memory.
    """

    family: DiffusionFamily
    source: ModelSource
    lora: LoraOptions = field(default_factory=LoraOptions)
    quantization: QuantOptions = field(default_factory=QuantOptions)
    gradient_checkpointing: bool = False
    checkpoint_every: int = 1
    attention: AttentionBackend = "auto"
    compile_blocks: bool = False
    offload_blocks: int = 0
    offload_activations: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse an impossible combination of options with a :class:`ConfigError` that names them and the fix."""
        self.family.check_source(self.source)  # the weights exist and suit the family (no weights are read)
        if self.checkpoint_every < 1:
            raise ConfigError(f"model.checkpoint_every: {self.checkpoint_every} must be at least 1 (1: every block).")
        if self.offload_activations and not self.gradient_checkpointing:
            raise ConfigError(
                "model.offload_activations: true moves the inputs that checkpointed blocks keep for the backward to "
                "CPU memory; it needs model.gradient_checkpointing: true."
            )
        for pattern in self.quantization.skip:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"model.quantization.skip: {pattern!r} is not a regular expression ({e}).") from e
        self._check_offload()
        if self.lora.variant in ("lokr", "loha") and self.quantization.mode == "nf4":
            raise ConfigError(
                f"model.lora.variant: {self.lora.variant} reads the base layer's weight shape, and an NF4 layer keeps "
                "its weight packed (peft's LoKr / LoHa layers fail on it). Use model.quantization.mode: fp8 (half of "
                "bf16) or none, or variant lora / dora."
            )
        if self.lora.variant == "dora" and self.quantization.mode in ("fp8", "fp8_compute"):
            raise ConfigError(
                "model.lora.variant: dora normalizes the base weight plus the update each step, and peft cannot read "
                f"lightning-lora's float8 weights (model.quantization.mode: {self.quantization.mode}). Use variant "
                "lora, or a bf16 or NF4 base."
            )

    def _check_offload(self) -> None:
        count = self.offload_blocks
        if count < 0:
            raise ConfigError(f"model.offload_blocks: {count} must be 0 (off) or a number of blocks.")
        if count == 0:
            return
        if self.quantization.mode == "nf4":
            raise ConfigError(
                "model.offload_blocks works with a bf16 or FP8 base, not with NF4 (bitsandbytes keeps each layer's "
                "packed weight from the forward to the backward, so evicting it would free nothing). NF4 is already a "
                "quarter of bf16: set model.offload_blocks: 0, or use model.quantization.mode: fp8."
            )
        if self.compile_blocks:
            raise ConfigError(
                "model.offload_blocks and model.compile_blocks cannot be combined (the compiled blocks would capture "
                "the placeholders). Set one of them off."
            )

    def memory_settings(self) -> dict[str, Any]:
        """The :data:`MEMORY_SETTINGS` of this recipe, by their YAML names below ``model.`` (plain values)."""
        return {
            name: self.quantization.mode if name == "quantization.mode" else getattr(self, name)
            for name in MEMORY_SETTINGS
        }

    def with_memory_settings(self, settings: dict[str, Any]) -> ModelRecipe:
        """This recipe with some :data:`MEMORY_SETTINGS` set (as :meth:`memory_settings` names them)."""
        changes = {k: v for k, v in settings.items() if k in MEMORY_SETTINGS and k != "quantization.mode"}
        if "quantization.mode" in settings:
            changes["quantization"] = dataclasses.replace(self.quantization, mode=settings["quantization.mode"])
        return self.replace(**changes)

    def replace(self, **changes: Any) -> ModelRecipe:
        """A new recipe with ``changes`` (checked like any recipe; a :class:`ConfigError` for an impossible one)."""
        return dataclasses.replace(self, **changes)


def check_trainer_precision(precision: str) -> None:
    """Refuse a ``trainer.precision`` (or precision plugin) that casts the LoRA itself (:data:`TRAINER_PRECISIONS`)."""
    if str(precision) in TRAINER_PRECISIONS:
        return
    raise ConfigError(
        f"trainer.precision: {precision} is not supported: it casts the whole model, LoRA and optimizer state "
        "included (a bf16 LoRA loses small updates; float8 or NF4 base weights would be cast back). Use "
        "trainer.precision: bf16-mixed (autocast; the LoRA stays float32). The frozen base's dtype is "
        "model.base_dtype and its storage model.quantization.mode (nf4, fp8...)."
    )
