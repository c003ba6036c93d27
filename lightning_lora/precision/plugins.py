"""The precision plugins: how the frozen base is stored and computed, as Lightning ``Precision`` plugins.

A run chooses one in the trainer section, the way Lightning users choose any plugin::

    trainer:
      plugins:
        class_path: lightning_lora.precision.NF4     # BF16 (default), FP8, FP8Compute, NF4
        init_args: {double_quant: true}

or ``--trainer.plugins lightning_lora.precision.FP8``. ``trainer.precision`` alone still works for the plain base
(``bf16-mixed``, ``16-mixed``, ``32-true`` are :class:`BF16` with ``dtype`` bf16, fp16, fp32); the precisions that
cast the whole module (``bf16-true``...) are refused (:func:`check_trainer_precision`).

A plugin is one object with two sides:

* **Lightning's side** (it is a :class:`~lightning.pytorch.plugins.precision.MixedPrecision`): every forward runs
  under autocast to ``dtype`` (none for fp32), fp16 with a gradient scaler; the LoRA parameters and their optimizer
  state stay float32 (nothing here casts the module).
* **The model's side**, which the rest of the code asks instead of deciding per mode: the base dtype
  (:attr:`BasePrecision.base_dtype`); quantizing the frozen base before LoRA is injected, in the FP8 format of the
  device (:meth:`~BasePrecision.quantize`); the bytes each module's weights take, for the memory planner
  (:meth:`~BasePrecision.module_weight_bytes`); the model options it cannot go with
  (:meth:`~BasePrecision.check_recipe`); and whether a sharding strategy can split it
  (:attr:`~BasePrecision.shardable`).

:class:`~lightning_lora.module.LoraModule` takes the trainer's plugin into its recipe when ``fit`` starts
(:meth:`~lightning_lora.module.LoraModule.use_precision`); ``model.memory: auto`` may choose another one
(:meth:`BasePrecision.as_format`), which then replaces the trainer's.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from typing_extensions import override

from lightning_lora.errors import ConfigError
from lightning_lora.precision.layers import linear_layers

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "BF16",
    "DTYPES",
    "FP8",
    "NF4",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "TRAINER_PRECISIONS",
    "BaseDtype",
    "BasePrecision",
    "FP8Compute",
    "check_trainer_precision",
    "dtype_name",
    "for_trainer_precision",
    "precision_of",
    "text_encoder_precision",
]


class ModelOptions(Protocol):
    """What a plugin checks of the model's options (a :class:`~lightning_lora.model.recipe.ModelRecipe`, which imports
    this package: the recipe sits above the plugins)."""

    @property
    def lora(self) -> Any: ...

    @property
    def offload_blocks(self) -> int: ...


BaseDtype = Literal["bf16", "fp16", "fp32"]
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_LIGHTNING_NAME = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}

TRAINER_PRECISIONS = tuple(_LIGHTNING_NAME.values())
"""The ``trainer.precision`` values that train a LoRA right (:func:`for_trainer_precision`). The others cast the whole
module, LoRA included: ``bf16-true`` / ``16-true`` would train the LoRA and keep its optimizer state in 16 bits
(updates smaller than a bf16 step of the weight are lost) and turn float8 base weights back into bf16; ``64-true``
doubles the base; Lightning's ``transformer-engine`` and bitsandbytes plugins would quantize the adapters."""

PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
"""Lightning's short spellings of ``trainer.precision`` and what they mean (as Lightning's Trainer documents them)."""

_WHY_NOT = {
    "bf16-true": "trains the LoRA and keeps its optimizer state in bf16 (updates smaller than a bf16 step of a weight "
    "are lost) and casts float8 or NF4 base weights back to bf16",
    "16-true": "trains the LoRA and keeps its optimizer state in fp16 (small updates are lost, large ones overflow) "
    "and casts float8 or NF4 base weights back to fp16",
    "64-true": "casts the whole model, the frozen base included, to float64: twice the memory of float32 for nothing a "
    "LoRA needs",
}


