"""Which multi-GPU strategies go with which model options.

DDP works with every precision backend: each rank holds its own copy of the frozen (possibly quantized) base and
only the LoRA gradients are averaged. The sharding strategies (FSDP, FSDP2 through ``ModelParallelStrategy``,
DeepSpeed) split parameters into flat shards, which a quantized base cannot go through: bitsandbytes' 4-bit
parameters carry their quantization state beside the tensor, our FP8 layers keep a scale per channel, and
bitsandbytes with FSDP2 has open corruption bugs. They are refused up front, naming the fix.

``trainer.strategy: ddp`` (or ``auto`` with several devices) becomes :class:`LoraDDPStrategy`: Lightning's DDP
with the settings that suit a frozen base, measured on 2 H200s (BENCHMARKS.md).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Collection
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_lora.errors import ConfigError
from lightning_lora.recipe import ModelRecipe

__all__ = ["SHARDING_STRATEGIES", "LoraDDPStrategy", "check_strategy", "no_buffer_sync", "resolve_strategy"]

SHARDING_STRATEGIES: tuple[type[Strategy], ...] = (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy)


def check_strategy(strategy: Strategy, recipe: ModelRecipe) -> None:
    """Raise a :class:`ConfigError` for a sharding strategy over a quantized or partly offloaded base."""
    if not isinstance(strategy, SHARDING_STRATEGIES):
        return
    name = type(strategy).__name__
    offload_blocks = recipe.offload_blocks
    if offload_blocks:
        raise ConfigError(
            f"trainer.strategy: {name} shards the base model's weights, which does not work with "
            f"model.offload_blocks: {offload_blocks} (offloading swaps the weights of whole blocks in and out). Use "
            "trainer.strategy: ddp, or model.offload_blocks: 0 to shard the base."
        )
    if recipe.precision.shardable:
        return
    raise ConfigError(
        f"trainer.strategy: {name} shards the base model's weights, which does not work with the "
        f"trainer.plugins: {type(recipe.precision).__name__} base (quantized weights cannot be flattened into shards). "
        "Use trainer.strategy: ddp (every GPU keeps its own quantized copy; only the LoRA gradients are "
        "synchronized), or the lightning_lora.precision.BF16 plugin to shard a bf16 base."
    )


class LoraDDPStrategy(DDPStrategy):
    """Lightning's DDP for a frozen base carrying LoRA.

    * No buffer copies (:func:`no_buffer_sync`): DDP would otherwise copy every buffer from rank 0 before each
      forward. The frozen base is identical on every rank (loaded from the same files), and the FP8 base keeps its
      weights in buffers: that would be gigabytes per step.
    * ``gradient_as_bucket_view=True``: the LoRA gradients live in DDP's all-reduce buckets (no second copy).
    * DDP is built on the current CUDA stream. Lightning builds it on a side stream (for CUDA-graph capture), so the
      gradient accumulators it keeps belong to another stream than the backward pass, which then synchronizes
      across streams on every step and warns "The AccumulateGrad node's stream does not match" with torch 2.10+
      (Lightning issue #21567, fixed upstream by PR #21746; the Lightning this was measured with still has it).

    Any keyword argument of ``DistributedDataParallel`` can still be given and wins over these defaults.
    """

    def __init__(self, **kwargs: Any) -> None:
        if not _BUFFER_OPTIONS & kwargs.keys():
            kwargs.update(no_buffer_sync(inspect.signature(DistributedDataParallel).parameters))
        kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(**kwargs)

    @override
    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        with warnings.catch_warnings():
            # torch 2.11 deprecates broadcast_buffers, yet its own warning says to keep broadcast_buffers=False (its
            # replacement still copies every buffer once at start-up) until init_sync_buffers exists; then
            # no_buffer_sync uses that and this filter matches nothing.
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)


_BUFFER_OPTIONS = frozenset({"broadcast_buffers", "forward_sync_buffers", "init_sync_buffers"})


def no_buffer_sync(ddp_parameters: Collection[str]) -> dict[str, bool]:
    """``DistributedDataParallel`` keywords that never copy buffers between ranks, for a DDP taking ``ddp_parameters``.

    ``broadcast_buffers=False`` until DDP has ``init_sync_buffers`` (``forward_sync_buffers=False`` alone still copies
    every buffer from rank 0 once when DDP is built: gigabytes for an FP8 base).
    """
    if "init_sync_buffers" in ddp_parameters:
        return {"forward_sync_buffers": False, "init_sync_buffers": False}
    return {"broadcast_buffers": False}


def resolve_strategy(strategy: Any, devices: Any, num_nodes: int = 1) -> Any:
    """``ddp`` (or ``auto`` with more than one device, or more than one node: Lightning's ``auto`` is DDP then) as
    :class:`LoraDDPStrategy`; anything else unchanged."""
    several = (isinstance(devices, int) and devices > 1) or (isinstance(devices, list | tuple) and len(devices) > 1)
    if strategy == "ddp" or (strategy == "auto" and (several or num_nodes > 1)):
        return LoraDDPStrategy()
    return strategy
