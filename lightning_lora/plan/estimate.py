"""The memory planner's estimate: the peak GPU memory of a training run, predicted from the model's config before any
weight loads.

The peak of a LoRA step is the sum of

* **static** memory: the frozen weights in their storage format (bf16: 2 bytes per weight; FP8: 1 byte plus a scale
  per row; NF4: half a byte plus one absmax per 64 weights, itself 8-bit with double quantization), the LoRA
  parameters (float32), their gradients (float32), the optimizer state (AdamW: two float32 moments; AdamW8bit: two
  8-bit moments; Adafactor: factored second moments, a few percent) and, with a ``LoraEMA`` callback, its float32
  copies of the LoRA (the EMA, and one per power-function EMA it snapshots; the snapshots go to disk);
* **saved activations**: what the forward pass keeps for the backward. They are *counted*, not estimated: the real
  model is built on PyTorch's ``meta`` device (shapes, no memory, no weights) with the real LoRA injected and the
  real checkpointing setting, and one forward pass at the configured resolution, batch and text length runs under a
  ``saved_tensors_hooks`` that adds up every tensor autograd keeps, as the GPU runs it
  (:func:`lightning_lora.plan.live_bytes.saved_activation_bytes`): under the base dtype's autocast, with attention
  counted as the flash / memory-efficient kernels store it (output and log-sum-exp, not the full attention matrix) and
  ``rms_norm`` as its fused kernel does;
* **transient** memory during the backward: gradients flowing through a block, recomputed activations of one block
  under checkpointing, kernel workspaces, allocator rounding. This part is calibrated against GPU measurements
  (BENCHMARKS.md) as a multiple of the largest per-block activation.

Sampling needs the frozen weights, the VAE and the larger of two transients, each *measured* the same way, on the
``meta`` device (:mod:`lightning_lora.plan.live_bytes`: the most bytes its tensors hold at once, under the sampler's
autocast): one no-grad forward pass of the denoiser at the sampling batch (2 with classifier-free guidance), and the
VAE's decode of one image at full resolution (:mod:`lightning_lora.plan.sampling`). The decode dominates: at its first
full-resolution group norm it holds the 256-channel bf16 activation, autocast's float32 copy of it and the float32
output, 2.5 GiB for a 1024x1024 image.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_lora.data.recipe import DataRecipe
from lightning_lora.families.base import DiffusionFamily
from lightning_lora.lora import LoraOptions, inject_lora
from lightning_lora.model.offload import offloaded_blocks, repeated_blocks
from lightning_lora.model.recipe import ModelRecipe
from lightning_lora.plan.live_bytes import module_copy, saved_activation_bytes
from lightning_lora.plan.sampling import autocast_dtype, no_grad_forward_bytes, sampling_bytes
from lightning_lora.precision import BF16, BasePrecision, text_encoder_precision

__all__ = [
    "GIB",
    "HEADROOM",
    "MemoryPlan",
    "caching_peaks",
    "compiled_saved_bytes",
    "offloaded_weight_bytes",
    "optimizer_bytes_per_param",
    "optimizer_name",
    "plan_for",
    "plan_training",
    "sharded_weight_bytes",
    "weight_bytes",
]

GIB = 2**30

# Transient memory in the backward pass, as multiples of the largest activation saved by one block (calibrated on an
# H200 against tools/bench.py; see BENCHMARKS.md), plus a fixed CUDA context / allocator allowance.
TRANSIENT_BLOCKS = 3.0
FIXED_OVERHEAD_GIB = 0.35

HEADROOM = 0.95
"""The share of a card's memory a planned peak may take ("keeping 5% headroom"): the verdicts, the suggestions, the
``model.memory`` choice and ``fit``'s warning at start."""

_OPTIMIZER_BYTES = {
    "AdamW": 8.0,
    "Adam": 8.0,
    "AdamW8bit": 2.05,
    "Adam8bit": 2.05,
    "PagedAdamW8bit": 2.05,
    "Adafactor": 0.5,
    "SGD": 0.0,
    "Prodigy": 16.0,
    "Lion": 4.0,
    "Lion8bit": 1.05,
}


def optimizer_bytes_per_param(name: str) -> float:
    """Optimizer state bytes per trainable parameter (AdamW: two float32 moments = 8)."""
    return _OPTIMIZER_BYTES.get(name, 8.0)


