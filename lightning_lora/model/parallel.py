"""Which multi-GPU strategies go with which model options.

DDP works with every precision backend: each rank holds its own copy of the frozen (possibly quantized) base and
only the LoRA gradients are averaged. The sharding strategies (FSDP, FSDP2 through ``ModelParallelStrategy``,
DeepSpeed) split parameters into flat shards, which a quantized base cannot go through: bitsandbytes' 4-bit
parameters carry their quantization state beside the tensor, our FP8 layers keep a scale per channel, and
bitsandbytes with FSDP2 has open corruption bugs. They are refused up front, naming the fix.

``trainer.strategy: ddp`` (or ``auto`` with several devices) becomes :class:`LoraDDPStrategy`: Lightning's DDP
with the settings that suit a frozen base, measured on 2 H200s (BENCHMARKS.md).

``trainer.strategy: fsdp`` becomes :class:`LoraFSDPStrategy`: an unquantized (bf16) base sharded over the GPUs with
FSDP2 (:mod:`lightning_lora.model.sharding`), for a base whose weights do not fit one GPU. It is a subclass of
Lightning's ``ModelParallelStrategy`` (FSDP2), not Lightning's ``FSDPStrategy`` (FSDP1): FSDP1 takes only its own
precision plugin (ours own the base format), flattens a block's bf16 base and float32 LoRA into one tensor of one dtype,
and refuses a CPU, so it could not be tested here. A ``FSDPStrategy`` or a plain ``ModelParallelStrategy`` given by
class path is refused naming ``trainer.strategy: fsdp``: the plain one would shard nothing (our module does the sharding
only for ours) and train each rank apart, without averaging the gradients.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Collection, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_lora.errors import ConfigError
from lightning_lora.model.recipe import ModelRecipe

__all__ = [
    "SHARDING_STRATEGIES",
    "LoraDDPStrategy",
    "LoraFSDPStrategy",
    "check_strategy",
    "no_buffer_sync",
    "prepare_model",
    "resolve_strategy",
    "runs_forward_on_every_rank",
    "shard_count",
    "shards_of",
]

SHARDING_STRATEGIES: tuple[type[Strategy], ...] = (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy)


def check_strategy(strategy: Strategy, recipe: ModelRecipe) -> None:
    """Raise a :class:`ConfigError` for a sharding strategy over a quantized or partly offloaded base or CUDA-graphed
    blocks, or for a sharding strategy other than :class:`LoraFSDPStrategy` and DeepSpeed."""
    if not isinstance(strategy, SHARDING_STRATEGIES):
        return
    name = type(strategy).__name__
    if recipe.cuda_graphs:
        raise ConfigError(
            f"trainer.strategy: {name} shards the base model's weights and gathers them anew as each block runs, "
            "which does not work with model.cuda_graphs: true (CUDA graphs replay the blocks on fixed weight "
            "addresses). Use trainer.strategy: ddp, or model.cuda_graphs: false to shard the base."
        )
    offload_blocks = recipe.offload_blocks
    if offload_blocks:
        raise ConfigError(
            f"trainer.strategy: {name} shards the base model's weights, which does not work with "
            f"model.offload_blocks: {offload_blocks} (offloading swaps the weights of whole blocks in and out). Use "
            "trainer.strategy: ddp, or model.offload_blocks: 0 to shard the base."
        )
    if recipe.precision.shardable:
        _refuse_foreign_fsdp(strategy)
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
    :class:`LoraDDPStrategy`, ``fsdp`` as :class:`LoraFSDPStrategy`; anything else unchanged. Lightning's FSDP (the
    ``fsdp_*`` names, a ``FSDPStrategy``) and a plain ``ModelParallelStrategy`` are refused naming ``fsdp``."""
    several = (isinstance(devices, int) and devices > 1) or (isinstance(devices, list | tuple) and len(devices) > 1)
    if strategy == "ddp" or (strategy == "auto" and (several or num_nodes > 1)):
        return LoraDDPStrategy()
    if strategy == "fsdp":
        return LoraFSDPStrategy()
    if isinstance(strategy, str) and strategy.startswith("fsdp"):
        raise ConfigError(
            f"trainer.strategy: {strategy} is one of Lightning's FSDP (FSDP1) variants, which lightning-lora does not "
            "run (it takes only Lightning's own precision plugin, and would average the LoRA gradients in bf16). Use "
            "trainer.strategy: fsdp (lightning_lora.model.parallel.LoraFSDPStrategy: FSDP2 sharding of a bf16 base), "
            "or ddp."
        )
    if isinstance(strategy, Strategy):
        _refuse_foreign_fsdp(strategy)
    return strategy


def _refuse_foreign_fsdp(strategy: Strategy) -> None:
    if isinstance(strategy, LoraFSDPStrategy) or not isinstance(strategy, FSDPStrategy | ModelParallelStrategy):
        return
    what = (
        "Lightning's FSDP (FSDP1) takes only its own precision plugin (lightning-lora's plugins own the base format) "
        "and refuses a block of bf16 base and float32 LoRA"
        if isinstance(strategy, FSDPStrategy)
        else "a plain ModelParallelStrategy would neither shard the base nor average the LoRA gradients"
    )
    raise ConfigError(
        f"trainer.strategy: {type(strategy).__name__}: {what}. Use trainer.strategy: fsdp "
        "(lightning_lora.model.parallel.LoraFSDPStrategy: FSDP2 sharding of a bf16 base over every GPU), or ddp."
    )


