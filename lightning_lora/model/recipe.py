"""The model recipe: everything that decides how the trainable model is built, in one frozen object.

A user writes these as flat options of ``model:`` in the YAML (``model.lora.rank``, ``model.gradient_checkpointing``,
``model.offload_blocks``...), and the frozen base's format as a precision plugin (``trainer.plugins``:
:mod:`lightning_lora.precision`); :class:`~lightning_lora.module.LoraModule` turns them into one :class:`ModelRecipe`
(the plugin joins when ``fit`` starts). From then on the recipe is what the rest of the code reads:

* :func:`~lightning_lora.model.assembly.build_lora_model` builds the model from it (load, freeze, quantize, inject LoRA,
  checkpointing, offloading, attention, compile);
* the memory planner (:mod:`lightning_lora.plan`) counts the same recipe on the meta device, and tries alternatives
  as ``recipe.replace(...)``: a new recipe, never a change to the live module;
* the strategy check (:func:`~lightning_lora.model.parallel.check_strategy`) asks it what the base is.

**Every cross-option check is here** (:meth:`ModelRecipe.check`, run when a recipe is created): an impossible
combination stops before any weight loads, with one message that names the options and the fix, and an alternative
the planner tries is refused by exactly the rule that refuses the user's config. Checks that need the model itself
(more offloaded blocks than it has, a LoRA target that matches no layer) run where the model is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import DiffusionFamily, ModelSource
from lightning_lora.lora import LoraOptions
from lightning_lora.objectives import Preservation
from lightning_lora.precision import BF16, BasePrecision

__all__ = ["AttentionBackend", "MEMORY_SETTINGS", "ModelRecipe"]

MEMORY_SETTINGS = (
    "gradient_checkpointing",
    "checkpoint_every",
    "offload_activations",
    "offload_blocks",
    "precision",
)
"""The options ``model.memory`` may choose (they change memory and speed, never what is trained): ``precision`` is the
base format's plugin, by class name (``NF4``...)."""

AttentionBackend = Literal["auto", "sdpa", "flash", "efficient", "cudnn", "math", "xformers"]


@dataclass(frozen=True)
class ModelRecipe:
    """How the trainable model is built (see the module docstring). The fields mirror ``LoraModule``'s options.

    Attributes:
        family: the model family and its objective options.
        source: where the frozen weights come from, and their dtype.
        lora: the adapter.
        precision: the frozen base's format (a :mod:`lightning_lora.precision` plugin); ``source.dtype`` must be its
            dtype (:meth:`with_precision` changes both).
        gradient_checkpointing: recompute block activations in the backward pass.
        checkpoint_every: with checkpointing, one block in this many is recomputed.
        attention: the attention kernel.
        compile_blocks: regional ``torch.compile`` of the repeated blocks.
        cuda_graphs: the compiled blocks replay CUDA graphs (``torch.compile``'s ``reduce-overhead`` mode).
        offload_blocks: this many repeated blocks' frozen weights wait in CPU memory.
        offload_activations: checkpointed blocks' saved inputs wait in CPU memory.
        preservation: what keeps the base model's behaviour (DOP adds a forward without gradients to a step).
    """

    family: DiffusionFamily
    source: ModelSource
    lora: LoraOptions = field(default_factory=LoraOptions)
    precision: BasePrecision = field(default_factory=BF16)
    gradient_checkpointing: bool = False
    checkpoint_every: int = 1
    attention: AttentionBackend = "auto"
    compile_blocks: bool = False
    cuda_graphs: bool = False
    offload_blocks: int = 0
    offload_activations: bool = False
    preservation: Preservation = field(default_factory=Preservation)

    def __post_init__(self) -> None:
        if self.source.dtype != self.precision.base_dtype:  # a caller's mistake: the plugin says the dtype
            raise ValueError(
                f"ModelRecipe: source.dtype {self.source.dtype} is not the dtype of {self.precision!r}; give "
                "precision=BF16(dtype=...) (or another plugin) with that dtype, or use with_precision()"
            )
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
        if self.cuda_graphs and not self.compile_blocks:
            raise ConfigError(
                "model.cuda_graphs: true replays the compiled blocks as CUDA graphs; it needs "
                "model.compile_blocks: true (or set model.cuda_graphs: false)."
            )
        self._check_offload()
        self.precision.check_recipe(self)

    def _check_offload(self) -> None:
        count = self.offload_blocks
        if count < 0:
            raise ConfigError(f"model.offload_blocks: {count} must be 0 (off) or a number of blocks.")
        if count == 0:
            return
        if self.compile_blocks:
            raise ConfigError(
                "model.offload_blocks and model.compile_blocks cannot be combined (the compiled blocks would capture "
                "the placeholders). Set one of them off."
            )

    def memory_settings(self) -> dict[str, Any]:
        """The :data:`MEMORY_SETTINGS` of this recipe, by their YAML names below ``model.`` (plain values;
        ``precision``: the plugin's class name, which goes into ``trainer.plugins``)."""
        return {
            name: type(self.precision).__name__ if name == "precision" else getattr(self, name)
            for name in MEMORY_SETTINGS
        }

    def with_memory_settings(self, settings: dict[str, Any]) -> ModelRecipe:
        """This recipe with some :data:`MEMORY_SETTINGS` set (as :meth:`memory_settings` names them)."""
        changes = {k: v for k, v in settings.items() if k in MEMORY_SETTINGS and k != "precision"}
        if "precision" in settings:
            return self.with_precision(self.precision.as_format(settings["precision"])).replace(**changes)
        return self.replace(**changes)

    def with_precision(self, precision: BasePrecision) -> ModelRecipe:
        """This recipe with another base format (the source loads in its dtype)."""
        return self.replace(precision=precision, source=dataclasses.replace(self.source, dtype=precision.base_dtype))

    def replace(self, **changes: Any) -> ModelRecipe:
        """A new recipe with ``changes`` (checked like any recipe; a :class:`ConfigError` for an impossible one)."""
        return dataclasses.replace(self, **changes)