@dataclass
class MemoryPlan:
    """Predicted GPU memory of a training step, in GiB, by component."""

    weights: float
    lora: float
    gradients: float
    optimizer: float
    activations: float
    transient: float
    overhead: float = FIXED_OVERHEAD_GIB
    ema: float = 0.0
    """The float32 copies of the LoRA a ``LoraEMA`` callback keeps on the GPU (0 without one)."""
    sampling_peak: float = 0.0
    caching_text: float = 0.0
    """Peak while the cache encodes captions (the text encoders, once, before training); 0 when unknown."""
    caching_images: float = 0.0
    """Peak while the cache encodes images (the VAE, ``data.encode_batch_size`` at a time)."""
    host: float = 0.0
    """Host (CPU) memory: the largest part passes through it while loading, plus pinned offloaded blocks."""
    preservation: float = 0.0
    """DOP's forward without gradients (``model.preservation.mode: dop``): its peak beyond the static memory, before
    the training forward (nothing saved yet); 0 without DOP."""
    notes: list[str] = field(default_factory=list)

    @property
    def static(self) -> float:
        return self.weights + self.lora + self.gradients + self.optimizer + self.ema

    @property
    def peak_gib(self) -> float:
        step = self.static + self.activations + self.transient + self.overhead
        return max(step, self.static + self.preservation + self.overhead)

    @property
    def run_peak(self) -> float:
        """What the training run needs on the GPU: its steps' peak, or its sample images' where that is higher."""
        return max(self.peak_gib, self.sampling_peak)

    @property
    def caching_peak(self) -> float:
        return max(self.caching_text, self.caching_images)

    @property
    def need_gib(self) -> float:
        """The most GPU memory the run needs at any time: caching, training or drawing sample images."""
        return max(self.peak_gib, self.sampling_peak, self.caching_peak)

    def report(self, vram_gib: float | None = None) -> str:
        rows = [
            ("frozen weights", self.weights),
            ("LoRA parameters (fp32)", self.lora),
            ("LoRA gradients (fp32)", self.gradients),
            ("optimizer state", self.optimizer),
            *([("EMA of the LoRA (fp32)", self.ema)] if self.ema else []),
            ("saved activations", self.activations),
            ("backward transient", self.transient),
            ("CUDA context / allocator", self.overhead),
        ]
        if self.preservation:
            rows.insert(-1, ("DOP forward (no grad)", self.preservation))
        lines = [f"  {name:<28}{value:8.2f} GiB" for name, value in rows]
        lines.append(f"  {'training peak':<28}{self.peak_gib:8.2f} GiB")
        if self.sampling_peak:
            lines.append(f"  {'sample images peak':<28}{self.sampling_peak:8.2f} GiB")
        if self.caching_text:
            lines.append(f"  {'caching captions peak':<28}{self.caching_text:8.2f} GiB   (text encoders, once)")
        if self.caching_images:
            lines.append(f"  {'caching images peak':<28}{self.caching_images:8.2f} GiB   (VAE, once)")
        if self.host:
            lines.append(f"  {'host (CPU) memory':<28}{self.host:8.2f} GiB")
        if vram_gib is not None:
            verdict = "fits" if self.need_gib <= vram_gib * HEADROOM else "does NOT fit"
            lines.append(f"  -> {verdict} in {vram_gib:g} GiB (keeping 5% headroom)")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def weight_bytes(model: nn.Module, precision: BasePrecision) -> float:
    """Bytes of the frozen base in ``precision``'s format (``model`` may live on the meta device)."""
    return sum(precision.module_weight_bytes(model).values())


def offloaded_weight_bytes(model: nn.Module, blocks: list[nn.Module], precision: BasePrecision) -> float:
    """GPU memory that offloading ``blocks`` takes off the frozen weights: their bytes, less the two consecutive
    offloaded blocks that are on the GPU at a time (the running one and the one being copied)."""
    if not blocks:
        return 0.0
    sizes = precision.module_weight_bytes(model)
    chosen = [sum(sizes[id(m)] for m in block.modules()) for block in blocks]
    in_flight = max((a + b for a, b in zip(chosen, chosen[1:], strict=False)), default=chosen[0])
    return sum(chosen) - in_flight


