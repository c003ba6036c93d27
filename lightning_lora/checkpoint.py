"""Checkpoints that cannot be corrupted, a resume that picks the newest valid one, refuses an incompatible one, and
continues under the run's current settings.

Writing (:class:`AtomicCheckpointIO`, a Lightning ``CheckpointIO`` plugin): the checkpoint is serialized in memory,
written to a temporary file in the same folder, fsynced, renamed over the target, and the folder is fsynced. A kill
or a full disk during the write leaves the previous file intact. Lightning's own writer uses an fsspec transaction
without fsync, so after a power loss the renamed file can still be empty.

Reading: always ``torch.load(weights_only=True)``: a checkpoint is data, never code. :func:`read_checkpoint` turns a
file that is not a readable training checkpoint (truncated, pickled objects, a LoRA file) into one clear error.

Resuming (:func:`resolve_resume`): ``--ckpt_path last`` means the newest *valid* checkpoint of the run folder, whatever
its name: every checkpoint carries the time it was saved (``checkpoint["lightning_lora"]["saved_at_ns"]``, written by
:class:`~lightning_lora.callbacks.resume.RunFolder`), which survives copying a run folder to another disk or machine
(file modification times do not). Older checkpoints without it are dated by their modification time. If the newest is
truncated or unreadable, the next one is used with a warning; if none is readable, a clear error. A run folder
without checkpoints starts fresh, and says so. A run started *without* ``--ckpt_path`` in a folder that holds
checkpoints is refused (:func:`check_fresh_start`): re-running the same command would otherwise train from step 0
over the finished run, replace its exported LoRA and leave a ``last`` that continues the accident.

Compatibility (:func:`check_compatible`): a different LoRA rank, alpha, targets, family or base model would train a
different adapter, so a resume stops with the option's name. Anything else (steps, learning rate, logging, samples)
may change between runs. The base model is compared by what it is, not by how ``model.pretrained`` is spelled: every
checkpoint records the model's identity (``checkpoint["lightning_lora"]["model"]``,
:meth:`~lightning_lora.families.base.ModelSource.model_identity`: its files' contents, or a hub id), so a model folder
that moved or is named by another path resumes, and another model copied to the same path is refused. A checkpoint
written before identities were recorded is compared by the path as written (and the note says so).

Settings versus state (:func:`reconcile_training_state`): an optimizer's and a scheduler's ``state_dict`` mix the
*state* a resume must continue (moments, step counters, the schedule's position) with the *settings* the config chose
(learning rate, weight decay, a schedule's length). Restored as they are, the checkpoint's settings silently win over
the user's: extending a finished 10-step run to ``trainer.max_steps: 20`` kept the schedule 10 steps long, so it
trained 10 more steps at learning rate 0. So every checkpoint also records the settings the config produced
(``checkpoint["lightning_lora"]["configured"]``, captured before anything is restored), and on resume a setting that
differs between that record and this run's config is taken from the config; everything else comes from the
checkpoint. A resume with an unchanged config is therefore exact, and a changed one is applied and reported. A
schedule whose learning rate is a function of the step (``lightning_lora.schedules``, ``LambdaLR``, torch's schedules
with a closed form) continues at its current step on the new shape: a longer ``trainer.max_steps`` stretches the
decay over the new length, as if the run had been planned that long (the learning rate rises again if the old
schedule had ended). Adaptive values optimizers keep in their parameter groups (Prodigy's ``d``) are state: they
are never compared, because the config does not change them.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_lora.errors import ConfigError, first_line
from lightning_lora.io import atomic_write_bytes

__all__ = ["AtomicCheckpointIO", "check_compatible", "check_fresh_start", "load_checkpoint", "resolve_resume"]

log = logging.getLogger(__name__)

# Options that define what the LoRA tensors mean: changing any of them makes a checkpoint unusable.
INCOMPATIBLE = {
    "model.lora.rank": ("lora", "rank"),
    "model.lora.alpha": ("lora", "alpha"),
    "model.lora.targets": ("lora", "targets"),
    "model.lora.variant": ("lora", "variant"),
    "model.family": ("family", "class_path"),
    "model.pretrained": ("pretrained",),
    "model.denoiser_file": ("denoiser_file",),
    "model.training_adapter": ("training_adapter",),
}


_MODEL_FILES = ("model.pretrained", "model.denoiser_file", "model.training_adapter")
"""The options compared by the model's identity (its files), not as written, when the checkpoint records it."""