def prepare_model(strategy: Strategy, denoiser: nn.Module) -> None:
    """What ``strategy`` needs done to the denoiser once LoRA is injected (``LoraModule.configure_model``): shard it
    under :class:`LoraFSDPStrategy`; nothing under any other strategy."""
    if isinstance(strategy, LoraFSDPStrategy):
        strategy.shard(denoiser)


def shard_count(strategy: Any, devices: Any = 1, num_nodes: Any = 1) -> int:
    """How many GPUs a run shards the frozen base over (what the memory planner divides by): every process of the run,
    ``devices`` per node times ``num_nodes`` as a trainer or its config gives them, under ``trainer.strategy: fsdp``
    (the name or a :class:`LoraFSDPStrategy`); 1 under any other strategy, where each GPU holds the whole base.
    ``devices`` ``auto`` / ``-1`` count this machine's GPUs (1 without any)."""
    if not (isinstance(strategy, LoraFSDPStrategy) or strategy == "fsdp"):
        return 1
    return _device_count(devices) * max(int(num_nodes or 1), 1)


def shards_of(trainer: Trainer) -> int:
    """:func:`shard_count` of a built trainer."""
    return shard_count(trainer.strategy, trainer.num_devices, trainer.num_nodes)


def _device_count(devices: Any) -> int:
    if isinstance(devices, list | tuple):
        return max(len(devices), 1)
    text = str(devices).strip() if devices is not None else "auto"
    if "," in text:
        return max(len([d for d in text.split(",") if d.strip()]), 1)
    if text in ("auto", "-1"):
        return max(torch.cuda.device_count(), 1)
    try:
        return max(int(text), 1)
    except ValueError as e:
        raise ConfigError(f"trainer.devices: {devices!r} is not a device count, a list of GPU ids or 'auto'.") from e


def runs_forward_on_every_rank(strategy: Strategy) -> bool:
    """Whether every rank must take part in each forward of the model (its weights are sharded: each forward gathers
    them from all ranks), so that a forward of rank 0 alone (sampling) would wait forever."""
    return isinstance(strategy, LoraFSDPStrategy)


class LoraFSDPStrategy(ModelParallelStrategy):
    """A frozen bf16 base sharded over every GPU of every node with FSDP2, the LoRA trained on top (``trainer.strategy:
    fsdp``; see :mod:`lightning_lora.model.sharding` for what it costs and when DDP is better).

    Lightning's ``ModelParallelStrategy`` with one data-parallel dimension over all processes (no tensor parallelism),
    and checkpoints that hold what a DDP run's hold: the full (gathered) LoRA tensors and optimizer state in a single
    file written by global rank 0 through the trainer's ``CheckpointIO`` (ours writes atomically). So a checkpoint of a
    sharded run resumes on one GPU or under DDP, and the other way round:

    * saving gathers only the trainable parameters (``ModelParallelStrategy`` with ``save_distributed_checkpoint=False``
      would gather the whole base, every weight of it, onto rank 0's CPU at each checkpoint, to drop it after);
    * the optimizer state is saved as ``optimizer.state_dict()`` saves it (index keys, full tensors), not re-keyed;
    * loading reads the file on every rank and keeps each rank's shard of each tensor, and Lightning restores the
      optimizer after the module's ``on_load_checkpoint`` (which reconciles the config's settings with it), as under
      DDP.
    """

    def __init__(self, process_group_backend: str | None = None, timeout: timedelta | None = None) -> None:
        from torch.distributed.constants import default_pg_timeout

        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            process_group_backend=process_group_backend,
            timeout=timeout or default_pg_timeout,
        )

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # one dimension: every process holds 1/N
        super().setup_environment()

    def shard(self, denoiser: nn.Module) -> None:
        """Shard ``denoiser`` (LoRA injected) over every process; on every rank, before the optimizer is built."""
        from lightning_lora.model.sharding import shard_base

        shard_base(denoiser, self.device_mesh["data_parallel"])

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's loop enters this for every micro-batch of ``trainer.accumulate_grad_batches`` but the last, as
        for DDP's ``no_sync``: their LoRA gradients stay unsharded on each rank and the last micro-batch's backward
        reduce-scatters the sum once (without it, ``ModelParallelStrategy`` reduce-scatters after every micro-batch)."""
        from lightning_lora.model.sharding import no_gradient_sync

        assert self.model is not None
        with no_gradient_sync(self.model):
            yield

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from lightning_lora.model.sharding import full_tensor

        assert self.lightning_module is not None
        trainable = [(n, p) for n, p in self.lightning_module.named_parameters() if p.requires_grad]
        return {n: full_tensor(p.detach()) for n, p in trainable}  # every rank: each gather is a collective

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from lightning_lora.model.sharding import full_tensor

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's torch optimizer
        state = optimizer.state_dict()
        full = {key: {k: full_tensor(v) for k, v in values.items()} for key, values in state["state"].items()}
        return {**state, "state": full}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        path = self.broadcast(filepath)  # one file, rank 0's path
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(checkpoint_path)
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        from lightning_lora.model.sharding import shard_like

        assert self.lightning_module is not None
        saved = checkpoint["state_dict"]
        with torch.no_grad():
            for name, param in self.lightning_module.named_parameters():
                if name in saved:
                    param.copy_(shard_like(saved[name], param))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        from lightning_lora.model.sharding import shard_like

        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            ids = [i for group in state["param_groups"] for i in group["params"]]
            by_id = dict(zip(ids, params, strict=True))
            sharded = {
                key: {
                    k: shard_like(v, by_id[key]) if torch.is_tensor(v) and v.shape == by_id[key].shape else v
                    for k, v in values.items()
                }
                for key, values in state["state"].items()
            }
            optimizer.load_state_dict({**state, "state": sharded})
