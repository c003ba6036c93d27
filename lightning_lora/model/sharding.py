"""Shard a frozen bf16 base over the GPUs with FSDP2 (``torch.distributed.fsdp.fully_shard``): each GPU keeps 1/N of
the weights, and gathers one block's full weights just before it runs (forward, and again in the backward).

When this is worth it: a base whose bf16 weights do not fit one GPU beside the activations, 20-32 B parameters
(Qwen-Image, FLUX.2 dev). Below that, DDP (:class:`~lightning_lora.model.parallel.LoraDDPStrategy`) is faster: it moves
only the LoRA gradients between GPUs, where FSDP moves every block's weights twice per step.

Why FSDP2 and not Lightning's ``FSDPStrategy`` (FSDP1):

* FSDP1 flattens each wrapped module's parameters into one flat tensor of one dtype; a bf16 base carrying float32 LoRA
  parameters in the same block is refused ("Must flatten tensors with uniform dtype") unless every LoRA layer is its
  own unit. FSDP2 shards each parameter on its own (a ``DTensor`` per parameter): any mix of dtypes and of
  ``requires_grad``.
* ``FSDPStrategy`` accepts only its own ``FSDPPrecision`` plugin, whose ``bf16-mixed`` gathers the float32 LoRA in bf16
  and averages its gradients in bf16; FSDP2 runs under Lightning's ``ModelParallelStrategy``, which takes any precision
  plugin, and :func:`shard_base` keeps every parameter in its own dtype and averages gradients in float32.
* FSDP1 refuses a CPU-only machine ("FSDP needs a non-CPU accelerator device"), and Lightning refuses ``fsdp`` without
  a GPU; FSDP2 runs on the CPU over gloo, so the sharding is tested in CI (tests/model/test_sharding.py).

Units: each repeated block (the family's ``_repeated_blocks``: FLUX's double and single blocks, a UNet's transformer
blocks) is one unit, and the root holds the rest (embeddings, final norm and projection). Peak weight memory per GPU is
about ``weights / N`` plus one or two gathered blocks in flight.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_lora.model.offload import repeated_blocks

__all__ = ["full_state", "full_tensor", "local_parameter_bytes", "no_gradient_sync", "shard_base", "shard_like"]


def shard_base(denoiser: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """``fully_shard`` each repeated block of ``denoiser`` and then the denoiser itself over ``mesh`` (a 1-D mesh: every
    rank holds an equal share of every parameter). Parameters keep their dtype (bf16 base, float32 LoRA); gradients
    are averaged in float32. Returns the blocks that became their own unit.

    Call it on every rank, after LoRA is injected and before the optimizer is built (the optimizer must see the sharded
    parameters): in ``configure_model`` under Lightning's ``ModelParallelStrategy``, whose ``device_mesh`` it takes.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, output_dtype=None)
    blocks = repeated_blocks(denoiser)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(denoiser, mesh=mesh, mp_policy=policy)
    return blocks


@contextmanager
def no_gradient_sync(module: nn.Module) -> Iterator[None]:
    """Backward passes inside keep each unit's gradients unsharded on this rank, summed over the passes, and the first
    backward after it reduce-scatters the sum once: gradient accumulation without a reduce-scatter per micro-batch (the
    FSDP2 counterpart of DDP's ``no_sync``). Meanwhile each rank holds the whole LoRA's gradients, not 1/N of them."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


def local_parameter_bytes(module: nn.Module) -> int:
    """Bytes of parameters this rank holds: its shard of each sharded parameter, the whole of any other."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def full_tensor(value: Any) -> Any:
    """The whole of a sharded tensor (a ``DTensor``: gathered from every rank, so every rank must call this, in the same
    order); any other value unchanged."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every sharded tensor gathered whole (:func:`full_tensor`: a collective under FSDP, on every rank):
    what a LoRA export or a checkpoint holds, whichever strategy trained it."""
    return {k: full_tensor(v) for k, v in state.items()}


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the whole tensor ``full`` as ``like`` (a sharded parameter, or a tensor of its shape) is
    sharded, on ``like``'s device; ``full`` itself (moved there) when ``like`` is not sharded. Every rank holds ``full``
    (read from a checkpoint), so each takes its own shard without any communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full.to(like.device)
    local = like.to_local()
    return distribute_tensor(full.to(local.device), like.device_mesh, like.placements, src_data_rank=None)
