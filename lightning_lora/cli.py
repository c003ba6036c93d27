"""The ``lightning-lora`` command: Lightning's CLI with the run-folder conventions of a LoRA trainer.

``lightning-lora fit --config X.yaml`` is ``LightningCLI(LoraModule, LatentDataModule)`` with these defaults:

* **One run folder** (``trainer.default_root_dir``) holds everything: ``config.yaml`` (the resolved config),
  TensorBoard event files, ``checkpoints/`` (``last.ckpt`` and step checkpoints), ``lora/`` (the exported LoRA) and
  ``samples/``. The TensorBoard logger writes into the folder itself (no ``version_N`` subfolder), so
  ``--ckpt_path last`` finds the previous run's ``last.ckpt`` instead of silently starting over.
* A ``ModelCheckpoint`` that keeps ``last.ckpt`` is added unless the config has one; a :class:`LoraExport` and a
  :class:`FixedEvalLoss` likewise.
* The optimizer and scheduler are injected into the module and built over the LoRA parameters only
  (``auto_configure_optimizers=False``).
* ``config.yaml`` is overwritten on resume (Lightning refuses by default, LT#17115); the seed defaults to 42 so a
  resumed run reuses it.
* A :class:`~lightning_lora.errors.ConfigError` (wrong path, typo, impossible combination) is printed as one line
  naming the option, with exit status 2.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_lora.callbacks.evaluation import FixedEvalLoss
from lightning_lora.callbacks.lora_export import LoraExport
from lightning_lora.callbacks.monitor import ConfigSummary, Throughput, VRAMMonitor
from lightning_lora.callbacks.resume import GracefulStop, RNGState
from lightning_lora.callbacks.samples import SampleImages
from lightning_lora.checkpoint import AtomicCheckpointIO, check_compatible, load_checkpoint, resolve_resume
from lightning_lora.data.datamodule import LatentDataModule
from lightning_lora.errors import ConfigError
from lightning_lora.module import LoraModule, primitive_hparams
from lightning_lora.parallel import check_strategy, resolve_strategy

__all__ = ["LoraCLI", "main"]

DEFAULT_RUN_DIR = "runs/lora"
DEFAULT_CHECKPOINT_EVERY = 250


class LoraCLI(LightningCLI):
    """LightningCLI for :class:`LoraModule` + :class:`LatentDataModule`; see the module docstring."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            LoraModule,
            LatentDataModule,
            save_config_kwargs={"overwrite": True},
            # Our bucket sampler shards batches across ranks itself; Lightning must not replace it.
            trainer_defaults={"default_root_dir": DEFAULT_RUN_DIR, "use_distributed_sampler": False},
            seed_everything_default=42,
            auto_configure_optimizers=False,
            parser_kwargs={"prog": "lightning-lora"},
            args=args,
            run=run,
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._get(self.config_init, "trainer", default={})
        root = Path(config.get("default_root_dir") or DEFAULT_RUN_DIR)
        if config.get("logger") in (None, True):
            config["logger"] = TensorBoardLogger(save_dir=str(root), name="", version="", default_hp_metric=False)
        callbacks = list(config.get("callbacks") or [])
        checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
        if not checkpoints and config.get("enable_checkpointing", True) is not False:
            checkpoints.append(
                ModelCheckpoint(
                    filename="step{step:06d}",
                    auto_insert_metric_name=False,
                    every_n_train_steps=DEFAULT_CHECKPOINT_EVERY,
                    save_last=True,
                    save_top_k=3,  # the three newest: "best" by step number
                    monitor="step",
                    mode="max",
                )
            )
            callbacks.append(checkpoints[-1])
        for cb in checkpoints:
            if cb.dirpath is None:
                cb.dirpath = os.path.realpath(root / "checkpoints")
        if not any(isinstance(c, LoraExport) for c in callbacks):
            callbacks.append(LoraExport())
        if not any(isinstance(c, FixedEvalLoss) for c in callbacks):
            callbacks.append(FixedEvalLoss())
        for required in (RNGState, GracefulStop, VRAMMonitor, Throughput, ConfigSummary):
            if not any(isinstance(c, required) for c in callbacks):
                callbacks.append(required())
        config["callbacks"] = callbacks
        if config.get("use_distributed_sampler"):
            raise ConfigError(
                "trainer.use_distributed_sampler: true would replace lightning-lora's bucket sampler, which already "
                "gives each GPU its share of every batch (one aspect-ratio bucket per step); leave it false."
            )
        config["strategy"] = resolve_strategy(config.get("strategy", "auto"), config.get("devices", "auto"))
        plugins = config.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            config["plugins"] = [*plugins, AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        # Cross-object checks, before any weights load: the data resolution must suit the model family.
        # Every resolution and bucket option against the model family (raises ConfigError naming the option).
        self.datamodule.spec(self.model.family)
        check_strategy(self.trainer.strategy, self.model.quantization.mode, self.model.offload_blocks)
        if torch.cuda.is_available() and self.trainer.strategy.root_device.type == "cuda":
            planned = warn_if_too_big(self.model, self.datamodule, self.trainer.strategy.root_device)
            for cb in self.trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(cb, VRAMMonitor) and planned is not None:
                    cb.planned_gib = planned  # logged beside the measured peak, without planning twice

    def fit(
        self, model: LoraModule, datamodule: LatentDataModule | None = None, ckpt_path: str | None = None, **kwargs: Any
    ) -> None:
        """``trainer.fit``, with ``--ckpt_path last`` resolved to the newest valid checkpoint of the run folder."""
        checkpoint: dict[str, Any] | None = None
        if ckpt_path == "last":
            path, checkpoint = resolve_resume(self._checkpoint_dir())
            ckpt_path = str(path) if path is not None else None
        elif ckpt_path is not None:
            if not Path(ckpt_path).is_file():
                raise ConfigError(f"--ckpt_path: {ckpt_path} does not exist. Use a .ckpt file of a run, or 'last'.")
            checkpoint = load_checkpoint(ckpt_path)
        if checkpoint is not None:
            check_compatible(
                checkpoint.get("hyper_parameters", {}), primitive_hparams(dict(model.hparams)), ckpt_path or ""
            )
        kwargs["weights_only"] = True  # a checkpoint is data, never code
        self.trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, **kwargs)

    def _checkpoint_dir(self) -> Path:
        for cb in self.trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath:
                return Path(cb.dirpath)
        return Path(self.trainer.default_root_dir) / "checkpoints"

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(run_summary(self.trainer), flush=True)