STAMP = "lightning_lora"
"""The checkpoint key under which lightning-lora keeps its own records (``saved_at_ns``, ``configured``)."""

TRAINING_KEYS = frozenset({"state_dict", "loops", "optimizer_states"})


class UnreadableCheckpoint(Exception):
    """A file that is not a readable training checkpoint; the message is a one-line reason."""


def load_checkpoint(path: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint safely (``weights_only=True``) on the CPU (``mmap``: tensors read only when touched)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def _load_training_checkpoint(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint in ``path``, or :class:`UnreadableCheckpoint` saying why it is not a training checkpoint."""
    try:
        ckpt = load_checkpoint(path, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):  # not a pickle at all: garbage, an HTML error page...
            raise UnreadableCheckpoint(f"not a checkpoint ({first_line(e, 120)})") from e
        raise UnreadableCheckpoint(
            "it holds Python objects that safe loading (weights_only) refuses, so it was not written by "
            "`lightning-lora fit`, and loading it could run code"
        ) from e
    except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError) as e:
        raise UnreadableCheckpoint(f"truncated or not a checkpoint ({first_line(e, 160)})") from e
    if not isinstance(ckpt, dict) or not TRAINING_KEYS <= ckpt.keys():
        raise UnreadableCheckpoint(
            "not a training checkpoint (no model, optimizer and loop state; a LoRA file cannot be resumed from)"
        )
    return ckpt


def read_checkpoint(
    path: str | Path,
    option: str = "--ckpt_path",
    fix: str = "Pass a .ckpt from a run's checkpoints/ folder, or 'last'.",
) -> dict[str, Any]:
    """A training checkpoint, or :class:`ConfigError` naming ``option``, the file, the reason and the ``fix``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{option}: {path} does not exist. {fix}")
    try:
        return _load_training_checkpoint(path)
    except UnreadableCheckpoint as e:
        raise ConfigError(f"{option}: {path} cannot be used: {e}. {fix}") from None


def _readable(path: Path) -> dict[str, Any] | None:
    try:
        return _load_training_checkpoint(path)
    except UnreadableCheckpoint as e:  # the reason is logged; the caller reports the file
        log.debug("checkpoint %s unreadable: %s", path, e)
        return None


def saved_at(checkpoint: dict[str, Any], path: Path) -> int:
    """When ``checkpoint`` (read from ``path``) was written, in ns: its own stamp, else the file's modification time."""
    stamp = (checkpoint.get(STAMP) or {}).get("saved_at_ns")
    return stamp if isinstance(stamp, int) else path.stat().st_mtime_ns


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write checkpoints atomically and durably; read them with ``weights_only=True``."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(path, buffer.getvalue())

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The ``*.ckpt`` files in ``checkpoint_dir`` (none when it does not exist)."""
    folder = Path(checkpoint_dir)
    return sorted(folder.glob("*.ckpt")) if folder.is_dir() else []


def _dated(files: list[Path]) -> tuple[list[tuple[int, Path, Any]], list[Path]]:
    """``(saved_at, path, global_step)`` of the checkpoints among ``files`` whose small pickle reads, newest first (at
    equal times ``last.ckpt``: Lightning writes it right after the step checkpoint of the same step), and the files
    that do not read."""
    dated: list[tuple[int, Path, Any]] = []
    rejected: list[Path] = []
    for path in files:
        try:  # only the small pickle is read here (tensors are memory-mapped, not loaded)
            ckpt = _load_training_checkpoint(path, mmap=True)
            dated.append((saved_at(ckpt, path), path, ckpt.get("global_step")))
        except (UnreadableCheckpoint, OSError):
            rejected.append(path)
    dated.sort(key=lambda d: (d[0], d[1].name == "last.ckpt"), reverse=True)
    return dated, rejected


def check_fresh_start(checkpoint_dir: str | Path, run_folder: str | Path) -> None:
    """A :class:`ConfigError` when a run that starts from step 0 (no ``--ckpt_path``) would train into a folder that
    holds checkpoints of an earlier run: it would overwrite that run's LoRA and continue it by accident later
    (``last`` would then be the new run's). Said before anything is written; the fix is to continue or to go
    elsewhere."""
    files = checkpoint_files(checkpoint_dir)
    if not files:
        return
    dated, _ = _dated(files)
    step = f"step {dated[0][2]}" if dated else "none of them readable"
    folder, root = Path(checkpoint_dir), Path(run_folder)
    where = root if folder.absolute().is_relative_to(root.absolute()) else folder
    raise ConfigError(
        f"{where} holds checkpoints of an earlier run ({step}): add --ckpt_path last to continue it, or choose "
        "another trainer.default_root_dir for a new run."
    )


def resolve_resume(checkpoint_dir: str | Path) -> tuple[Path | None, dict[str, Any] | None]:
    """The newest valid checkpoint in ``checkpoint_dir`` and its contents, or ``(None, None)``; see the module
    docstring for what "newest" means."""
    folder = Path(checkpoint_dir)
    files = checkpoint_files(folder)
    if not files:
        rank_zero_info(f"--ckpt_path last: no checkpoint in {folder}; starting a new run.")
        return None, None
    dated, rejected = _dated(files)
    for _, path, _ in dated:
        ckpt = _readable(path)
        if ckpt is not None:
            newer = [p for p in rejected if _mtime(p) >= _mtime(path)]
            if newer:
                newer.sort(key=lambda p: (p.name != "last.ckpt", -_mtime(p)))
                rank_zero_warn(
                    f"--ckpt_path last: {', '.join(p.name for p in newer)} in {folder} is truncated or corrupt; "
                    f"resuming from {path.name} (step {ckpt.get('global_step')}) instead."
                )
            return path, ckpt
        rejected.append(path)
    raise ConfigError(
        f"--ckpt_path last: none of the checkpoints in {folder} can be read ({', '.join(p.name for p in files)}). "
        "Start a new run in another run folder (trainer.default_root_dir), or pass a valid file to --ckpt_path."
    )


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _lookup(hparams: dict[str, Any], keys: tuple[str, ...]) -> Any:
    value: Any = hparams
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def check_compatible(
    saved: dict[str, Any],
    current: dict[str, Any],
    path: str | Path,
    saved_model: dict[str, Any] | None = None,
    current_model: dict[str, Any] | None = None,
) -> None:
    """Raise :class:`ConfigError` if an option that defines the LoRA differs between a checkpoint and this run.

    ``saved`` and ``current`` are the hyper-parameters; ``saved_model`` and ``current_model`` the model identities
    (:meth:`~lightning_lora.families.base.ModelSource.model_identity`) of the checkpoint (None when it predates them:
    the model options are then compared as written) and of this run."""
    diffs = []
    by_identity = saved_model is not None and current_model is not None
    for option, keys in INCOMPATIBLE.items():
        old, new = _lookup(saved, keys), _lookup(current, keys)
        if option in _MODEL_FILES and by_identity:
            assert saved_model is not None and current_model is not None
            if saved_model.get(keys[0]) != current_model.get(keys[0]):
                was = "" if old == new else f" ({old!r})"
                diffs.append(f"{option} {new!r} is not the model the run was trained on{was}: their files differ")
            continue
        if option == "model.lora.alpha":  # null means alpha = rank
            old = old if old is not None else _lookup(saved, ("lora", "rank"))
            new = new if new is not None else _lookup(current, ("lora", "rank"))
            old, new = (float(old) if old is not None else None), (float(new) if new is not None else None)
        if option == "model.lora.variant":  # checkpoints from before variants existed are plain LoRA
            old, new = old or "lora", new or "lora"
        if option in ("model.denoiser_file", "model.training_adapter"):  # the same file in another folder is the same
            old, new = (Path(old).name if old else old), (Path(new).name if new else new)
        if old != new:
            diffs.append(f"{option} was {old!r}, now {new!r}")
    older = (
        f"{path} records no identity of its base model (written by an older lightning-lora), so model.pretrained is "
        "compared as written"
    )
    if diffs:
        hint = ""
        if not by_identity and any(d.startswith(_MODEL_FILES) for d in diffs):
            hint = f" ({older}: resume once with the path it was trained with; its new checkpoints record the model)"
        raise ConfigError(
            f"--ckpt_path: {path} was trained with other settings: {'; '.join(diffs)}{hint}. Resume with the run's own "
            "settings (its config.yaml), or start a new run in another folder (trainer.default_root_dir)."
        )
    if not by_identity:
        rank_zero_info(f"--ckpt_path: {older}; the checkpoints this run writes record it.")


# -- settings versus state (see the module docstring) -------------------------------------------------------------

# The entries of an LR scheduler's state_dict that are its position on the schedule, not its settings.
_POSITION = frozenset({"last_epoch", "_step_count", "_is_initial", "_get_lr_called_within_step", "_last_lr", "verbose"})
# Callable-object lambdas are saved as their __dict__; LambdaLR rebuilds them from the config.
_NOT_SETTINGS = _POSITION | {"lr_lambdas"}


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: Any) -> bool:
    """Whether ``value`` is a setting that round-trips through ``torch.load(weights_only=True)``."""
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def scheduler_settings(scheduler: Any) -> dict[str, Any]:
    """The settings part of a scheduler's ``state_dict`` (its length, base learning rates, shape parameters)."""
    return {k: copy.deepcopy(v) for k, v in scheduler.state_dict().items() if k not in _NOT_SETTINGS and _plain(v)}


def configured_record(optimizers: list[Any], schedulers: list[Any]) -> dict[str, Any]:
    """What this run's config set up, captured right after ``configure_optimizers`` built it (before a checkpoint is
    restored): each optimizer's class and parameter-group settings, each scheduler's class and settings."""
    return {
        "optimizers": [
            {
                "class": _qualname(opt),
                "groups": [
                    {k: copy.deepcopy(v) for k, v in g.items() if k != "params" and _plain(v)} for g in opt.param_groups
                ],
            }
            for opt in optimizers
        ],
        "schedulers": [{"class": _qualname(s), "settings": scheduler_settings(s)} for s in schedulers],
    }


def lr_at(scheduler: Any, step: int) -> list[float] | None:
    """The learning rates ``scheduler`` (with its current settings) gives at ``step``, when the schedule is a function
    of the step (``LambdaLR`` and its subclasses, torch's schedules with a closed form); else None."""
    from torch.optim.lr_scheduler import LambdaLR

    if isinstance(scheduler, LambdaLR):
        return [float(base * fn(step)) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    closed_form = getattr(scheduler, "_get_closed_form_lr", None)
    if closed_form is None:
        return None
    previous = scheduler.last_epoch
    scheduler.last_epoch = step
    try:
        return [float(lr) for lr in closed_form()]
    finally:
        scheduler.last_epoch = previous


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple) and len(value) == 1:
        return _show(value[0])
    return repr(value)


def reconcile_training_state(
    checkpoint: dict[str, Any], optimizers: list[Any], schedulers: list[Any], configured: dict[str, Any]
) -> list[str]:
    """Edit ``checkpoint``'s optimizer and scheduler states (before Lightning restores them) so that every setting this
    run's config changed since the checkpoint was written is taken from the config; return one line per change.

    ``optimizers`` / ``schedulers`` are this run's, freshly built from the config; ``configured`` is their
    :func:`configured_record`. A checkpoint without a record (written before records existed) is compared by its
    schedulers' own settings only. Raises :class:`ConfigError` when the optimizer or scheduler class changed: their
    state cannot carry over.
    """
    then = (checkpoint.get(STAMP) or {}).get("configured")
    opt_states: list[dict[str, Any]] = checkpoint.get("optimizer_states") or []
    sched_states: list[dict[str, Any]] = checkpoint.get("lr_schedulers") or []
    notes: list[str] = []
    for kind, now_list, then_list, option in (
        ("optimizer", configured["optimizers"], (then or {}).get("optimizers"), "model.optimizer"),
        ("scheduler", configured["schedulers"], (then or {}).get("schedulers"), "model.scheduler"),
    ):
        if then_list is not None and [c["class"] for c in then_list] != [c["class"] for c in now_list]:
            before = ", ".join(c["class"] for c in then_list) or "none"
            after = ", ".join(c["class"] for c in now_list) or "none"
            raise ConfigError(
                f"{option}: the checkpoint was trained with {kind} {before}, this run configures {after}; its state "
                f"cannot carry over. Resume with the {option} of the run's config.yaml, or start a new run in another "
                "folder (trainer.default_root_dir)."
            )
    if len(sched_states) != len(schedulers) or len(opt_states) != len(optimizers):
        return notes  # Lightning reports the mismatch itself when it restores

    scheduled: set[int] = set()  # optimizers whose learning rate a scheduler sets
    for i, (scheduler, state) in enumerate(zip(schedulers, sched_states, strict=True)):
        now: dict[str, Any] = configured["schedulers"][i]["settings"]
        old: dict[str, Any] = (
            then["schedulers"][i]["settings"] if then else {k: v for k, v in state.items() if k not in _NOT_SETTINGS}
        )
        opt_index = next((j for j, o in enumerate(optimizers) if o is scheduler.optimizer), 0)
        scheduled.add(opt_index)
        changed = [k for k in now if k in old and not _same(old[k], now[k])]
        if not changed:
            continue
        step = int(state.get("last_epoch", 0))
        lrs = lr_at(scheduler, step)
        name = type(scheduler).__name__
        what = ", ".join(f"{k} {_show(old[k])} -> {_show(now[k])}" for k in changed)
        if lrs is None:
            notes.append(
                f"model.scheduler: {name} changed ({what}), but its learning rate is not a function of the step, so "
                "the checkpoint's schedule is kept. Use lightning_lora.schedules.* to change a schedule on resume."
            )
            continue
        previous = state.get("_last_lr") or []
        state.update(copy.deepcopy(now))
        state["_last_lr"] = list(lrs)
        groups = opt_states[opt_index].get("param_groups", [])
        for group, lr, base in zip(groups, lrs, now.get("base_lrs", lrs), strict=False):
            group["lr"] = lr
            if "initial_lr" in group:
                group["initial_lr"] = base
        notes.append(
            f"model.scheduler: {name} {what}: the learning rate at step {step} is {_show(lrs)} "
            f"(the checkpoint's schedule gave {_show(list(previous)) if previous else 'nothing'})."
        )
    if then is None:
        return notes
    for i, (state, now_opt, then_opt) in enumerate(
        zip(opt_states, configured["optimizers"], then["optimizers"], strict=True)
    ):
        skip = {"lr", "initial_lr"} if i in scheduled else {"initial_lr"}
        changes: list[str] = []
        for group, now_group, then_group in zip(
            state.get("param_groups", []), now_opt["groups"], then_opt["groups"], strict=False
        ):
            for key, value in now_group.items():
                if key in skip or key not in then_group or _same(then_group[key], value):
                    continue
                group[key] = copy.deepcopy(value)
                changes.append(f"{key} {_show(then_group[key])} -> {_show(value)}")
        if changes:
            notes.append(f"model.optimizer: {', '.join(dict.fromkeys(changes))} (from the config; state kept).")
    return notes