def sharded_weight_bytes(model: nn.Module, precision: BasePrecision, shards: int) -> tuple[float, float]:
    """Frozen-weight bytes on each GPU when the base is sharded over ``shards`` GPUs the way
    :func:`~lightning_lora.model.sharding.shard_base` shards it, and the part of them that is gathered blocks in flight.

    Each repeated block is its own unit: a GPU keeps 1/``shards`` of it, and gathers its full weights just before it
    runs, the next block's while it runs (FSDP2 prefetches one unit ahead in the forward and in the backward): two
    blocks whole at a time, on top of the shards. The root unit (embeddings, final norm and projection) stays whole
    from the forward to its backward."""
    sizes = precision.module_weight_bytes(model)
    blocks = [sum(sizes[id(m)] for m in block.modules()) for block in repeated_blocks(model)]
    in_flight = sum(sorted(blocks, reverse=True)[:2])
    root = sum(sizes.values()) - sum(blocks)
    return sum(blocks) / shards + root + in_flight, in_flight


@dataclass(frozen=True)
class _Counted:
    """What one meta-device forward pass counts (independent of the base's storage format and the optimizer)."""

    lora_params: int
    saved: float
    largest: float
    moved: float
    blocks: int


_COUNTED: dict[str, _Counted] = {}
"""Counts by what they depend on: the alternatives the planner tries often differ only in the base's format, which
changes the weights but not what the forward pass keeps (the skeleton is never quantized)."""

_SKELETONS: dict[str, nn.Module] = {}
_WITH_LORA: dict[str, tuple[nn.Module, int]] = {}


def _model_key(recipe: ModelRecipe) -> str:
    """What the denoiser's skeleton depends on: the family (and its settings) and the source."""
    return repr((type(recipe.family), sorted(vars(recipe.family).items()), recipe.source))


def _remember(cache: dict[str, Any], key: str, value: Any) -> Any:
    if len(cache) > 8:
        cache.clear()
    cache[key] = value
    return value


def denoiser_skeleton(recipe: ModelRecipe) -> nn.Module:
    """The denoiser of ``recipe`` on the ``meta`` device (:meth:`~lightning_lora.families.base.DiffusionFamily.
    denoiser_skeleton`), built once per process for its family and source: shared, so never changed; the counts add
    the LoRA and checkpointing to a copy, and forward passes run on a copy."""
    key = _model_key(recipe)
    if key in _SKELETONS:
        return _SKELETONS[key]
    return _remember(_SKELETONS, key, recipe.family.denoiser_skeleton(recipe.source))


def _with_lora(recipe: ModelRecipe) -> tuple[nn.Module, int]:
    """A copy of the frozen skeleton with the recipe's LoRA (:func:`add_counted_lora`) and its parameter count, to copy
    again before each count (:func:`~lightning_lora.plan.live_bytes.module_copy`: a fraction of injecting the LoRA)."""
    key = repr((_model_key(recipe), recipe.lora))
    if key not in _WITH_LORA:
        model = copy.deepcopy(denoiser_skeleton(recipe)).requires_grad_(False)
        lora_params = add_counted_lora(model, recipe.family, recipe.lora, recipe.source.dtype)
        _remember(_WITH_LORA, key, (model, lora_params))
    return _WITH_LORA[key]


