"""FSDP2 over a bf16 base carrying a float32 LoRA, two CPU processes over gloo (:mod:`lightning_lora.model.sharding`):
each rank holds half the weights, and the sharded model computes the LoRA gradients and the optimizer step of the
unsharded one.

Tolerance: the forward and backward run the same bf16 / float32 operations on the same gathered weights (an all-gather
copies bits), so each rank's local gradient is the unsharded model's bit for bit. What differs is the average over
the two ranks: FSDP2 reduce-scatters it over gloo, which may divide each rank's gradient by 2 before the sum where the
reference sums first; that is one float32 rounding of a float32 value (relative 6e-8), hence ``rtol=1e-6``. The AdamW
step divides by ``sqrt(v)``, which can amplify that rounding for a gradient near zero: ``atol=1e-6`` on the weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import free_port, random_inputs

pytestmark = pytest.mark.subprocess


def _worker(rank: int, world: int, port: int, model_dir: str, results: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_lora.families.base import ModelSource
    from lightning_lora.families.flux import Flux
    from lightning_lora.lora import LoraOptions, trainable_parameters
    from lightning_lora.model.assembly import build_lora_model
    from lightning_lora.model.parallel import LoraFSDPStrategy
    from lightning_lora.model.recipe import ModelRecipe
    from lightning_lora.model.sharding import local_parameter_bytes, shard_base

    torch.set_num_threads(1)
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        family = Flux(max_sequence_length=16)
        recipe = ModelRecipe(family, ModelSource(model_dir, dtype=torch.bfloat16), lora=LoraOptions(rank=4, alpha=8))

        def build() -> torch.nn.Module:
            torch.manual_seed(0)  # the same LoRA initialization on every rank and in both models
            model = build_lora_model(recipe)
            for p in trainable_parameters(model):  # lora_B starts at zero: give it values, so lora_A gets gradients
                if p.abs().max() == 0:
                    torch.nn.init.normal_(p, std=0.1)
            return model

        reference, sharded = build(), build()
        full_bytes = local_parameter_bytes(reference)
        blocks = shard_base(sharded, init_device_mesh("cpu", (world,)))
        inputs = [random_inputs(family, reference, seed=r, dtype=torch.bfloat16) for r in range(world)]

        # The unsharded model: the average of every rank's gradient, then one AdamW step.
        ref_opt = torch.optim.AdamW(trainable_parameters(reference), lr=1e-2)
        for batch in inputs:
            (reference(**batch)[0].float().square().mean() / world).backward()
        ref_opt.step()
        ref_weights = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
        ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        # The sharded model: this rank's batch only; FSDP2 averages the gradients over the ranks.
        opt = torch.optim.AdamW(trainable_parameters(sharded), lr=1e-2)
        sharded(**inputs[rank])[0].float().square().mean().backward()
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.grad is not None}
        opt.step()
        weights = {n: p.full_tensor() for n, p in sharded.named_parameters() if p.requires_grad}
        assert all(isinstance(p, DTensor) for p in sharded.parameters())

        # Gradient accumulation over two micro-batches through the strategy's block_backward_sync (Lightning enters
        # it for every micro-batch but the last): nothing reduced after the first, the sum of both after the second.
        strategy = LoraFSDPStrategy()
        strategy.model = sharded
        opt.zero_grad(set_to_none=True)
        second = [random_inputs(family, reference, seed=world + r, dtype=torch.bfloat16) for r in range(world)]
        with strategy.block_backward_sync():
            sharded(**inputs[rank])[0].float().square().mean().backward()
        reduced_early = sum(p.grad is not None for p in sharded.parameters())
        sharded(**second[rank])[0].float().square().mean().backward()
        accumulated = {n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.grad is not None}
        with torch.no_grad():  # the reference at the sharded model's weights (after its step), both micro-batches
            for (_, ref), (_, p) in zip(reference.named_parameters(), sharded.named_parameters(), strict=True):
                ref.copy_(p.full_tensor())
        reference.zero_grad(set_to_none=True)
        for batch in [*inputs, *second]:
            (reference(**batch)[0].float().square().mean() / world).backward()
        if rank == 0:
            torch.save(
                {
                    "full_bytes": full_bytes,
                    "local_bytes": local_parameter_bytes(sharded),
                    "blocks": len(blocks),
                    "dtypes": sorted({str(p.dtype) for p in sharded.parameters()}),
                    "grads": grads,
                    "ref_grads": ref_grads,
                    "weights": weights,
                    "ref_weights": ref_weights,
                    "reduced_early": reduced_early,
                    "accumulated": accumulated,
                    "ref_accumulated": {n: p.grad for n, p in reference.named_parameters() if p.grad is not None},
                },
                results,
            )
    finally:
        dist.destroy_process_group()


def test_fsdp2_halves_a_bf16_base_and_trains_the_same_lora_accumulating_without_a_reduce_per_micro_batch(
    tiny_flux_dir: Path, tmp_path: Path
) -> None:
    results = tmp_path / "rank0.pt"
    mp.start_processes(
        _worker, args=(2, free_port(), str(tiny_flux_dir), str(results)), nprocs=2, start_method="spawn", join=True
    )
    out = torch.load(results, weights_only=True)
    assert out["dtypes"] == ["torch.bfloat16", "torch.float32"] and out["blocks"] == 4  # tiny FLUX: 2 + 2 blocks
    # Each rank holds half of every parameter (a dimension of odd length is padded by one row).
    assert abs(out["local_bytes"] - out["full_bytes"] / 2) < 0.02 * out["full_bytes"], out
    assert out["grads"].keys() == out["ref_grads"].keys() and out["grads"]
    assert all("lora_" in name for name in out["grads"])  # the frozen base gets no gradient
    for name, grad in out["ref_grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(out["grads"][name], grad, rtol=1e-6, atol=1e-9)
    for name, weight in out["ref_weights"].items():
        torch.testing.assert_close(out["weights"][name], weight, rtol=1e-6, atol=1e-6)
    # Accumulation: the first micro-batch's gradients were not reduce-scattered (no rank got its shard yet), and the
    # second backward reduced the sum of both: the unsharded model's gradient over the 4 batches, averaged per rank.
    assert out["reduced_early"] == 0
    assert out["accumulated"].keys() == out["ref_accumulated"].keys() and out["accumulated"]
    for name, grad in out["ref_accumulated"].items():
        torch.testing.assert_close(out["accumulated"][name], grad, rtol=1e-5, atol=1e-8)
