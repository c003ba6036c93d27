"""``model.memory: auto`` on the CPU, which has no memory of its own: what each rank measures and chooses, faked.

A config loads :class:`FakeMemoryChoice` by class path (``helpers.fake_memory.FakeMemoryChoice``) in the processes
:func:`helpers.cli.fit_in_subprocess` or :func:`helpers.nodes.fit_on_nodes` starts. Building it (when the config is
parsed, before ``fit`` measures anything) makes this process see ``gib[RANK]`` GiB free
(:func:`lightning_lora.hardware.free_memory_gib`; ``RANK`` is the global rank a cluster launcher sets, 0 without one)
and makes the planner's choice for it ``changes[RANK]``: the tiny test model has no setting that saves enough to matter
beside the planner's fixed overhead, so the planner cannot be made to choose differently by the budget alone. When
training starts, each rank writes what it builds (``memory-rank<R>.json`` in the run folder) for the test to compare.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

import lightning_lora.hardware
import lightning_lora.plan


class FakeMemoryChoice(Callback):
    """This rank sees ``gib[RANK]`` GiB free and the planner chooses ``changes[RANK]`` (recipe fields); see above."""

    def __init__(self, gib: list[float], changes: list[dict[str, Any]]) -> None:
        rank = int(os.environ.get("RANK", "0"))
        budget, chosen = float(gib[rank]), dict(changes[rank])

        def free_memory_gib(device: torch.device | str) -> float:
            return budget

        def choose_for_memory(*args: Any, **kwargs: Any) -> lightning_lora.plan.Fit:
            return lightning_lora.plan.Fit(" ".join(f"--model.{k} {v}" for k, v in chosen.items()), 0.1, changes=chosen)

        lightning_lora.hardware.free_memory_gib = free_memory_gib  # type: ignore[assignment]
        lightning_lora.plan.choose_for_memory = choose_for_memory  # type: ignore[assignment]

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        module: Any = pl_module
        built = {
            "memory_settings": module.memory_settings,
            "recipe": module.recipe.memory_settings(),
            "trainer_precision": type(trainer.precision_plugin).__name__,
        }
        path = Path(trainer.default_root_dir) / f"memory-rank{trainer.global_rank}.json"
        path.write_text(json.dumps(built))
