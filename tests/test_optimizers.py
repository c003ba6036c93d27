"""The optimizers the configs and README name train through the real command and resume with their state
(checkpoints load with ``weights_only=True``, so every optimizer's state must be plain tensors and numbers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cli import run_cli, write_config

OPTIMIZERS = {
    "bitsandbytes.optim.AdamW8bit": {"lr": 0.001},
    "transformers.optimization.Adafactor": {
        "lr": 0.001,
        "scale_parameter": False,
        "relative_step": False,
        "warmup_init": False,
    },
    "prodigyopt.Prodigy": {"lr": 1.0},
}


@pytest.mark.parametrize("class_path", list(OPTIMIZERS))
def test_optimizer_trains_and_resumes(tmp_path: Path, tiny_flux_dir: Path, photos_dir: Path, class_path: str) -> None:
    optimizer = {"class_path": class_path, "init_args": OPTIMIZERS[class_path]}
    config = write_config(tmp_path, tiny_flux_dir, photos_dir, **{"trainer.max_steps": 2, "model.optimizer": optimizer})
    first = run_cli(["fit", "--config", str(config)])
    assert type(first.trainer.optimizers[0]).__name__ == class_path.rsplit(".", 1)[1]
    lora_b = [p for n, p in first.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_b)  # B starts at zero: the optimizer moved it
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["optimizer_states"][0]["state"]
    second = run_cli(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "3"])
    assert second.trainer.global_step == 3
    assert _steps_taken(second.trainer.optimizers[0]) == 3  # restored at 2, then one more (a fresh one would say 1)


def _steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's own step counter: per-parameter ``step`` (AdamW8bit, Adafactor) or Prodigy's group ``k``."""
    group = optimizer.param_groups[0]
    if "k" in group:
        return int(group["k"])
    return int(next(iter(optimizer.state.values()))["step"])
