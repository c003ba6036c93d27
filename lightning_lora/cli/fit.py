"""``lightning-lora fit``: Lightning's CLI with the run-folder conventions of a LoRA trainer.

``lightning-lora fit --config X.yaml`` is ``LightningCLI(LoraModule, LatentDataModule)`` with these defaults:

* **One run folder** (``trainer.default_root_dir``) holds everything: ``config.yaml`` (the resolved config),
  TensorBoard event files, ``checkpoints/`` (``last.ckpt`` and step checkpoints), ``lora/`` (the exported LoRA) and
  ``samples/``. The TensorBoard logger writes into the folder itself (no ``version_N`` subfolder), so
  ``--ckpt_path last`` finds the previous run's ``last.ckpt`` instead of silently starting over.
* A ``ModelCheckpoint`` that keeps ``last.ckpt`` is added unless the config has one; a :class:`LoraExport` and a
  :class:`FixedEvalLoss` likewise.
* The optimizer and scheduler are injected into the module and built over the LoRA parameters only
  (``auto_configure_optimizers=False``).
* **One run per folder.** A run that starts from step 0 (no ``--ckpt_path``) in a folder that holds checkpoints is
  refused (the same command run again would train over the finished run and replace its LoRA): continue it with
  ``--ckpt_path last``, or choose another ``trainer.default_root_dir``. While a run trains, its folder is locked
  (:class:`~lightning_lora.callbacks.resume.RunLock`): a second ``fit`` into it is refused naming the first.
* ``config.yaml`` is overwritten on resume (Lightning refuses by default, LT#17115); the seed defaults to 42 so a
  resumed run reuses it.
* ``--ckpt_path FILE`` never configures anything from the file. LightningCLI would merge the checkpoint's
  ``hyper_parameters`` into the config before anything runs (so ``--model.lora.rank 4`` with a rank-8 checkpoint
  trained at rank 8, and a crafted file could name any installed class to import); here the config is the user's,
  and the file goes through the same compatibility check as ``last``.
* A config names only classes of each option's kind from trusted modules, checked before anything it names is imported
  or built (:mod:`lightning_lora.cli.class_paths`): a config cannot run a command.
* A :class:`~lightning_lora.errors.ConfigError` (wrong path, typo, impossible combination) is printed as one line
  naming the option, with exit status 2; so is a file that cannot be written (full disk, no permission), naming the
  file. Files already written stay intact (every write is atomic).
* Exit status after Ctrl-C / SIGTERM is 130 / 143 (128 + the signal, the shell's convention), also when the run
  stopped cleanly with ``last.ckpt`` written, so a job scheduler can tell an interrupted run from a finished one.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_lora.callbacks.evaluation import FixedEvalLoss
from lightning_lora.callbacks.lora_export import LoraExport
from lightning_lora.callbacks.monitor import ConfigSummary, StartSummary, StepProgressBar, Throughput, VRAMMonitor
from lightning_lora.callbacks.resume import GracefulStop, RNGState, RunFolder, RunLock
from lightning_lora.callbacks.samples import SampleImages
from lightning_lora.checkpoint import (
    STAMP,
    AtomicCheckpointIO,
    check_compatible,
    check_fresh_start,
    read_checkpoint,
    resolve_resume,
)
from lightning_lora.cli.class_paths import ConfigParser, apply_import_policy, check_class_paths
from lightning_lora.cli.console import Console
from lightning_lora.cli.peek import check_config_files, config_files, read_config_file
from lightning_lora.cli.status import interrupted, user_error
from lightning_lora.data.datamodule import LatentDataModule
from lightning_lora.data.recipe import DataRecipe
from lightning_lora.errors import ConfigError, first_line
from lightning_lora.hardware import Allocator, allocator_conflict
from lightning_lora.model.parallel import check_strategy, resolve_strategy, shards_of
from lightning_lora.module import LoraModule, primitive_hparams
from lightning_lora.precision import BasePrecision, check_trainer_precision, for_trainer_precision, precision_of

__all__ = ["UNBUILT", "LoraCLI", "main", "run_summary"]

DEFAULT_RUN_DIR = "runs/lora"
CONSOLE: Console | None = None
"""The command's console routing (:mod:`lightning_lora.cli.console`); None when LoraCLI runs inside Python (tests)."""
MEMORY_ENV = "LIGHTNING_LORA_MEMORY_SETTINGS"
"""How the DDP ranks Lightning starts (as new processes of the same command) get rank 0's ``model.memory`` choice."""
DEFAULT_CHECKPOINT_EVERY = 250
UNBUILT: dict[str, Any] = {"trainer.callbacks": None, "trainer.logger": False, "trainer.profiler": None}
"""What the verbs that do not train (``plan``, ``cache``) leave out of the trainer config (:attr:`LoraCLI.unbuilt`)."""


