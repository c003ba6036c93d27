"""``lightning-lora plan --config X.yaml [--vram 24]``: predicted peak GPU memory, and what would make it fit.

Reads the same YAML as ``fit`` (any ``fit`` option can follow, e.g. ``--model.lora.rank 32``), builds the model on
the meta device (no weights are read; for a hub id only its config file), and prints the memory by component.
With ``--vram``, it says whether the run fits and which changes would make it fit.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from lightning_lora.errors import ConfigError

__all__ = ["main", "plan_for", "optimizer_name"]


def optimizer_name(module: Any) -> str:
    """The class name of the optimizer the module would build (probed on a dummy parameter)."""
    probe = torch.nn.Parameter(torch.zeros(64, 64))
    try:
        return type(module._optimizer_factory([probe])).__name__
    except Exception:  # noqa: BLE001 - an optimizer that cannot run here (e.g. needs CUDA): assume AdamW
        return "AdamW"


def plan_for(module: Any, datamodule: Any, sample_size: tuple[int, int] | None = None) -> Any:
    from lightning_lora.plan import plan_training

    resolution = getattr(datamodule, "resolution", 512)
    side = max(resolution) if isinstance(resolution, list | tuple) else int(resolution)
    text_len = getattr(module.family, "max_sequence_length", 77)
    return plan_training(
        module, side, side, datamodule.batch_size, text_len, optimizer=optimizer_name(module), sample_size=sample_size
    )


def _alternatives(module: Any, datamodule: Any, vram: float) -> list[str]:
    """Changes (as command-line options) that bring the plan under ``vram``."""
    tries: list[tuple[str, dict[str, Any]]] = []
    if not module.gradient_checkpointing:
        # Fastest first: checkpointing one block in 3 or 2 recomputes less than checkpointing every block.
        for every in (3, 2):
            tries.append(
                (
                    f"--model.gradient_checkpointing true --model.checkpoint_every {every}",
                    {"gradient_checkpointing": True, "checkpoint_every": every},
                )
            )
        tries.append(("--model.gradient_checkpointing true", {"gradient_checkpointing": True, "checkpoint_every": 1}))
    elif getattr(module, "checkpoint_every", 1) > 1:
        tries.append(("--model.checkpoint_every 1", {"checkpoint_every": 1}))
    if not getattr(module, "offload_activations", False):
        flag = "--model.offload_activations true"
        if not module.gradient_checkpointing or getattr(module, "checkpoint_every", 1) > 1:
            flag = f"--model.gradient_checkpointing true --model.checkpoint_every 1 {flag}"
        tries.append((flag, {"gradient_checkpointing": True, "checkpoint_every": 1, "offload_activations": True}))
    for mode in ("fp8", "nf4"):
        if module.quantization.mode != mode:
            quant = dataclasses.replace(module.quantization, mode=mode)
            tries.append((f"--model.quantization.mode {mode}", {"quantization": quant}))
            tries.append(
                (
                    f"--model.quantization.mode {mode} --model.gradient_checkpointing true",
                    {"quantization": quant, "gradient_checkpointing": True, "checkpoint_every": 1},
                )
            )
    fits = []
    for flag, changes in tries:
        try:
            peak = _peak_with(module, datamodule, changes)
        except ConfigError:  # a change the other settings refuse (e.g. NF4 with model.offload_blocks): not a fix
            continue
        if peak <= vram * 0.95:
            fits.append(f"{flag}   (~{peak:.1f} GiB)")
    # Offloading costs PCIe copies per block and step: the fewest blocks that fit.
    for count in OFFLOAD_TRIES:
        try:
            peak = _peak_with(module, datamodule, {"offload_blocks": count})
        except ConfigError:  # more blocks than the model has, or a setting offloading refuses (NF4, compile_blocks)
            break
        if peak <= vram * 0.95:
            fits.append(f"--model.offload_blocks {count}   (~{peak:.1f} GiB; slower by the blocks' copies)")
            break
    return fits


OFFLOAD_TRIES = (3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48)  # 1-2 save nothing: two are on the GPU at once


def _peak_with(module: Any, datamodule: Any, changes: dict[str, Any]) -> float:
    """The planned peak with some of the module's options changed (restored afterwards)."""
    saved = {k: getattr(module, k) for k in changes}
    for k, v in changes.items():
        setattr(module, k, v)
    try:
        return plan_for(module, datamodule).peak_gib
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-lora plan", description=__doc__)
    parser.add_argument("--vram", type=float, default=None, help="GPU memory in GiB to check against (e.g. 24)")
    args, rest = parser.parse_known_args(argv)
    from lightning_lora.cli import LoraCLI

    try:
        cli = LoraCLI(args=rest, run=False)
        plan = plan_for(cli.model, cli.datamodule)
    except ConfigError as e:
        print(f"lightning-lora plan: error: {e}")
        return 2
    except NotImplementedError as e:
        print(f"lightning-lora plan: {e}")
        return 2
    print("Predicted GPU memory (lightning-lora plan):")
    print(plan.report(args.vram))
    if args.vram is not None and plan.peak_gib > args.vram * 0.95:
        options = _alternatives(cli.model, cli.datamodule, args.vram)
        if options:
            print("  these changes would fit:")
            print("\n".join(f"    {o}" for o in options))
        else:
            print("  lower data.resolution or data.batch_size, or use a GPU with more memory")
    return 0
