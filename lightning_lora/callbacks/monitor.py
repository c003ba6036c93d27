"""What a user watches while a LoRA trains: GPU memory, speed, time left, and the run's resolved config.

* :class:`VRAMMonitor` logs, per logging window and per rank, the peak allocated and reserved GPU memory
  (``torch.cuda.reset_peak_memory_stats`` at each window start, so a window shows its own peak), the static
  footprint once the model is set up, and the memory planner's prediction beside it. The progress bar shows the
  peak. ``torch.cuda`` is also the API of ROCm builds, so it works there unchanged; on the CPU it logs nothing.
* :class:`Throughput` logs optimizer steps per second, images per second (all ranks, all micro-batches) and the
  minutes left to ``max_steps``, from the steps after the first, which may compile (:class:`StepClock`).
* :class:`ConfigSummary` puts the resolved ``config.yaml`` into TensorBoard's Text tab, so the settings of every
  curve are one click away, and the options the config sets into the HParams tab (:func:`run_hparams`).
* :class:`StartSummary` prints, when training starts (after a checkpoint is restored), what the run will do: the steps
  from here to ``max_steps``, the batch, the learning-rate schedule and the rate now, and after a resume which file it
  continues and every setting it took from the config instead of the checkpoint (e.g. a longer schedule).
* :class:`StepProgressBar` counts optimizer steps of ``max_steps`` (Lightning's bars count batches per epoch), with
  the time left from the steps after the first; on stdout, where the run's other lines go through its ``write``
  (:func:`console_line`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_lora.data.recipe import data_recipe
from lightning_lora.module import lora_module

__all__ = [
    "RUN_DEFINING",
    "ConfigSummary",
    "StartSummary",
    "StepProgressBar",
    "Throughput",
    "VRAMMonitor",
    "console_line",
    "flat_options",
    "run_hparams",
    "start_summary",
]

GIB = 2**30


def console_line(text: str) -> None:
    """Print ``text`` on stdout through tqdm's ``write``: a progress bar on the screen is cleared first and drawn again
    below it, so no line is printed over the bar."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def _cuda(pl_module: LightningModule) -> bool:
    return pl_module.device.type == "cuda" and torch.cuda.is_available()


class VRAMMonitor(Callback):
    """Peak GPU memory per logging window and rank, the static footprint, and the planner's prediction.

    Args:
        plan: also log the memory planner's predicted peak (``vram/planned_peak_GiB``) at the start.
    """

    def __init__(self, plan: bool = True) -> None:
        self.plan = plan
        self.static_gib: float | None = None
        self.planned_gib: float | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not _cuda(pl_module):
            return
        self.static_gib = torch.cuda.memory_allocated(pl_module.device) / GIB
        metrics = {"vram/static_GiB": self.static_gib}
        if self.plan and trainer.is_global_zero:
            from lightning_lora.callbacks.ema import ema_copies
            from lightning_lora.model.parallel import shards_of
            from lightning_lora.plan import plan_for

            module = lora_module(pl_module, "VRAMMonitor")
            data = data_recipe(trainer)
            try:
                if self.planned_gib is None:  # the CLI hands over the prediction of its start-up check
                    if data is None:
                        raise ValueError("the data module has no data recipe")
                    shards, copies = shards_of(trainer), ema_copies(trainer)
                    plan = plan_for(module.recipe, data, module.optimizer_name, shards=shards, ema_copies=copies)
                    self.planned_gib = plan.peak_gib
                metrics["vram/planned_peak_GiB"] = self.planned_gib
            except (NotImplementedError, ValueError, OSError) as e:
                rank_zero_info(f"VRAMMonitor: no planner prediction ({e})")
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not _cuda(pl_module) or not trainer._logger_connector.should_update_logs:  # noqa: SLF001
            return
        device = pl_module.device
        mine = torch.tensor(
            [torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB],
            device=device,
        )
        every = trainer.strategy.all_gather(mine).reshape(-1, 2) if trainer.world_size > 1 else mine.reshape(1, 2)
        metrics = {}
        for rank, (allocated, reserved) in enumerate(every.tolist()):
            metrics[f"vram/rank{rank}/peak_allocated_GiB"] = allocated
            metrics[f"vram/rank{rank}/peak_reserved_GiB"] = reserved
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        pl_module.log("vram_GiB", float(every[:, 0].max()), prog_bar=True, logger=False, rank_zero_only=True)
        torch.cuda.reset_peak_memory_stats(device)