class LoraCLI(LightningCLI):
    """LightningCLI for :class:`LoraModule` + :class:`LatentDataModule`; see the module docstring."""

    data_class: ClassVar[type[LatentDataModule]] = LatentDataModule
    """What the ``data:`` section builds (``lightning-lora plan`` reads the options without listing any image)."""
    unbuilt: ClassVar[dict[str, Any]] = {}
    """Trainer options this command leaves out, with the value they get instead (``plan`` and ``cache`` build no
    callback, logger or profiler of the config: they need none)."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        self._lock: RunLock | None = None
        given = sys.argv[1:] if args is None else args
        self._only: str | None = given[0] if given and given[0] in LightningCLI.subcommands() else None
        apply_import_policy()  # a config names classes of trusted modules only (lightning_lora.cli.class_paths)
        super().__init__(
            LoraModule,
            self.data_class,
            parser_class=ConfigParser,
            save_config_kwargs={"overwrite": True},
            # Our bucket sampler shards batches across ranks itself; Lightning must not replace it.
            # The start summary says the trainable parameters; Lightning's model table is one more screen of output.
            trainer_defaults={
                "default_root_dir": DEFAULT_RUN_DIR,
                "use_distributed_sampler": False,
                "enable_model_summary": False,
            },
            seed_everything_default=42,
            auto_configure_optimizers=False,
            parser_kwargs={"prog": "lightning-lora"},
            args=args,
            run=run,
        )

    @override
    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  # LightningCLI's is static; called on self
        """The subcommand named first on the command line alone (``fit``, ``validate``...), else all of them: its parser
        is the only one used, and each of the others cost as much to build (about 0.15 s of CPU, a quarter of a tiny
        fit's). ``lightning-lora --help`` and a first argument that is no subcommand build them all, as before."""
        every = LightningCLI.subcommands()
        return {self._only: every[self._only]} if self._only else every

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--allocator",
            type=Optional[Allocator],  # noqa: UP045 - jsonargparse reads the annotation at run time (Python 3.10)
            default=None,
            help="the GPU memory allocator's settings: expandable_segments (null: the command's default) or "
            "pytorch_default; a PYTORCH_CUDA_ALLOC_CONF set in the environment wins",
        )

    def before_instantiate_classes(self) -> None:
        """Every ``class_path`` of the config names a class of its option's kind, checked before anything is
        instantiated (:func:`~lightning_lora.cli.class_paths.check_class_paths`). The config's ``allocator`` was applied
        before parsing (:func:`lightning_lora.cli.main`); say so when an environment variable overrides it."""
        check_class_paths(self.config[self.subcommand] if self.subcommand else self.config)
        for option, value in self.unbuilt.items():
            self.config[option] = value
        conflict = allocator_conflict(self._get(self.config, "allocator"))
        if conflict:
            rank_zero_warn(conflict)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """LightningCLI's parsing, after a one-line error for a config file that is not UTF-8 or has a bad folder entry
        (:func:`check_config_files`) or an option that moved (:func:`check_moved_options`)."""
        check_config_files(sys.argv[1:] if args is None else args)
        check_moved_options(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """Nothing: LightningCLI would merge the checkpoint's hyper-parameters into the config here (see the module
        docstring). :meth:`fit` reads the file safely and checks it against the config instead."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._get(self.config_init, "trainer", default={})
        check_run_length(config.get("max_steps"))
        root = Path(config.get("default_root_dir") or DEFAULT_RUN_DIR)
        if config.get("logger") in (None, True):
            config["logger"] = TensorBoardLogger(save_dir=str(root), name="", version="", default_hp_metric=False)
        callbacks = list(config.get("callbacks") or [])
        checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
        if not checkpoints and config.get("enable_checkpointing", True) is not False:
            checkpoints.append(default_checkpoint())
            callbacks.append(checkpoints[-1])
        for cb in checkpoints:
            if cb.dirpath is None:
                cb.dirpath = os.path.realpath(root / "checkpoints")
        if not any(isinstance(c, LoraExport) for c in callbacks):
            callbacks.append(LoraExport())
        if not any(isinstance(c, FixedEvalLoss) for c in callbacks):
            callbacks.append(FixedEvalLoss())
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            callbacks.insert(0, StepProgressBar())  # first: it closes its line before the others print at the end
        for required in (RNGState, RunFolder, GracefulStop, VRAMMonitor, Throughput, ConfigSummary, StartSummary):
            if not any(isinstance(c, required) for c in callbacks):
                callbacks.append(required())
        config["callbacks"] = callbacks
        if config.get("use_distributed_sampler"):
            raise ConfigError(
                "trainer.use_distributed_sampler: true would replace lightning-lora's bucket sampler, which already "
                "gives each GPU its share of every batch (one aspect-ratio bucket per step); leave it false."
            )
        config["strategy"] = resolve_strategy(
            config.get("strategy", "auto"), config.get("devices", "auto"), config.get("num_nodes") or 1
        )
        plugins = config.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        plugins, config["precision"] = resolve_precision(config.get("precision"), plugins)
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        config["plugins"] = plugins
        trainer = super().instantiate_trainer(**kwargs)
        # The base format joins the model's recipe now, before anything is cached (the text encoders load in its
        # dtype, and the `cache` verb builds no more than this), and a model option it cannot go with stops here.
        self.model.use_precision(precision_of(trainer))
        if self.subcommand == "fit":
            self._claim_run_folder(trainer, root)
        if CONSOLE is not None:
            CONSOLE.attach(root)  # after the claim: a fit refused the folder writes nothing into it
        return trainer

    def _claim_run_folder(self, trainer: Trainer, root: Path) -> None:
        """Before anything is written: lock the run folder (the process of global rank 0 only: the other ranks of a
        DDP run are new processes of this command, see :class:`RunLock`), and refuse a run from step 0 into a folder
        that holds checkpoints (:func:`~lightning_lora.checkpoint.check_fresh_start`)."""
        check_writable(root, "trainer.default_root_dir")
        if trainer.global_rank == 0:
            self._lock = RunLock(root)
            self._lock.acquire()
        try:
            if self._get(self.config, "ckpt_path") is None:
                check_fresh_start(checkpoint_dir(trainer), root)
        except BaseException:
            self._release_run_folder()
            raise

    def _release_run_folder(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _run_subcommand(self, subcommand: str) -> None:
        """LightningCLI's, then the run folder's lock is released (also when the run fails)."""
        try:
            super()._run_subcommand(subcommand)
        finally:
            self._release_run_folder()

    def before_fit(self) -> None:
        # Cross-object checks, before any weights load: the data resolution must suit the model family.
        # Every resolution and bucket option against the model family (raises ConfigError naming the option).
        self.datamodule.recipe.spec(self.model.family)
        check_writable(self._checkpoint_dir(), "ModelCheckpoint dirpath")
        check_strategy(self.trainer.strategy, self.model.recipe)
        if torch.cuda.is_available() and self.trainer.strategy.root_device.type == "cuda":
            planned = warn_if_too_big(self.model, self.datamodule, self.trainer)
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
            checkpoint = read_checkpoint(ckpt_path)
        if checkpoint is not None:
            saved_model = (checkpoint.get(STAMP) or {}).get("model")  # None: a checkpoint from before identities
            check_compatible(
                checkpoint.get("hyper_parameters", {}),
                primitive_hparams(dict(model.hparams)),
                ckpt_path or "",
                saved_model,
                model.model_identity() if saved_model is not None else None,
            )
            step, end = checkpoint.get("global_step", 0), self.trainer.max_steps
            if end and 0 < end <= step:
                rank_zero_info(
                    f"{ckpt_path} is at step {step}, and trainer.max_steps is {end}: nothing to train. Set a larger "
                    "trainer.max_steps to train longer (a schedule sized from it stretches to the new length)."
                )
        if model.memory != "as_configured":
            self._choose_memory_settings(model, datamodule, checkpoint)
        kwargs["weights_only"] = True  # a checkpoint is data, never code
        try:
            self.trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, **kwargs)
        except torch.OutOfMemoryError as e:
            batch = _data(datamodule).batch_size
            raise ConfigError(
                out_of_memory_message(e, self.trainer, batch, self._checkpoint_dir() / "last.ckpt")
            ) from None

    def _choose_memory_settings(
        self, model: LoraModule, datamodule: LatentDataModule | None, checkpoint: dict[str, Any] | None
    ) -> None:
        """``model.memory``: the settings this run uses (see :class:`LoraModule`), written into config.yaml."""
        from lightning_lora.hardware import free_memory_gib
        from lightning_lora.plan import choose_for_memory

        # DDP: the ranks Lightning starts (LOCAL_RANK > 0, new processes of this command) take rank 0's choice; ranks a
        # cluster launcher starts choose here and take rank 0's once the process group is up (LoraModule.setup).
        inherited = os.environ.get(MEMORY_ENV) if int(os.environ.get("LOCAL_RANK", "0")) > 0 else None
        saved = ((checkpoint or {}).get(STAMP) or {}).get("memory")
        if inherited:
            settings, why = json.loads(inherited), "rank 0's choice"
        elif saved:
            settings, why = dict(saved), "the choice this run started with (its checkpoint)"
        else:
            device = self.trainer.strategy.root_device
            budget = free_memory_gib(device) if model.memory == "auto" else float(model.memory)
            if budget is None:
                rank_zero_info(f"model.memory: {model.memory}: {device} has no memory of its own; options as written.")
                return
            where = f"{budget:.1f} GiB free on {device}" if model.memory == "auto" else f"{budget:g} GiB"
            shards = shards_of(self.trainer)
            fit = choose_for_memory(model.recipe, _data(datamodule), budget, model.optimizer_name, shards)
            if fit is None:
                raise ConfigError(
                    f"model.memory: {model.memory}: no setting that keeps this training fits in {where}. Run "
                    "`lightning-lora plan --config ... --vram N` for smaller batches or images that fit, or use a GPU "
                    "with more memory."
                )
            settings = model.recipe.replace(**fit.changes).memory_settings()
            changed = fit.flags or "the options as written"
            why = f"{where}: {changed} (~{fit.peak_gib:.1f} GiB planned)"
        model.use_memory_settings(settings)
        try:  # a sharding strategy cannot take every choice (a quantized or offloaded base)
            check_strategy(self.trainer.strategy, model.recipe)
        except ConfigError as e:
            raise ConfigError(
                f"model.memory: {model.memory} chose {settings} ({why}), but {e} Or set model.memory: as_configured."
            ) from None
        os.environ[MEMORY_ENV] = json.dumps(settings)
        model.hand_precision_to(self.trainer)  # another base format: the trainer runs it too
        section = self.config.get(str(self.subcommand), self.config)  # what config.yaml is written from
        for name, value in settings.items():
            if name == "precision":
                section["trainer.precision"] = None
                spec = model.recipe.precision.spec()
                section["trainer.plugins"] = with_precision_spec(section.get("trainer.plugins"), spec)
            else:
                section[f"model.{name}"] = value
        rank_zero_info(f"model.memory: {model.memory}: {why}")

    def _checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.trainer)

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(run_summary(self.trainer), flush=True)
            line = CONSOLE.summary() if CONSOLE is not None else None
            if line:
                print(line, flush=True)


def _data(datamodule: LatentDataModule | None) -> DataRecipe:
    """The data recipe of ``fit``'s data module (the options' defaults without one: a Trainer fed other data)."""
    return datamodule.recipe if datamodule is not None else DataRecipe()


MOVED_OPTIONS = {
    "model.quantization": "the base format is a precision plugin now: trainer.plugins: lightning_lora.precision.NF4 "
    "(mode nf4), FP8 (fp8), FP8Compute (fp8_compute) or BF16 (none), e.g. `plugins: {class_path: "
    "lightning_lora.precision.NF4}` under trainer:, or --trainer.plugins lightning_lora.precision.NF4; the options "
    "double_quant, upcast_small_params and skip are its init_args",
    "model.base_dtype": "the base dtype is the precision plugin's dtype now: trainer.precision: bf16-mixed (bf16), "
    "16-mixed (fp16) or 32-true (fp32), or the plugin's init_args: {dtype: fp16}",
}
"""Options that moved, and where to (:func:`check_moved_options`)."""


def check_moved_options(args: Any) -> None:
    """A :class:`ConfigError` naming the replacement of a :data:`MOVED_OPTIONS` option in a ``--config`` file or a
    flag (instead of the parser's "unexpected key")."""
    if not isinstance(args, list | tuple):
        return
    found: list[str] = []
    for arg in args:
        arg = str(arg)
        found += [option for option in MOVED_OPTIONS if arg == f"--{option}" or arg.startswith(f"--{option}.")]
    for path in config_files(args):
        found += _moved_in_file(path)
    if found:
        option = found[0]
        raise ConfigError(f"{option} is no longer an option: {MOVED_OPTIONS[option]}.")


def _moved_in_file(path: Path) -> list[str]:
    model = read_config_file(path).get("model")  # a file it cannot read: the parser names the file and its problem
    if not isinstance(model, dict):
        return []
    return [option for option in MOVED_OPTIONS if option.split(".", 1)[1] in model]


def resolve_precision(precision: Any, plugins: list[Any]) -> tuple[list[Any], None]:
    """The trainer's plugins with exactly one of our precision plugins (the ``trainer.precision`` it is given, which
    then becomes None: Lightning takes one or the other). A :class:`ConfigError` for both at once, two plugins, or a
    precision plugin of Lightning's (it would cast or quantize the LoRA too)."""
    from lightning.pytorch.plugins.precision import Precision

    ours = [p for p in plugins if isinstance(p, BasePrecision)]
    others = [p for p in plugins if isinstance(p, Precision) and not isinstance(p, BasePrecision)]
    if others:
        check_trainer_precision(type(others[0]).__name__)
    if len(ours) > 1:
        names = ", ".join(type(p).__name__ for p in ours)
        raise ConfigError(f"trainer.plugins: {names}: one precision plugin (the frozen base's format), not several.")
    if ours and precision is not None:
        raise ConfigError(
            f"trainer.precision: {precision} and trainer.plugins: {type(ours[0]).__name__} both set the precision; "
            f"remove trainer.precision (the plugin autocasts to its dtype, {ours[0].dtype}; set its dtype with "
            "init_args: {dtype: fp16} on a GPU without bf16)."
        )
    if not ours:
        plugins = [*plugins, for_trainer_precision(precision or "bf16-mixed")]
    return plugins, None


def with_precision_spec(plugins: Any, spec: dict[str, Any]) -> list[Any]:
    """A config's ``trainer.plugins`` with its precision plugin replaced by ``spec`` (or ``spec`` added)."""
    entries = plugins if isinstance(plugins, list) else ([] if plugins is None else [plugins])

    def class_path(entry: Any) -> str:
        value = entry.get("class_path") if hasattr(entry, "get") else getattr(entry, "class_path", entry)
        return str(value or "")

    kept = [e for e in entries if not class_path(e).startswith("lightning_lora.precision.")]
    return [*kept, spec]


def check_run_length(max_steps: Any) -> None:
    """``trainer.max_steps`` is a number of optimizer steps, or -1 (no limit: ``trainer.max_epochs`` ends the run)."""
    if max_steps is None or max_steps == -1:
        return
    if not isinstance(max_steps, int) or max_steps < 1:
        what = "trains nothing" if max_steps == 0 else "is not a number of steps"
        raise ConfigError(
            f"trainer.max_steps: {max_steps} {what}. Set the run length in optimizer steps (e.g. 1000), or -1 to let "
            "trainer.max_epochs end the run."
        )


def check_writable(folder: Path, option: str) -> None:
    """Write (then remove) a file in ``folder``, or in its nearest existing parent if it does not exist yet (nothing is
    left behind): a run folder that cannot be written stops the run before any weights load, naming the option,
    instead of at the first checkpoint."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is a file, not a folder")
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"{option}: cannot write to {folder} ({e.strerror or e}). Choose a folder you can write to, or fix its "
            "permissions."
        ) from None


def checkpoint_dir(trainer: Trainer) -> Path:
    """Where the run's checkpoints go: the first ``ModelCheckpoint``'s folder, else ``<run folder>/checkpoints``."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            return Path(cb.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def default_checkpoint() -> ModelCheckpoint:
    """The checkpointing of a run whose config has no ``ModelCheckpoint``: every ``DEFAULT_CHECKPOINT_EVERY`` steps,
    ``last.ckpt`` and the three newest."""
    return ModelCheckpoint(
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=DEFAULT_CHECKPOINT_EVERY,
        save_last=True,
        save_top_k=3,  # the three newest: "best" by step number
        monitor="step",
        mode="max",
    )


def warn_if_too_big(model: LoraModule, datamodule: LatentDataModule, trainer: Trainer) -> float | None:
    """Run the memory planner at start and warn before an out-of-memory crash (never blocks the run). Returns the
    predicted training peak in GiB on each GPU (None when the planner cannot run)."""
    from lightning_lora.plan import HEADROOM, plan_for

    device = trainer.strategy.root_device
    try:
        plan = plan_for(model.recipe, datamodule.recipe, model.optimizer_name, shards=shards_of(trainer))
    except (ConfigError, NotImplementedError, OSError) as e:
        rank_zero_info(f"memory planner skipped: {e}")
        return None
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    need = plan.run_peak
    message = f"predicted peak GPU memory {need:.1f} GiB of {total:.1f} GiB ({device})"
    if need > total * HEADROOM:
        rank_zero_warn(
            f"{message}: this will probably run out of memory. Run `lightning-lora plan --config ... "
            f"--vram {total:.0f}` for options that fit."
        )
    else:
        rank_zero_info(message)
    return plan.peak_gib


def out_of_memory_message(error: BaseException, trainer: Trainer, batch_size: int, last: Path) -> str:
    """What to do after the GPU ran out of memory while training: the same images per step in smaller batches where
    the batch holds more than one, the planner's options otherwise, and where to continue from."""
    from lightning_lora.plan import smaller_batches

    step = trainer.global_step
    device = trainer.strategy.root_device
    accumulate = trainer.accumulate_grad_batches
    what = f"out of GPU memory on {device} while training step {step + 1} ({first_line(error, 160)})"
    split = smaller_batches(batch_size, accumulate)
    if split is not None:
        fix = (
            f"Train the same {batch_size * accumulate} images per step in smaller batches: --data.batch_size "
            f"{split[0]} --trainer.accumulate_grad_batches {split[1]}; or run `lightning-lora plan --config ... "
            "--vram N` (N: the GiB free on the card) for other settings that fit."
        )
    else:
        fix = (
            "Run `lightning-lora plan --config ... --vram N` (N: the GiB free on the card) for settings that fit "
            "(gradient checkpointing, the NF4 base, a lower data.resolution)."
        )
    if device.type == "cuda":
        free, total = (b / 2**30 for b in torch.cuda.mem_get_info(device))
        what += f"; {free:.1f} of {total:.1f} GiB free now, other programs included"
    again = (
        f"Checkpoints written so far are intact: continue from {last} with --ckpt_path last."
        if last.is_file()
        else "Nothing was written that a new run would need: run the same command again with the change."
    )
    return f"{what}. {fix} {again}"


def run_summary(trainer: Trainer) -> str:
    """Where a run wrote its outputs, and how to look at them."""
    root = Path(trainer.default_root_dir)
    lines = [f"\nRun folder: {root}  (step {trainer.global_step})"]
    stop = next((cb for cb in trainer.callbacks if isinstance(cb, GracefulStop)), None)  # type: ignore[attr-defined]
    if stop is not None and stop.stopped_by_signal and stop.requested is not None:
        lines.append(
            f"  stopped by {signal.Signals(stop.requested).name} at step {trainer.global_step}; the checkpoint is "
            "written: resume with --ckpt_path last"
        )
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, LoraExport) and cb.last_path is not None:
            lines.extend(cb.summary_lines())
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