def warn_if_too_big(model: LoraModule, datamodule: LatentDataModule, device: torch.device) -> float | None:
    """Run the memory planner at start and warn before an out-of-memory crash (never blocks the run). Returns the
    predicted training peak in GiB (None when the planner cannot run)."""
    from lightning_lora.plan_cli import plan_for

    try:
        plan = plan_for(model, datamodule)
    except (ConfigError, NotImplementedError, OSError) as e:
        rank_zero_info(f"memory planner skipped: {e}")
        return None
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    need = max(plan.peak_gib, plan.sampling_peak)
    message = f"predicted peak GPU memory {need:.1f} GiB of {total:.1f} GiB ({device})"
    if need > total * 0.95:
        rank_zero_warn(
            f"{message}: this will probably run out of memory. Run `lightning-lora plan --config ... "
            f"--vram {total:.0f}` for options that fit."
        )
    else:
        rank_zero_info(message)
    return plan.peak_gib


def run_summary(trainer: Trainer) -> str:
    """Where a run wrote its outputs, and how to look at them."""
    root = Path(trainer.default_root_dir)
    lines = [f"\nRun folder: {root}  (step {trainer.global_step})"]
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, LoraExport) and cb.last_path is not None:
            lines.append(f"  LoRA (diffusers format):  {cb.last_path}")
            lines.extend(f"  LoRA ({p.name.split('.', 1)[1]}):  {p}" for p in cb.written[-len(cb.formats) :][1:])
        elif isinstance(cb, ModelCheckpoint) and cb.dirpath:
            lines.append(f"  checkpoints:              {cb.dirpath}  (resume: add --ckpt_path last)")
        elif isinstance(cb, SampleImages) and cb.written:
            lines.append(f"  sample images:            {cb.folder(trainer)}")
        elif isinstance(cb, FixedEvalLoss) and len(cb.history) > 1:
            (s0, a), (s1, b) = cb.history[0], cb.history[-1]
            lines.append(f"  fixed eval loss:          {a:.4f} (step {s0}) -> {b:.4f} (step {s1})")
    config = root / "config.yaml"
    if config.is_file():
        lines.append(f"  resolved config:          {config}")
    if any(isinstance(lg, TensorBoardLogger) for lg in trainer.loggers):
        lines.append(f"  TensorBoard:              tensorboard --logdir {root.parent}")
    return "\n".join(lines)


_NOISE = (
    # Lightning: tiny data sets have fewer batches per epoch than the logging interval; logging still works.
    r"The number of training batches .* is smaller than the logging interval",
    r".*isinstance\(treespec, LeafSpec\)",
)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``lightning-lora`` command: ``cache``, ``plan`` and ``export`` are ours, everything else
    (``fit``, ``--help``...) is LightningCLI's."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["export"]:
        from lightning_lora.export_cli import main as export_main

        raise SystemExit(export_main(args[1:]))
    if args[:1] == ["cache"]:
        from lightning_lora.cache_cli import main as cache_main

        raise SystemExit(cache_main(args[1:]))
    if args[:1] == ["plan"]:
        from lightning_lora.plan_cli import main as plan_main

        raise SystemExit(plan_main(args[1:]))
    for pattern in _NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    try:
        LoraCLI(args=argv)
    except ConfigError as e:
        print(f"lightning-lora: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
