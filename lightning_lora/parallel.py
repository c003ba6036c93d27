"""Which multi-GPU strategies go with which model options.

DDP works with every precision backend: each rank holds its own copy of the frozen (possibly quantized) base and
only the LoRA gradients are averaged. The sharding strategies (FSDP, FSDP2 through ``ModelParallelStrategy``,
DeepSpeed) split parameters into flat shards, which a quantized base cannot go through: bitsandbytes' 4-bit
parameters carry their quantization state beside the tensor, our FP8 layers keep a scale per channel, and
bitsandbytes with FSDP2 has open corruption bugs. They are refused up front, naming the fix.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy

from lightning_lora.errors import ConfigError

__all__ = ["SHARDING_STRATEGIES", "check_strategy"]

SHARDING_STRATEGIES: tuple[type[Strategy], ...] = (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy)


def check_strategy(strategy: Strategy, quantization_mode: str) -> None:
    """Raise a :class:`ConfigError` for a sharding strategy over a quantized base."""
    if quantization_mode == "none" or not isinstance(strategy, SHARDING_STRATEGIES):
        return
    name = type(strategy).__name__
    raise ConfigError(
        f"trainer.strategy: {name} shards the base model's weights, which does not work with "
        f"model.quantization.mode: {quantization_mode} (quantized weights cannot be flattened into shards). "
        "Use trainer.strategy: ddp (every GPU keeps its own quantized copy; only the LoRA gradients are "
        "synchronized), or model.quantization.mode: none with a bf16 base to shard it."
    )