def main(argv: list[str] | None = None) -> int:
    """``lightning-lora fit ...`` (and LightningCLI's other subcommands and ``--help``); returns the exit status."""
    global CONSOLE
    for pattern in _NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    CONSOLE = Console()
    try:
        with CONSOLE:
            return _run(argv)
    finally:
        CONSOLE = None


def _run(argv: list[str] | None) -> int:
    try:
        cli = LoraCLI(args=argv)
    except (ConfigError, OSError) as e:
        return user_error("lightning-lora", e)
    except SystemExit as e:
        # Lightning turns a Ctrl-C it did not expect (before training, or a second one) into exit status 1.
        if isinstance(e.__context__, KeyboardInterrupt) and e.code == 1:
            print(
                "lightning-lora: interrupted. Files already written are intact; run the same command again to "
                "continue (add --ckpt_path last if training had started).",
                file=sys.stderr,
            )
            return interrupted(signal.SIGINT)
        raise
    status = interrupted_status(cli.trainer) if cli.trainer is not None else None
    return status or 0


def interrupted_status(trainer: Trainer) -> int | None:
    """128 + the signal when Ctrl-C or SIGTERM stopped the run (after its checkpoint was written), else None."""
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, GracefulStop) and cb.stopped_by_signal and cb.requested is not None:
            return interrupted(cb.requested)
    return None
