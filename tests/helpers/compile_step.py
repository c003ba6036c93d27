"""Compiled training steps of the tiny FLUX in a fresh process, for the compile-cache test
(tests/test_compile_cache.py).

``python -m helpers.compile_step MODEL_DIR RUN [RUN...]`` with tests/ on ``PYTHONPATH`` and the caller's
``TORCHINDUCTOR_CACHE_DIR``. Each ``RUN`` is ``rank=R,seed=S,lr=LR,size=HxW`` (any may be left out): it builds the
LoRA model through the real code, compiles its repeated blocks with
:func:`~lightning_lora.model.assembly.compile_repeated_blocks`, and runs one forward, backward and AdamW step. The
process prints one JSON line: per run, torch's own counters of that run (inductor's FX graph cache, AOTAutograd's cache,
Dynamo's graphs), the loss and the step's seconds.

To keep the test short, the model keeps ``--double`` double-stream and ``--single`` single-stream blocks of the tiny
FLUX (default: 0 and 1, one compiled graph forward and one backward, the least that exercises both caches).
``--handover``: the attention hands its backward the gradient through
:class:`~lightning_lora.model.attention.OutputGradientInOutputLayout`, as it does wherever cuDNN's attention is allowed
(every CUDA run), so the compiled graph holds a custom ``autograd.Function``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

COUNTERS = {
    "fxgraph_cache_hit": ("inductor", "fxgraph_cache_hit"),
    "fxgraph_cache_miss": ("inductor", "fxgraph_cache_miss"),
    "fxgraph_cache_bypass": ("inductor", "fxgraph_cache_bypass"),
    "autograd_cache_hit": ("aot_autograd", "autograd_cache_hit"),
    "autograd_cache_miss": ("aot_autograd", "autograd_cache_miss"),
    "autograd_cache_bypass": ("aot_autograd", "autograd_cache_bypass"),
    "graphs": ("stats", "unique_graphs"),
}


def _parse_run(text: str) -> dict[str, Any]:
    run: dict[str, Any] = {"rank": 2, "seed": 0, "lr": 1e-3, "size": (32, 32)}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        if key == "size":
            height, width = value.split("x")
            run["size"] = (int(height), int(width))
        else:
            run[key] = float(value) if key == "lr" else int(value)
    return run


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {name: int(counters[group][key]) for name, (group, key) in COUNTERS.items()}


def step(model_dir: str, run: dict[str, Any], double: int, single: int) -> dict[str, Any]:
    """One compiled training step with the settings of ``run``; torch's counters of this step only."""
    from helpers.models import build_model, random_inputs
    from lightning_lora.families.base import ModelSource
    from lightning_lora.families.flux import Flux
    from lightning_lora.lora import LoraOptions
    from lightning_lora.model.assembly import compile_repeated_blocks

    before = _counts()
    torch.manual_seed(run["seed"])
    family = Flux(max_sequence_length=8)
    model = build_model(family, ModelSource(model_dir, dtype=torch.float32), LoraOptions(rank=run["rank"]))
    for name, kept in (("transformer_blocks", double), ("single_transformer_blocks", single)):
        blocks: torch.nn.ModuleList = getattr(model, name)
        setattr(model, name, blocks[:kept])
    compile_repeated_blocks(model, extra=family.compiling.regions, streams=family.compiling.stream_sources)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=run["lr"])
    start = time.perf_counter()
    inputs = random_inputs(family, model, 1, seed=run["seed"], size=run["size"])
    loss = model(**inputs)[0].square().mean()
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    after = _counts()
    return {k: after[k] - before[k] for k in after} | {"loss": loss.item(), "step_s": round(seconds, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("runs", nargs="+", help="rank=R,seed=S,lr=LR,size=HxW")
    parser.add_argument("--double", type=int, default=0, help="double-stream blocks kept")
    parser.add_argument("--single", type=int, default=1, help="single-stream blocks kept")
    parser.add_argument(
        "--handover",
        action="store_true",
        help="attention through lightning_lora.model.attention's gradient handover (an autograd.Function), as on CUDA",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.handover:
        from lightning_lora.model.attention import hand_sdpa_matching_gradients

        hand_sdpa_matching_gradients(True)
    results = [step(args.model_dir, _parse_run(text), args.double, args.single) for text in args.runs]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
