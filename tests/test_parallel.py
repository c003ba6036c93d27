"""Sharding strategies are refused for a quantized base, with the fix named; DDP takes every backend."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_lora.errors import ConfigError
from lightning_lora.parallel import check_strategy


@pytest.mark.parametrize("strategy", [FSDPStrategy, ModelParallelStrategy])
@pytest.mark.parametrize("mode", ["nf4", "fp8", "fp8_compute"])
def test_sharding_a_quantized_base_is_refused(strategy: type, mode: str) -> None:
    with pytest.raises(ConfigError, match=rf"trainer.strategy: {strategy.__name__}.*quantization.mode: {mode}.*ddp"):
        check_strategy(strategy(), mode)


@pytest.mark.parametrize("mode", ["none", "nf4", "fp8", "fp8_compute"])
def test_ddp_takes_every_backend_and_fsdp_a_plain_base(mode: str) -> None:
    check_strategy(DDPStrategy(), mode)
    check_strategy(FSDPStrategy(), "none")