class StepClock:
    """Seconds per optimizer step of a run, not counting its first step.

    The first optimizer step of a run (and of a resumed one) can take minutes where the others take a second: it
    compiles the blocks (``model.compile_blocks``) or warms up the kernels. An estimate that counts it said 1:07:52
    left of a run that ended 38 s later. So the clock starts when the first step ends: ``seconds_per_step`` and
    ``seconds_left`` are known from the second step on (None before), and ``first_step_s`` is the first step's own
    time. Times are given (``now``: ``time.perf_counter()``), so this is arithmetic a test can drive.
    """

    NOTABLE = 2.0
    """A first step is worth a line when it took this many seconds more than the steps after it, and thrice as long."""

    def __init__(self, now: float, step: int) -> None:
        self.started = (now, step)
        self.first_step_s: float | None = None
        self._after_first: tuple[float, int] | None = None

    def tick(self, now: float, step: int) -> bool:
        """Note that the run is at optimizer ``step`` at ``now``; True when this is the end of its first step."""
        if self._after_first is None and step > self.started[1]:
            self.first_step_s = (now - self.started[0]) / (step - self.started[1])
            self._after_first = (now, step)
            return True
        return False

    def seconds_per_step(self, now: float, step: int) -> float | None:
        if self._after_first is None or step <= self._after_first[1]:
            return None
        then, then_step = self._after_first
        return (now - then) / (step - then_step)

    def seconds_left(self, now: float, step: int, total: int | None) -> float | None:
        per_step = self.seconds_per_step(now, step)
        if per_step is None or not total or total <= 0:
            return None
        return max(0, total - step) * per_step

    def first_step_notable(self, now: float, step: int) -> bool:
        """Whether the first step took notably longer than the steps after it (known from the second step on)."""
        per_step = self.seconds_per_step(now, step)
        first = self.first_step_s
        return per_step is not None and first is not None and first > max(3 * per_step, per_step + self.NOTABLE)