def add_counted_lora(model: nn.Module, family: DiffusionFamily, lora: LoraOptions, dtype: torch.dtype) -> int:
    """Inject the LoRA into the frozen ``model`` as the planner counts it: its parameters in ``dtype`` (autocast
    computes the LoRA path in the base dtype). Returns the number of LoRA parameters."""
    inject_lora(model, family, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.to(dtype)
    return sum(p.numel() for p in trainable)


def _fused_rms_norm(recipe: ModelRecipe) -> bool:
    """Whether the GPU runs ``F.rms_norm`` fused: not where the precision keeps the norms' weights in float32 under a
    bf16 input (NF4's ``upcast_small_params``: torch warns of the dtype mismatch and decomposes it)."""
    return not getattr(recipe.precision, "upcast_small_params", False)


def _count(recipe: ModelRecipe, height: int, width: int, batch: int, text_len: int, controls: int = 0) -> _Counted:
    from lightning_lora.model.assembly import apply_gradient_checkpointing
    from lightning_lora.model.recompute import ensure_recomputed

    family, source = recipe.family, recipe.source
    key = repr(
        (
            _model_key(recipe),
            recipe.lora,
            recipe.gradient_checkpointing,
            recipe.checkpoint_every,
            recipe.offload_activations,
            recipe.offload_blocks,
            _fused_rms_norm(recipe),
            height,
            width,
            batch,
            text_len,
            controls,
        )
    )
    if key in _COUNTED:
        return _COUNTED[key]
    with_lora, lora_params = _with_lora(recipe)
    model = module_copy(with_lora)  # meta device: shapes only
    offloaded = offloaded_blocks(model, recipe.offload_blocks)
    if recipe.gradient_checkpointing:
        # Only checkpointed blocks' inputs stay saved; in the backward one block's activations are recomputed at a
        # time (the calibration of TRANSIENT_BLOCKS was made with this measurement order).
        apply_gradient_checkpointing(model, recipe.checkpoint_every, recipe.offload_activations)
    ensure_recomputed(model, *offloaded)  # recomputed, as offload_blocks() makes them
    model.train()
    inputs = family.example_inputs_with_controls(
        model, batch, height, width, text_len, controls, device="meta", dtype=source.dtype
    )
    saved, largest, moved = saved_activation_bytes(  # moved: block inputs kept in CPU memory
        model, inputs, autocast=autocast_dtype(recipe), fused_rms_norm=_fused_rms_norm(recipe)
    )
    counted = _Counted(lora_params, saved, largest, moved, family.block_count(model))
    if len(_COUNTED) > 64:
        _COUNTED.clear()
    _COUNTED[key] = counted
    return counted


def compiled_saved_bytes(saved: float, uncheckpointed: float, all_checkpointed: float, share: float) -> float:
    """What compiled blocks with one in N checkpointed keep for the backward, from the eager counts with N as configured
    (``saved``), with none and with every block checkpointed: the blocks not checkpointed keep the family's compiled
    ``share``, the checkpointed ones their inputs (which compiling does not shrink). The checkpointed fraction is what
    N saved over what checkpointing them all saves (within -6.5% / -3.1% of the GPU's: BENCHMARKS.md, "The planner
    against measured peaks")."""
    if uncheckpointed <= all_checkpointed:  # nothing to checkpoint
        return saved
    checkpointed = (uncheckpointed - saved) / (uncheckpointed - all_checkpointed)
    return share * saved + (1 - share) * checkpointed * all_checkpointed


def plan_training(
    recipe: ModelRecipe,
    height: int,
    width: int,
    batch: int,
    text_len: int,
    optimizer: str = "AdamW",
    sample_size: tuple[int, int] | None = None,
    shards: int = 1,
    controls: int = 0,
    ema_copies: int = 0,
) -> MemoryPlan:
    """Predict the training peak of the model ``recipe`` describes, at this image size, batch and text length, on each
    GPU: ``shards`` > 1 is a base sharded over that many GPUs (``trainer.strategy: fsdp``, :func:`sharded_weight_bytes`;
    the LoRA, its gradients and optimizer state are sharded with it). ``controls``: control images of the target's size
    per sample (edit training: their tokens join the image's, as the family's loss appends them). ``ema_copies``: the
    float32 copies of the LoRA a ``LoraEMA`` keeps (:attr:`~lightning_lora.callbacks.ema.LoraEMA.copies`)."""
    model = denoiser_skeleton(recipe)  # meta device: shapes only
    weights = weight_bytes(model, recipe.precision)
    if shards > 1:  # a sharded base is never offloaded (parallel.check_strategy)
        resident, in_flight = sharded_weight_bytes(model, recipe.precision, shards)
    else:
        offloaded = offloaded_blocks(model, recipe.offload_blocks)
        resident = weights - offloaded_weight_bytes(model, offloaded, recipe.precision)
    counted = _count(recipe, height, width, batch, text_len, controls)
    saved, largest, moved = counted.saved, counted.largest, counted.moved
    lora_params = counted.lora_params / shards  # sharded with the base (each rank's optimizer steps its shard)
    if recipe.compile_blocks and not recipe.gradient_checkpointing:
        # Compiled blocks keep fewer tensors than the eager count (the family's share); checkpointed blocks keep only
        # their inputs, which compiling cannot shrink.
        saved *= recipe.family.planning.compiled_saved_fraction
    elif recipe.compile_blocks and recipe.checkpoint_every > 1:  # the blocks not checkpointed keep the family's share
        eager = recipe.replace(gradient_checkpointing=False, checkpoint_every=1, offload_activations=False)
        saved = compiled_saved_bytes(
            saved,
            uncheckpointed=_count(eager, height, width, batch, text_len, controls).saved,
            all_checkpointed=_count(recipe.replace(checkpoint_every=1), height, width, batch, text_len, controls).saved,
            share=recipe.family.planning.compiled_saved_fraction,
        )
    per_block = (saved + moved) / max(counted.blocks, 1)
    transient = TRANSIENT_BLOCKS * per_block
    if recipe.gradient_checkpointing or recipe.offload_blocks:
        transient += per_block
    plan = MemoryPlan(
        weights=resident / GIB,
        lora=lora_params * 4 / GIB,
        gradients=lora_params * 4 / GIB,
        optimizer=lora_params * optimizer_bytes_per_param(optimizer) / GIB,
        activations=saved / GIB,
        transient=(transient + largest) / GIB,
        ema=ema_copies * lora_params * 4 / GIB,
    )
    if recipe.offload_blocks:
        plan.notes.append(
            f"offload_blocks {recipe.offload_blocks}: {(weights - resident) / GIB:.2f} GiB less frozen weight on the "
            "GPU (the blocks wait in pinned CPU memory and are copied in twice per step, two at a time)"
        )
    if shards > 1:
        plan.notes.append(
            f"sharded over {shards} GPUs (trainer.strategy: fsdp): each holds 1/{shards} of the blocks' weights and of "
            f"the LoRA, and the whole of the rest, plus two gathered blocks in flight ({in_flight / GIB:.2f} GiB)"
        )
    if moved:
        plan.notes.append(
            f"offload_activations: {moved / GIB:.2f} GiB of checkpointed blocks' inputs wait in pinned CPU memory"
        )
    if recipe.preservation.dop:  # the base's own prediction for the batch, the adapter off, before the training pass
        plan.preservation = no_grad_forward_bytes(recipe, model, batch, height, width, text_len, controls) / GIB
        plan.notes.append(
            f"model.preservation.mode: dop: one more forward of the denoiser, without gradients and the adapter off, "
            f"in each batch that holds preservation samples ({plan.preservation:.2f} GiB at its peak, before the "
            "training forward): a third more FLOPs for such a batch (a quarter with gradient checkpointing)"
        )
    sh, sw = sample_size or (height, width)
    # Samples drawn during training: the optimizer's state stays on the GPU beside the model (the LoRA's gradients are
    # freed after each optimizer step), and the EMA's copies, one more while the EMA's samples keep the raw LoRA aside.
    sampling = sampling_bytes(recipe, model, sh, sw, text_len, controls) / GIB
    aside = plan.lora if ema_copies else 0.0
    plan.sampling_peak = resident / GIB + plan.lora + plan.optimizer + plan.ema + aside + sampling + plan.overhead
    return plan


# -- the caching phase and host memory ---------------------------------------------------------------------------

# Calibrated on an H200 (BENCHMARKS.md): FLUX's VAE encoding 8 images of 1024x1024 at a time in bf16 peaked at 10.36
# GiB, ~4.9 bytes per pixel per channel of its widest (128-channel) layers; CLIP-L + T5-XXL in bf16 (9.35 GiB of
# weights) peaked at 11.01 GiB for 8 captions of 512 tokens: ~106 bytes per token per hidden unit.
VAE_BYTES_PER_PIXEL = 128 * 2 * 4.9
VAE_WEIGHT_BYTES = 84e6 * 2
TEXT_BYTES_PER_TOKEN_UNIT = 106.0


def caching_peaks(
    recipe: ModelRecipe, text_quantization: str, encode_batch: int, side: int
) -> tuple[float, float, float, list[str]]:
    """GiB of GPU memory while the cache encodes captions and images, host GiB while the text encoders load, and notes.

    The caption peak is 0 with a note when the text encoders' architecture is not known here (an unknown hub id).
    Planned once per process for the same model and arguments (the alternatives the planner tries share them)."""
    key = repr((_model_key(recipe), text_quantization, encode_batch, side))
    if key not in _CACHING:
        _remember(_CACHING, key, _caching_peaks(recipe, text_quantization, encode_batch, side))
    text, images, host, notes = _CACHING[key]
    return text, images, host, list(notes)


_CACHING: dict[str, tuple[float, float, float, list[str]]] = {}


def _caching_peaks(
    recipe: ModelRecipe, text_quantization: str, encode_batch: int, side: int
) -> tuple[float, float, float, list[str]]:
    from lightning_lora.families.encoders import skeleton

    family, source = recipe.family, recipe.source
    images = (VAE_WEIGHT_BYTES + encode_batch * side * side * VAE_BYTES_PER_PIXEL) / GIB + FIXED_OVERHEAD_GIB
    configs = family.text_encoder_configs(source)
    if not configs:
        return 0.0, images, 0.0, ["caching captions: the text encoders' architecture is not known here"]
    weights = activations = host = 0.0
    for config in configs.values():
        model = skeleton(config, source.dtype)
        keep = [rf"(^|\.){re.escape(m)}$" for m in getattr(model, "_keep_in_fp32_modules", None) or []]
        # As quantize_text_encoders stores them: unquantized layers stay in the load dtype.
        weights += weight_bytes(model, text_encoder_precision(text_quantization, source.dtype, keep))
        host += weight_bytes(model, text_encoder_precision("none", source.dtype, []))
        hidden = config.get("d_model") or config.get("hidden_size") or 0
        # CLIP reads its 77 positions; T5 and the LLM encoders (Qwen3...) the family's text length.
        clip = str(config.get("_class", "")).startswith("CLIP")
        tokens = int(config.get("max_position_embeddings", 77)) if clip else family.text_tokens
        activations = max(activations, encode_batch * tokens * hidden * TEXT_BYTES_PER_TOKEN_UNIT)  # one at a time
    text = (weights + activations) / GIB + FIXED_OVERHEAD_GIB
    return text, images, host / GIB, []


# -- the planner's library API: a run's plan (the changes that make it fit: lightning_lora.plan.search) -------------


def optimizer_name(factory: Any) -> str:
    """The class name of the optimizer ``factory`` (an injected ``OptimizerCallable``) builds, read without calling it
    (a factory is code; planning runs none): an optimizer class itself, or a ``functools.partial`` of one (what
    jsonargparse makes of a config's ``model.optimizer``, and ``partial(AdamW8bit, lr=1e-4)`` in Python). AdamW, the
    default, for any other callable."""
    candidates = (factory, getattr(factory, "func", None), *getattr(factory, "args", ()))
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer):
            return candidate.__name__
    return "AdamW"