class BasePrecision(MixedPrecision):
    """A base format for the frozen model (see the module docstring). Use :class:`BF16`, :class:`FP8`,
    :class:`FP8Compute` or :class:`NF4`.

    Args:
        dtype: the dtype of the base's unquantized tensors and the compute dtype of its quantized layers; forwards
            run under autocast to it (``fp32``: no autocast). ``fp16`` for GPUs without bf16 (GTX 10xx / 16xx,
            RTX 20xx), with a gradient scaler; ``fp32`` for CPU runs.
        skip: regular expressions of module names whose linear layers stay unquantized (quantized formats).
    """

    shardable: ClassVar[bool] = False
    """Whether a sharding strategy (FSDP, DeepSpeed) can split this base into flat shards."""

    def __init__(self, dtype: BaseDtype = "bf16", skip: list[str] | None = None) -> None:
        name = type(self).__name__
        if dtype not in DTYPES:
            raise ConfigError(f"trainer.plugins: {name}(dtype={dtype!r}): the dtype is one of bf16, fp16, fp32.")
        for pattern in skip or []:
            try:
                re.compile(pattern)
            except re.error as e:
                message = f"trainer.plugins: {name}(skip=[{pattern!r}]) is not a regular expression ({e})."
                raise ConfigError(message) from e
        super().__init__("16-mixed" if dtype == "fp16" else "bf16-mixed", device="cuda")
        self.precision = _LIGHTNING_NAME[dtype]  # type: ignore[assignment]  # fp32: "32-true", no autocast
        self.dtype: BaseDtype = dtype
        self.skip = list(skip or [])

    # -- Lightning's side ----------------------------------------------------------------------------------------
    @property
    def autocasts(self) -> bool:
        """Whether forwards run under autocast (every dtype but fp32)."""
        return self.dtype != "fp32"

    def bind(self, device: torch.device) -> None:
        """Autocast on ``device``'s type (the trainer's root device; set when ``fit`` starts)."""
        self.device = device.type

    @override
    @contextmanager
    def forward_context(self) -> Iterator[None]:
        if not self.autocasts:
            yield
            return
        with self.autocast_context_manager():
            yield

    @override
    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """``trainer.gradient_clip_val`` with any optimizer, torch's fused ones too (``torch.optim.AdamW`` with
        ``fused: true``, one kernel for every LoRA tensor). Lightning's mixed precision refuses to clip for an optimizer
        that can unscale gradients itself, since with a gradient scaler (fp16) the gradients it would clip are still
        scaled; without one (bf16, fp32) there is nothing to unscale and the gradients are the true ones. With fp16
        Lightning's refusal stands."""
        if self.scaler is not None:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
            return
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    # -- the model's side ----------------------------------------------------------------------------------------
    @property
    def base_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def options(self) -> dict[str, Any]:
        """The init arguments that describe this plugin (equality, the config written for a run, hparams)."""
        return {"dtype": self.dtype, "skip": list(self.skip)}

    def spec(self) -> dict[str, Any]:
        """``{"class_path": ..., "init_args": ...}`` as in a config's ``trainer.plugins``."""
        return {"class_path": f"lightning_lora.precision.{type(self).__name__}", "init_args": self.options()}

    def as_format(self, name: str) -> BasePrecision:
        """The plugin named ``name`` (a :data:`PRECISIONS` key) with this one's dtype and skip list (``model.memory``
        choosing another base format for the same training)."""
        if name == type(self).__name__:
            return self
        if name not in PRECISIONS:
            raise ConfigError(f"model.memory: unknown base format {name!r}; one of {', '.join(PRECISIONS)}.")
        return PRECISIONS[name](dtype=self.dtype, skip=self.skip)

    def quantize(self, model: nn.Module, device: torch.device, on_cpu: frozenset[int] = frozenset()) -> int:
        """Store the base's linear layers in this format on ``device`` (the ones whose ``id`` is in ``on_cpu`` on the
        CPU: offloaded blocks), before LoRA is injected; returns how many layers were replaced."""
        return 0

    def check_recipe(self, recipe: ModelOptions) -> None:
        """Raise a :class:`ConfigError` for model options this base format cannot go with."""

    def module_weight_bytes(self, model: nn.Module) -> dict[int, float]:
        """Bytes of each module's own frozen tensors in this format, by ``id(module)`` (``model`` may be on the meta
        device: the memory planner)."""
        quantized = self._quantized_layers(model)
        base = torch.finfo(self.base_dtype).bits // 8
        small = self._small_param_bytes()
        sizes: dict[int, float] = {}
        seen: set[int] = set()  # a tied weight (T5's shared embedding) is one tensor, counted once
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in own)
            total = 0.0
            if id(module) in quantized:
                weight: Any = module.weight
                total += self._quantized_weight_bytes(weight)
                # The bias stays in the compute dtype (NF4: bitsandbytes casts it there anyway).
                total += sum(p.numel() * base for p in own if p is not weight)
            else:
                total += sum(p.numel() * small for p in own)
            sizes[id(module)] = total
        return sizes

    def _quantized_layers(self, model: nn.Module) -> set[int]:
        return set()

    def _quantized_weight_bytes(self, weight: torch.Tensor) -> float:
        return float(weight.numel() * (torch.finfo(self.base_dtype).bits // 8))

    def _small_param_bytes(self) -> int:
        """Bytes per element of the tensors that stay unquantized."""
        return torch.finfo(self.base_dtype).bits // 8

    # -- value semantics (a recipe field; compared on resume and by the planner) -----------------------------------
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options() == self.options()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self.options())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({args})"


class BF16(BasePrecision):
    """The base unquantized, in ``dtype`` (bf16 by default: the full-quality base, 2 bytes per weight)."""

    shardable = True


class FP8(BasePrecision):
    """The base's linear layers in float8 with one scale per output channel (half of bf16), dequantized to ``dtype``
    in each matmul: any GPU, and the CPU (:mod:`lightning_lora.precision.fp8`). Not with ``model.lora.variant: dora``.
    """

    compute: ClassVar[bool] = False

    @override
    def quantize(self, model: nn.Module, device: torch.device, on_cpu: frozenset[int] = frozenset()) -> int:
        from lightning_lora.precision.fp8 import quantize_fp8

        return quantize_fp8(model, self.skip, device, compute=self._computes_on(device), on_cpu=on_cpu)

    def _computes_on(self, device: torch.device) -> bool:
        return False

    @override
    def check_recipe(self, recipe: ModelOptions) -> None:
        if recipe.lora.variant == "dora":
            raise ConfigError(
                "model.lora.variant: dora normalizes the base weight plus the update each step, and peft cannot read "
                f"lightning-lora's float8 weights (trainer.plugins: {type(self).__name__}). Use variant lora, or the "
                "BF16 or NF4 plugin."
            )

    @override
    def _quantized_layers(self, model: nn.Module) -> set[int]:
        return {id(layer) for *_, layer in linear_layers(model, self.skip)}

    @override
    def _quantized_weight_bytes(self, weight: torch.Tensor) -> float:
        return float(weight.numel() + weight.shape[0] * 4)  # one byte per weight, a float32 scale per row


class FP8Compute(FP8):
    """:class:`FP8` weights multiplied in FP8 (``torch._scaled_mm``, row-wise scales) on GPUs with FP8 matrix units:
    compute capability 8.9+ (RTX 40xx, L4, H100/H200) or an MI300 / MI350 (``float8_e4m3fnuz`` on MI300). Elsewhere it
    stores FP8 and multiplies in ``dtype``, with a warning."""

    compute = True

    @override
    def _computes_on(self, device: torch.device) -> bool:
        from lightning_lora.hardware import fp8_compute_supported

        supported, reason = fp8_compute_supported(device)
        if not supported:
            warnings.warn(
                f"trainer.plugins: FP8Compute needs FP8 matrix units ({reason}); using FP8 storage instead (same "
                "memory, matmuls in the base dtype).",
                stacklevel=3,
            )
        return supported


class NF4(BasePrecision):
    """The base's linear layers in bitsandbytes' 4-bit NormalFloat (QLoRA: about a quarter of bf16), dequantized to
    ``dtype`` in each matmul; CUDA, ROCm and the CPU (``pip install 'lightning-lora[bnb]'``).

    Args:
        double_quant: quantize the quantization constants too (saves ~0.4 bit per weight).
        upcast_small_params: keep the tensors that stay unquantized (norms, embeddings, the biases of unquantized
            layers) in float32, as peft's ``prepare_model_for_kbit_training`` does.
        compiled_dequantize: inside blocks compiled by ``model.compile_blocks``, dequantize with torch operations the
            compiler fuses (the same weights, bit for bit) instead of calling bitsandbytes' kernels, whose host time
            made ``flux_8gb``'s compiled step host-bound. Measured on an H200 (BENCHMARKS.md, "What each option
            measured"):
            ``flux_8gb`` 1.81-1.91 s per step against 2.21-2.81 with bitsandbytes' kernels, ``qwenimage_24gb``
            compiled 2.95 against 5.60 eager, the same peak memory. ``false``: bitsandbytes' kernels everywhere.
            Eager layers always use bitsandbytes' kernels.
        dtype, skip: see :class:`BasePrecision`. Layers whose ``in_features`` is not a multiple of 64 stay in
            ``dtype``.
    """

    def __init__(
        self,
        double_quant: bool = True,
        upcast_small_params: bool = True,
        compiled_dequantize: bool = True,
        dtype: BaseDtype = "bf16",
        skip: list[str] | None = None,
    ) -> None:
        super().__init__(dtype=dtype, skip=skip)
        self.double_quant = double_quant
        self.upcast_small_params = upcast_small_params
        self.compiled_dequantize = compiled_dequantize

    @override
    def options(self) -> dict[str, Any]:
        return {
            "double_quant": self.double_quant,
            "upcast_small_params": self.upcast_small_params,
            "compiled_dequantize": self.compiled_dequantize,
            **super().options(),
        }

    @override
    def quantize(self, model: nn.Module, device: torch.device, on_cpu: frozenset[int] = frozenset()) -> int:
        from lightning_lora.precision.nf4 import quantize_nf4

        return quantize_nf4(
            model,
            self.skip,
            device,
            self.base_dtype,
            self.double_quant,
            self.upcast_small_params,
            self.compiled_dequantize,
        )

    @override
    def check_recipe(self, recipe: ModelOptions) -> None:
        if recipe.lora.variant in ("lokr", "loha"):
            raise ConfigError(
                f"model.lora.variant: {recipe.lora.variant} reads the base layer's weight shape, and an NF4 layer "
                "keeps its weight packed (peft's LoKr / LoHa layers fail on it). Use trainer.plugins: "
                "lightning_lora.precision.FP8 (half of bf16) or BF16, or variant lora / dora."
            )
        if recipe.offload_blocks:
            raise ConfigError(
                "model.offload_blocks works with a BF16 or FP8 base, not with NF4 (bitsandbytes keeps each layer's "
                "packed weight from the forward to the backward, so evicting it would free nothing). NF4 is already a "
                "quarter of bf16: set model.offload_blocks: 0, or use trainer.plugins: lightning_lora.precision.FP8."
            )

    @override
    def _quantized_layers(self, model: nn.Module) -> set[int]:
        return {id(layer) for *_, layer in linear_layers(model, self.skip) if layer.in_features % 64 == 0}

    @override
    def _quantized_weight_bytes(self, weight: torch.Tensor) -> float:
        n = weight.numel()
        absmax = n / 64 * (1 + 4 / 256) if self.double_quant else n / 64 * 4  # 8-bit absmax + float32 per 256 blocks
        return n / 2 + absmax

    @override
    def _small_param_bytes(self) -> int:
        return 4 if self.upcast_small_params else super()._small_param_bytes()


PRECISIONS: dict[str, type[BasePrecision]] = {cls.__name__: cls for cls in (BF16, FP8, FP8Compute, NF4)}
"""The plugins by class name (``model.memory`` and the planner name them so)."""


def check_trainer_precision(precision: str) -> None:
    """Refuse a ``trainer.precision`` (or a precision plugin not of this package) that casts or quantizes the LoRA
    itself (:data:`TRAINER_PRECISIONS`); Lightning's aliases (:data:`PRECISION_ALIASES`) are what they stand for."""
    meant = PRECISION_ALIASES.get(str(precision), str(precision))
    if meant in TRAINER_PRECISIONS:
        return
    spelled = f"{precision} ({meant})" if meant != str(precision) else str(precision)
    why = _WHY_NOT.get(meant, "casts or quantizes the whole model, the LoRA and its optimizer state included")
    raise ConfigError(
        f"trainer.precision: {spelled} is not supported: it {why}. Use trainer.precision: bf16-mixed (autocast; the "
        "LoRA stays float32) or 32-true (float32 throughout), and choose the frozen base's format with "
        "trainer.plugins: lightning_lora.precision.BF16, FP8, FP8Compute or NF4."
    )


def for_trainer_precision(precision: str) -> BF16:
    """The plugin a plain ``trainer.precision`` means: ``bf16-mixed`` / ``16-mixed`` / ``32-true`` (and Lightning's
    aliases ``bf16`` / ``16`` / ``32``) are :class:`BF16` with dtype bf16 / fp16 / fp32; the others are refused
    (:func:`check_trainer_precision`)."""
    check_trainer_precision(precision)
    meant = PRECISION_ALIASES.get(str(precision), str(precision))
    dtype = {lightning: ours for ours, lightning in _LIGHTNING_NAME.items()}[meant]
    return BF16(dtype=dtype)  # type: ignore[arg-type]


def precision_of(trainer: Trainer) -> BasePrecision:
    """The base format a trainer runs: its plugin when it is one of ours, else what its ``precision`` means (a
    ``Trainer(precision="bf16-mixed")`` built in Python; the unsupported ones are refused)."""
    plugin = trainer.precision_plugin
    if isinstance(plugin, BasePrecision):
        return plugin
    return for_trainer_precision(str(trainer.precision))


def dtype_name(dtype: torch.dtype) -> BaseDtype:
    """``torch.bfloat16`` -> ``"bf16"`` (a :data:`DTYPES` value to its name)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name  # type: ignore[return-value]
    raise ValueError(f"{dtype} is not a base dtype (one of {', '.join(map(str, DTYPES.values()))})")


def text_encoder_precision(mode: str, dtype: torch.dtype, skip: list[str]) -> BasePrecision:
    """How ``data.text_encoder_quantization: mode`` (``none``, ``fp8``, ``nf4``) stores the text encoders while they
    encode captions: their linear layers but ``skip`` (the modules the encoder keeps in float32) in that format, the
    rest in ``dtype``, the load dtype (NF4 upcasts nothing)."""
    name = dtype_name(dtype)
    if mode == "nf4":
        return NF4(upcast_small_params=False, dtype=name, skip=skip)
    if mode == "fp8":
        return FP8(dtype=name, skip=skip)
    return BF16(dtype=name, skip=skip)