def clock_time(seconds: float) -> str:
    """``seconds`` as ``M:SS`` or ``H:MM:SS``."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Throughput(Callback):
    """Optimizer steps/s, images/s and minutes left to ``max_steps`` (from the steps after the first: see
    :class:`StepClock`); and ``perf/first_step_s``, the time of the first optimizer step of a run (with
    ``model.compile_blocks``, mostly compiling: what the compile cache saves shows there on the next run), said on the
    console when it took notably longer than the steps after it."""

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None
        self._clock: StepClock | None = None
        self._said_first = False
        self.first_step_s: float | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock = StepClock(time.perf_counter(), trainer.global_step)
        self._last = None
        self._said_first = False
        self.first_step_s = None

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        clock = self._clock
        if clock is None:
            return
        now, step = time.perf_counter(), trainer.global_step
        if clock.tick(now, step) and clock.first_step_s is not None:
            self.first_step_s = clock.first_step_s
            for logger in trainer.loggers:
                logger.log_metrics({"perf/first_step_s": clock.first_step_s}, step=step)
            self._last = (now, step)  # the windows start after the first step
            return
        if not self._said_first and clock.seconds_per_step(now, step) is not None:
            self._said_first = True
            self._say_first_step(clock, now, step, pl_module)
        if self._last is None or not trainer._logger_connector.should_update_logs:  # noqa: SLF001
            return
        then, then_step = self._last
        if step <= then_step:
            return
        seconds_per_step = (now - then) / (step - then_step)
        batch_size = len(batch["latents"]) if isinstance(batch, dict) and "latents" in batch else 1
        images_per_step = batch_size * trainer.accumulate_grad_batches * trainer.world_size
        metrics = {"perf/steps_per_s": 1 / seconds_per_step, "perf/images_per_s": images_per_step / seconds_per_step}
        if trainer.max_steps and trainer.max_steps > 0:
            minutes_left = max(0, trainer.max_steps - step) * seconds_per_step / 60
            metrics["perf/minutes_left"] = minutes_left
            pl_module.log("eta_min", minutes_left, prog_bar=True, logger=False, rank_zero_only=True)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        self._last = (now, step)

    @staticmethod
    def _say_first_step(clock: StepClock, now: float, step: int, pl_module: LightningModule) -> None:
        """One line, when the first step took notably longer than the next: nothing to say when nothing compiled."""
        if not clock.first_step_notable(now, step):
            return
        per_step = clock.seconds_per_step(now, step) or 0.0
        compiled = getattr(getattr(pl_module, "recipe", None), "compile_blocks", False)
        why = (
            "mostly compiling the blocks: a next run with these settings loads them from the cache" if compiled else ""
        )
        why = f"; {why}" if why else ""
        rank_zero_info(f"First optimizer step: {clock.first_step_s:.1f} s (the next ones {per_step:.2f} s{why})")


def flat_options(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"model.lora.rank": 16, ...}``, the way a user names its options: a ``class_path`` entry is
    its section's value (the class's name: ``model.optimizer: AdamW8bit``) and its ``init_args`` are options of the
    section (``model.optimizer.lr``); a list of them (``trainer.callbacks``) is the classes' names, each one's options
    under its name (``trainer.callbacks.SampleImages.every_n_steps``). Values as they are (nulls, lists)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and "class_path" in value:
            flat[name] = _class_name(value)
            flat.update(flat_options(value.get("init_args") or {}, f"{name}."))
        elif isinstance(value, dict):
            flat.update(flat_options(value, f"{name}."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) and "class_path" in v for v in value):
            flat[name] = ", ".join(_class_name(v) for v in value)
            for item in value:
                flat.update(flat_options(item.get("init_args") or {}, f"{name}.{_class_name(item)}."))
        else:
            flat[name] = value
    return flat


def _class_name(spec: dict[str, Any]) -> str:
    return str(spec["class_path"]).rsplit(".", 1)[-1]


RUN_DEFINING = (
    "model.family",
    "model.pretrained",
    "model.lora.rank",
    "model.optimizer.lr",
    "data.resolution",
    "data.batch_size",
    "trainer.precision",
    "trainer.plugins",
    "trainer.plugins.dtype",
)
"""The options the HParams table always has: what defines a run (family, model, rank, learning rate, resolution,
batch, precision), whether the config set them or took the default."""


def run_hparams(config: dict[str, Any], options_set: set[str] | None) -> dict[str, float | int | str]:
    """The HParams entries of a run's resolved ``config``: :data:`RUN_DEFINING` and the options the user set
    (``options_set``, as :func:`flat_options` names them; a section that is no option names all its options), never a
    null; booleans as ``true`` / ``false`` (TensorBoard shows a bool as 0 / 1), lists as text."""
    flat = flat_options(config)
    chosen = set(options_set or ())
    sections = [o for o in chosen if o not in flat]  # e.g. --model.lora '{rank: 4}': every option under it
    hparams: dict[str, float | int | str] = {}
    for name, value in flat.items():
        if value is None or value == []:
            continue
        if name not in RUN_DEFINING and name not in chosen and not any(name.startswith(f"{o}.") for o in sections):
            continue
        if isinstance(value, bool):
            hparams[name] = "true" if value else "false"
        elif isinstance(value, int | float | str):
            hparams[name] = value
        elif isinstance(value, list):
            hparams[name] = ", ".join(str(v) for v in value)
        else:
            hparams[name] = str(value)
    return hparams


class ConfigSummary(Callback):
    """The resolved config.yaml of the run, in TensorBoard's Text tab (tag ``config``), and in the HParams tab the
    options the config sets (:func:`run_hparams`) with the final fixed evaluation (metrics ``hp/eval_loss``,
    ``hp/eval_drift``, ``hp/val_loss`` and their ``_ema`` forms, as the run measures them), so runs compare in one
    table: a column per option someone chose, not one per default of Lightning's Trainer."""

    def __init__(self) -> None:
        self.options_set: set[str] | None = None
        """The options the command line and the config files set (:func:`flat_options`' names), given by the CLI;
        None: only the options that define a run (:data:`RUN_DEFINING`)."""

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        # Not trainer.log_dir: it broadcasts, and only rank 0 runs this (a collective on one rank hangs DDP).
        config = Path(trainer.default_root_dir) / "config.yaml"
        if not config.is_file():
            return
        # Markdown: four-space indentation renders the YAML as a code block.
        text = "\n".join("    " + line for line in config.read_text().splitlines())
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("config", text, trainer.global_step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        config = Path(trainer.default_root_dir) / "config.yaml"
        if not trainer.is_global_zero or not config.is_file():
            return
        import yaml

        from lightning_lora.callbacks.evaluation import FixedEvalLoss

        options = run_hparams(yaml.safe_load(config.read_text()) or {}, self.options_set)
        metrics: dict[str, float] = {}
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, FixedEvalLoss):  # eval/loss -> hp/eval_loss, eval/drift_ema -> hp/eval_drift_ema...
                metrics.update({"hp/" + name.replace("/", "_"): value for name, value in cb.metrics.items()})
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.log_hyperparams(options, metrics)


