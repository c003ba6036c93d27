"""What share of its eager forward's saved tensors a family's blocks keep when ``model.compile_blocks`` compiles them:
the number the memory planner scales its eager count by (:attr:`DiffusionFamily.planning.compiled_saved_fraction`).

The planner counts what autograd saves on the meta device, where nothing can be compiled; inductor fuses elementwise
chains and recomputes cheap ones in the backward, so compiled blocks keep less (FLUX.1: 0.78, calibrated on the GPU;
Z-Image: 0.5, whose RMSNorms keep float32 copies that fuse away). This measures the share on the CPU, with real
tensors at the real width:

1. the family's real denoiser config (a known hub id's shipped architecture, or a local folder), with the repeated
   blocks cut to one of each kind and then to one more of each (``--blocks``: the config keys holding the counts), built
   in bf16 with random weights, frozen, the project's LoRA injected (rank 16 on the ``attention`` preset by default),
   as the planner builds it;
2. one forward pass on the planner's batch (:meth:`DiffusionFamily.example_inputs`, random values), with the bytes
   autograd saves counted by :func:`lightning_lora.plan.live_bytes.saved_activation_bytes` (PyTorch's own CPU SDPA: on a
   bf16 input without a mask it is its fused flash kernel, which keeps what the GPU kernels keep);
3. the same after :func:`lightning_lora.model.assembly.compile_repeated_blocks` (one forward and backward first, so the
   graphs are compiled).

The difference between the models with one and with two blocks of a kind is one block of that kind; the share is
reported per block kind and for the whole real model (its block counts, plus what is outside the blocks). ``share`` is
compiled over eager, both as they ran on the CPU; ``fraction`` is the compiled bytes over the planner's own eager count
(the same eager model counted as the planner counts it, as the GPU runs it: bf16 autocast, the fused ``rms_norm``,
attention's fused kernels), the value :attr:`DiffusionFamily.planning.compiled_saved_fraction` takes.

    python dev/probes/saved_share.py --family flux2 --pretrained black-forest-labs/FLUX.2-klein-base-4B \\
        --blocks num_layers num_single_layers --h 1024 --w 1024 --tlen 512

Prints one JSON line. Slow on a small CPU (inductor compiles each block class, then full-width forward passes).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def _build(family: Any, source: Any, config: dict[str, Any], rank: int, targets: str) -> torch.nn.Module:
    from lightning_lora.families.base import build_from_config
    from lightning_lora.lora import LoraOptions
    from lightning_lora.plan.estimate import add_counted_lora

    torch.manual_seed(0)
    model = build_from_config(family.denoiser_cls(), config, source.dtype, device="cpu")
    model.requires_grad_(False)
    add_counted_lora(model, family, LoraOptions(rank=rank, targets=targets), source.dtype)
    return model.train()


def _inputs(family: Any, model: torch.nn.Module, a: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    inputs = family.example_inputs(model, 1, a.h, a.w, a.tlen, device="cpu", dtype=dtype)
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            inputs[key] = torch.rand_like(value) if key in ("timestep", "guidance") else torch.randn_like(value)
    return inputs


def _saved(family: Any, model: torch.nn.Module, inputs: dict[str, Any], compiled: bool) -> dict[str, float]:
    from lightning_lora.model.assembly import compile_repeated_blocks
    from lightning_lora.plan.live_bytes import saved_activation_bytes

    if compiled:
        compile_repeated_blocks(model, extra=family.compiling.regions, streams=family.compiling.stream_sources)
        out = model(**inputs)
        (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
    saved, _, _ = saved_activation_bytes(model, inputs, attention="as_run")
    if compiled:
        return {"compiled": saved}
    # The planner's count: as the GPU runs it (bf16 autocast, the fused rms_norm, attention's fused kernels).
    planned, _, _ = saved_activation_bytes(model, inputs, autocast=torch.bfloat16)
    return {"eager": saved, "planner": planned}


def main() -> None:
    from lightning_lora.families import FAMILIES, ModelSource

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    p.add_argument("--pretrained", required=True, help="a known hub id or a local diffusers folder")
    p.add_argument("--blocks", nargs="+", required=True, help="the config keys holding the block counts")
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--w", type=int, default=1024)
    p.add_argument("--tlen", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="attention")
    a = p.parse_args()

    family = FAMILIES[a.family]()
    source = ModelSource(a.pretrained, dtype=torch.bfloat16)
    real = family.denoiser_config(source, family.denoiser_cls().load_config)
    base = {**real, **{key: 1 for key in a.blocks}}
    variants = {"one_each": base, **{f"plus_{key}": {**base, key: 2} for key in a.blocks}}
    counts: dict[str, dict[str, float]] = {}
    start = time.perf_counter()
    for name, config in variants.items():
        counts[name] = {}
        for compiled in (False, True):
            torch._dynamo.reset()
            model = _build(family, source, config, a.rank, a.targets)
            counts[name].update(_saved(family, model, _inputs(family, model, a, source.dtype), compiled))
            del model
    result: dict[str, Any] = {"family": a.family, "pretrained": a.pretrained, "h": a.h, "w": a.w, "tlen": a.tlen}
    modes = ("eager", "planner", "compiled")
    whole = {mode: counts["one_each"][mode] for mode in modes}
    for key in a.blocks:
        block = {mode: counts[f"plus_{key}"][mode] - counts["one_each"][mode] for mode in modes}
        result[key] = {
            "blocks": real[key],
            "eager_MiB": round(block["eager"] / 2**20, 1),
            "planner_MiB": round(block["planner"] / 2**20, 1),
            "compiled_MiB": round(block["compiled"] / 2**20, 1),
            "share": round(block["compiled"] / block["eager"], 3),
            "fraction": round(block["compiled"] / block["planner"], 3),
        }
        for mode in whole:
            whole[mode] += (real[key] - 1) * block[mode]
    result["whole_model"] = {
        "eager_GiB": round(whole["eager"] / 2**30, 3),
        "planner_GiB": round(whole["planner"] / 2**30, 3),
        "compiled_GiB": round(whole["compiled"] / 2**30, 3),
        "share": round(whole["compiled"] / whole["eager"], 3),
        "fraction": round(whole["compiled"] / whole["planner"], 3),
    }
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