def plan_for(
    recipe: ModelRecipe,
    data: DataRecipe,
    optimizer: str = "AdamW",
    sample_size: tuple[int, int] | None = None,
    shards: int = 1,
    ema_copies: int = 0,
) -> MemoryPlan:
    """The plan of a run: ``recipe`` at the data's largest resolution and batch size, the family's text length, the
    most control images a target of the data has (edit training), on each GPU (``shards``: :func:`plan_training`;
    :func:`~lightning_lora.model.parallel.shard_count` of a trainer or a config; ``ema_copies``: a ``LoraEMA``'s copies
    of the LoRA)."""
    side = data.resolution
    text_len = recipe.family.text_tokens
    plan = plan_training(
        recipe,
        side,
        side,
        data.batch_size,
        text_len,
        optimizer=optimizer,
        sample_size=sample_size,
        shards=shards,
        controls=data.controls,
        ema_copies=ema_copies,
    )
    if data.controls:
        plan.notes.append(
            f"edit pairs: {data.controls} control image(s) per target, planned at the target's size (their tokens "
            f"join the image's: {1 + data.controls}x the image tokens)"
        )
    plan.caching_text, plan.caching_images, text_host, notes = caching_peaks(
        recipe, data.text_encoder_quantization, data.encode_batch_size, side
    )
    plan.notes += notes
    model = denoiser_skeleton(recipe)  # meta device: shapes only
    if any(folder.masks for folder in (*data.folders, *data.val_folders)):
        # The masked loss: the weights in the prediction's layout and their product with the squared error (float32).
        config: Any = model.config  # a diffusers FrozenDict
        latent = recipe.family.cached_latent_shape(dict(config), side, side)
        masks = 2 * 4 * data.batch_size * math.prod(latent) / GIB
        plan.transient += masks
        plan.notes.append(f"masks: {masks * 1024:.1f} MiB more in the loss (loss weights per latent element)")
    # Loading passes the base's weights through CPU memory in its dtype; offloaded blocks stay there, pinned.
    base = weight_bytes(model, BF16(dtype=recipe.precision.dtype))
    sizes = recipe.precision.module_weight_bytes(model)
    pinned = sum(sizes[id(m)] for block in offloaded_blocks(model, recipe.offload_blocks) for m in block.modules())
    plan.host = max((base + pinned) / GIB, text_host)
    return plan