def start_summary(trainer: Trainer, pl_module: LightningModule) -> str:
    """The lines :class:`StartSummary` prints."""
    step, end = trainer.global_step, trainer.max_steps
    length = f"steps {step} -> {end} (trainer.max_steps)" if end and end > 0 else f"from step {step}"
    data = data_recipe(trainer)
    parts = [length]
    if data is not None:
        batch = data.batch_size
        parts.append(f"batch {batch} x {trainer.accumulate_grad_batches} accumulated x {trainer.world_size} device(s)")
    trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
    parts.append(f"{trainable:,} trainable parameters")
    lines = ["Training: " + ", ".join(parts)]
    if trainer.optimizers:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        configs = trainer.lr_scheduler_configs
        if configs:
            scheduler = configs[0].scheduler
            describe = getattr(scheduler, "describe", None)
            shape = describe() if callable(describe) else "its own schedule"
            lines.append(f"Learning rate: {type(scheduler).__name__}: {shape}; {lr:.3g} at step {step}")
        else:
            lines.append(f"Learning rate: constant {lr:.3g}")
    recipe = getattr(pl_module, "recipe", None)
    if recipe is not None and recipe.source.training_adapter is not None:
        from lightning_lora.model.training_adapter import summary_line

        lines.append(summary_line(recipe.source.training_adapter))
    if recipe is not None and recipe.compile_blocks:
        from lightning_lora.model.assembly import compile_cache_dir

        lines.append(
            "Compiling: the repeated blocks compile during the first steps (the first time 30-45 s for FLUX, 1.5-2 "
            "minutes for SDXL and SD1.5 on a 16-core host, longer with fewer cores; a new image size once more; the "
            f"samples and the eval loss run uncompiled); cached in {compile_cache_dir()}, so the next run with the "
            "same settings starts faster"
        )
    if trainer.ckpt_path:
        lines.append(f"Resumed from {trainer.ckpt_path} at step {step}")
        lines.extend(f"  {note}" for note in getattr(pl_module, "resume_notes", []))
    return "\n".join(lines)


class StartSummary(Callback):
    """Print what the run will do when training starts; see the module docstring."""

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            console_line(start_summary(trainer, pl_module))


class StepProgressBar(ProgressBar):
    """A progress bar in optimizer steps: ``step / max_steps``, loss, learning rate, seconds per step and the time left.

    Lightning's own bars count batches per epoch, so a step-limited run with gradient accumulation shows
    ``Epoch 1/-2 ... 8/2``; LoRA runs are measured in steps. Shown on global rank 0 only, on stdout with the run's other
    lines (which go through the bar's ``write``: :func:`console_line`). On a terminal it is a tqdm bar; in a log file
    (stdout not a terminal) it is a plain line every tenth of the run (``trainer.log_every_n_steps`` without
    ``max_steps``) and at the end, so a log stays readable. The time left is estimated from the steps after the first,
    which may compile (:class:`StepClock`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self.bar: Any = None
        self._step = 0
        self._total: int | None = None
        self._every = 1
        self._clock: StepClock | None = None
        self.lines = 0
        """Plain progress lines printed (stdout not a terminal)."""
        self.shown: tuple[int, int | None] | None = None
        """``(steps, total)`` the bar showed when training ended."""

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self._enabled

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._enabled or not trainer.is_global_zero:
            return
        self._total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self._step = trainer.global_step
        self._clock = StepClock(time.perf_counter(), self._step)
        self.shown = None
        if not getattr(sys.stdout, "isatty", lambda: False)():
            left = (self._total - self._step) if self._total else 0
            every = int(getattr(trainer, "log_every_n_steps", 50) or 50)  # set on the trainer by its logger connector
            self._every = max(1, left // 10) if left > 0 else every
            return
        from tqdm.auto import tqdm

        counter = "{n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}|" if self._total else "{n_fmt}"
        self.bar = tqdm(
            total=self._total,
            initial=self._step,
            desc="steps",
            file=sys.stdout,
            dynamic_ncols=True,
            bar_format=f"{{desc}} {counter} [{{elapsed}}{{postfix}}]",
        )

    def status(self, trainer: Trainer, now: float) -> dict[str, str]:
        """What the bar shows after the counter: loss, learning rate, GPU memory, seconds per step, time left."""
        metrics = trainer.progress_bar_metrics
        shown = {}
        if "train/loss" in metrics:
            shown["loss"] = f"{float(metrics['train/loss']):.4f}"
        if trainer.optimizers:
            shown["lr"] = f"{trainer.optimizers[0].param_groups[0]['lr']:.2e}"
        if "vram_GiB" in metrics:
            shown["vram"] = f"{float(metrics['vram_GiB']):.1f}G"
        if self._clock is not None:
            per_step = self._clock.seconds_per_step(now, trainer.global_step)
            left = self._clock.seconds_left(now, trainer.global_step, self._total)
            if per_step is not None:
                shown["s/step"] = f"{per_step:.2f}"
            if left is not None:
                shown["left"] = clock_time(left)
        return shown

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self._clock is None or step == self._step:
            return
        now = time.perf_counter()
        self._clock.tick(now, step)
        done, self._step = step - self._step, step
        shown = self.status(trainer, now)
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(done)
        elif step % self._every == 0 or step == self._total:
            counter = f"{step}/{self._total}" if self._total else str(step)
            parts = [f"{v} {k}" if k in ("s/step", "left") else f"{k} {v}" for k, v in shown.items()]
            console_line("  ".join([f"step {counter}", *parts]))
            self.lines += 1

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.bar is not None:
            self.shown = (self.bar.n, self.bar.total)
            self.bar.close()
            self.bar = None
        elif self._clock is not None:
            self.shown = (self._step, self._total)
        self._clock = None
