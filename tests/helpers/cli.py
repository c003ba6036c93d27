"""The ``lightning-lora`` command in tests: a tiny-run config, the command in-process and in its own process, and
what a fit leaves behind (the fixed evaluation loss, an unchanged user folder)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from lightning_lora.cli.fit import LoraCLI
from lightning_lora.families.base import DiffusionFamily

TESTS = Path(__file__).resolve().parents[1]
"""The tests/ folder (on ``sys.path`` for every test, see tests/conftest.py)."""
REPO = TESTS.parent
"""The repository root (configs/, tools/, docker/...)."""


def write_config(tmp_path: Path, model_dir: Path, photos: Path, **overrides: object) -> Path:
    """A tiny-run config (tiny FLUX, fp32, rank 4): 8 steps, checkpoints every 4, samples at start and end.

    ``overrides`` are dotted keys (``**{"trainer.max_steps": 30}``) set in the config before it is written to
    ``tmp_path / "config.yaml"``; the run folder is ``tmp_path / "run"``, the cache ``tmp_path / "cache"``.
    """
    config: dict = {
        "seed_everything": 7,
        "trainer": {
            "default_root_dir": str(tmp_path / "run"),
            "accelerator": "cpu",
            "devices": 1,
            "precision": "32-true",
            "max_steps": 8,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"every_n_train_steps": 4, "save_last": True, "save_top_k": -1},
                },
                {
                    "class_path": "lightning_lora.callbacks.SampleImages",
                    "init_args": {
                        "prompts": ["a photo of sks cat"],
                        "every_n_steps": 0,
                        "steps": 2,
                        "height": 32,
                        "width": 32,
                    },
                },
            ],
        },
        "model": {
            "pretrained": str(model_dir),
            "family": {"class_path": "lightning_lora.families.Flux", "init_args": {"max_sequence_length": 16}},
            "lora": {"rank": 4, "alpha": 8},
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
        },
        "data": {"images": str(photos), "resolution": 32, "batch_size": 2, "cache_dir": str(tmp_path / "cache")},
    }
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def family_class_path(family: type[DiffusionFamily] | DiffusionFamily) -> str:
    """The class path that chooses ``family`` in a config (``model.family.class_path``)."""
    cls = family if isinstance(family, type) else type(family)
    return f"{cls.__module__}.{cls.__qualname__}"


def family_config(
    tmp_path: Path, model_dir: Path, photos: Path, family: str, init_args: dict[str, Any], **overrides: object
) -> Path:
    """:func:`write_config` with a UNet family (``lightning_lora.families.<family>``); samples with CFG, 3 steps."""
    config = write_config(
        tmp_path,
        model_dir,
        photos,
        **{"model.family": {"class_path": f"lightning_lora.families.{family}", "init_args": init_args}, **overrides},
    )
    data = yaml.safe_load(config.read_text())
    for callback in data["trainer"]["callbacks"]:
        if callback["class_path"].endswith("SampleImages"):
            callback["init_args"].update(guidance_scale=5.0, steps=3)
    config.write_text(yaml.safe_dump(data))
    return config


def run_cli(args: list[str]) -> LoraCLI:
    """``lightning-lora ARGS`` in this process (the fast way); the returned CLI holds the trainer and the model."""
    return LoraCLI(args=args)


DISTRIBUTED_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
)
"""The variables torch.distributed and Lightning read to join a process group (``TORCHELASTIC_RUN_ID`` makes
Lightning take the torchrun environment; ``SLURM_*`` variables, which make it take SLURM's, are dropped too)."""


def command_env(**extra: str) -> dict[str, str]:
    """The environment of a ``lightning-lora`` process a test starts: offline, one thread, tests/ on ``PYTHONPATH``
    (a config may load the callbacks of :mod:`helpers.crash`), plus ``extra``.

    Without any rendezvous variable of this pytest process (an in-process DDP test that ran before keeps its
    MASTER_PORT bound while its process group lives) or of a SLURM job the tests run in: a user's shell has none.
    """
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV and not k.startswith("SLURM_")}
    return env | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path} | extra


def fit_command(config: Path, *extra: str) -> list[str]:
    """``lightning-lora fit --config CONFIG [EXTRA...]`` with this Python."""
    return [sys.executable, "-m", "lightning_lora", "fit", "--config", str(config), *extra]


def fit_in_subprocess(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``lightning-lora fit --config CONFIG [EXTRA...]`` in its own process, offline, as a user runs it."""
    return subprocess.run(fit_command(config, *extra), env=command_env(), capture_output=True, text=True, timeout=300)


def tree_digest(folder: Path) -> str:
    """A hash of every path and file content under ``folder``: equal digests, an untouched folder."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def eval_history(cli: LoraCLI) -> list[tuple[int, float]]:
    """The ``(step, eval/loss)`` pairs the fit's :class:`~lightning_lora.callbacks.FixedEvalLoss` recorded."""
    from lightning_lora.callbacks import FixedEvalLoss

    return next(cb for cb in cli.trainer.callbacks if isinstance(cb, FixedEvalLoss)).history  # type: ignore[attr-defined]


def check_fit_lowers_eval_loss(cli: LoraCLI, factor: float = 0.97) -> None:
    """The fixed evaluation loss was measured before the first and after the last step, and went down by at least
    ``1 - factor`` (3% by default)."""
    evals = eval_history(cli)
    assert evals[0][0] == 0 and evals[-1][0] == cli.trainer.global_step
    assert evals[-1][1] < factor * evals[0][1], f"fixed eval loss did not go down: {evals}"
