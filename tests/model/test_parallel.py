"""Sharding strategies are refused for a quantized base, with the fix named; DDP takes every backend."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from helpers import DISTRIBUTED_ENV, precision_for, run_cli, write_config
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_lora.errors import ConfigError
from lightning_lora.families.base import ModelSource
from lightning_lora.families.flux import Flux
from lightning_lora.model.parallel import (
    LoraDDPStrategy,
    LoraFSDPStrategy,
    check_strategy,
    no_buffer_sync,
    resolve_strategy,
    shard_count,
)
from lightning_lora.model.recipe import ModelRecipe


def recipe(mode: str = "none", offload_blocks: int = 0) -> ModelRecipe:
    """A recipe for the hub's FLUX.1-dev (nothing is loaded: a hub id is accepted as it is)."""
    return ModelRecipe(
        Flux(),
        ModelSource("black-forest-labs/FLUX.1-dev"),
        precision=precision_for(mode),
        offload_blocks=offload_blocks,
    )


@pytest.mark.parametrize("strategy", [FSDPStrategy, ModelParallelStrategy])
@pytest.mark.parametrize("mode", ["nf4", "fp8", "fp8_compute"])
def test_sharding_a_quantized_base_is_refused(strategy: type, mode: str) -> None:
    plugin = type(precision_for(mode)).__name__
    with pytest.raises(ConfigError, match=rf"trainer.strategy: {strategy.__name__}.*trainer.plugins: {plugin} .*ddp"):
        check_strategy(strategy(), recipe(mode))


@pytest.mark.parametrize("strategy", [FSDPStrategy, ModelParallelStrategy])
def test_sharding_an_offloaded_base_is_refused(strategy: type) -> None:
    with pytest.raises(ConfigError, match=rf"trainer.strategy: {strategy.__name__}.*offload_blocks: 4.*ddp"):
        check_strategy(strategy(), recipe("none", offload_blocks=4))
    check_strategy(DDPStrategy(), recipe("fp8", offload_blocks=4))


def test_sharding_cuda_graphed_blocks_is_refused_and_ddp_takes_them() -> None:
    """CUDA graphs replay the blocks on the weights' addresses when they were recorded; a sharded base is gathered
    anew as each block runs."""
    graphed = recipe().replace(compile_blocks=True, cuda_graphs=True)
    with pytest.raises(ConfigError, match=r"trainer.strategy: LoraFSDPStrategy.*model.cuda_graphs: true.*ddp"):
        check_strategy(LoraFSDPStrategy(), graphed)
    check_strategy(DDPStrategy(), graphed)
    check_strategy(LoraFSDPStrategy(), graphed.replace(cuda_graphs=False))


@pytest.mark.parametrize("mode", ["none", "nf4", "fp8", "fp8_compute"])
def test_ddp_takes_every_backend_and_fsdp_a_plain_base(mode: str) -> None:
    check_strategy(DDPStrategy(), recipe(mode))
    check_strategy(LoraFSDPStrategy(), recipe())


def test_fsdp_becomes_ours_and_lightnings_fsdp_is_refused_naming_it() -> None:
    assert isinstance(resolve_strategy("fsdp", 2), LoraFSDPStrategy)
    for strategy in ("fsdp_cpu_offload", FSDPStrategy(), ModelParallelStrategy()):
        with pytest.raises(
            ConfigError, match=r"Use trainer.strategy: fsdp \(lightning_lora.model.parallel.LoraFSDPStrategy"
        ):
            resolve_strategy(strategy, 2)
    with pytest.raises(ConfigError, match="Use trainer.strategy: fsdp"):
        check_strategy(FSDPStrategy(), recipe())


@pytest.mark.parametrize(
    ("strategy", "devices", "nodes", "ours"),
    [
        ("ddp", 2, 1, True),
        ("ddp", 1, 2, True),
        ("auto", 1, 2, True),  # Lightning's auto is DDP for several nodes of one device each
        ("auto", "auto", 2, True),
        ("ddp", "auto", 1, True),
        ("auto", 2, 1, True),
        ("auto", [0, 1], 1, True),
        ("auto", 1, 1, False),
        ("auto", "auto", 1, False),
        ("ddp_spawn", 2, 1, False),
    ],
)
def test_ddp_becomes_the_lora_ddp_strategy(strategy: str, devices: object, nodes: int, ours: bool) -> None:
    resolved = resolve_strategy(strategy, devices, nodes)
    assert isinstance(resolved, LoraDDPStrategy) == ours
    if ours:
        assert resolved._ddp_kwargs == {"broadcast_buffers": False, "gradient_as_bucket_view": True}
    else:
        assert resolved == strategy
    # A user's own DDP options win over ours.
    assert LoraDDPStrategy(broadcast_buffers=True)._ddp_kwargs["broadcast_buffers"] is True


@pytest.mark.parametrize(
    ("strategy", "devices", "nodes", "shards"),
    [
        ("fsdp", 2, 1, 2),
        ("fsdp", [0, 1, 2], 1, 3),
        ("fsdp", "0,1", 2, 4),
        ("fsdp", "4", 1, 4),
        (LoraFSDPStrategy(), 2, 3, 6),
        ("fsdp", "auto", 1, max(torch.cuda.device_count(), 1)),
        ("ddp", 4, 1, 1),  # each GPU holds the whole base
        ("auto", 8, 2, 1),
        (None, 2, 1, 1),
    ],
)
def test_shard_count_is_every_process_under_fsdp_only(
    strategy: object, devices: object, nodes: int, shards: int
) -> None:
    assert shard_count(strategy, devices, nodes) == shards


def test_shard_count_names_a_bad_device_count() -> None:
    with pytest.raises(ConfigError, match="trainer.devices: 'two'"):
        shard_count("fsdp", "two")


def test_no_buffer_sync_follows_the_ddp_at_hand() -> None:
    assert no_buffer_sync({"module", "broadcast_buffers"}) == {"broadcast_buffers": False}
    later = {"module", "broadcast_buffers", "forward_sync_buffers", "init_sync_buffers"}
    assert no_buffer_sync(later) == {"forward_sync_buffers": False, "init_sync_buffers": False}
    # A user's own buffer option is kept as given, with nothing of ours beside it.
    assert LoraDDPStrategy(forward_sync_buffers=True)._ddp_kwargs == {
        "forward_sync_buffers": True,
        "gradient_as_bucket_view": True,
    }


def test_the_command_trains_with_lora_ddp(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path) -> None:
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.strategy": "ddp", "trainer.max_steps": 1})
    before = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}  # Lightning sets them in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cli = run_cli(["fit", "--config", str(config)])
        finally:  # the one-process group would keep its port bound for the rest of the session
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    assert isinstance(cli.trainer.strategy, LoraDDPStrategy) and cli.trainer.global_step == 1
    # Our DDP options are the current ones: building DDP warns about none of them.
    assert not [w for w in caught if "buffers" in str(w.message)], [str(w.message) for w in caught]


def test_lightnings_distributed_sampler_is_refused(
    tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_lora.cli import main

    config = write_config(tmp_path, tiny_flux_dir, photos_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--trainer.use_distributed_sampler", "true"])
    assert exit_info.value.code == 2
    assert "trainer.use_distributed_sampler: true would replace" in capsys.readouterr().err
