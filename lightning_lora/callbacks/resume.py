"""Exact resume: the random state is saved in every checkpoint, a run folder can move, and a signal stops the run at a
step boundary.

Lightning restores the model, optimizer, scheduler, loop counters and (for a stateful loader, see
:mod:`lightning_lora.data.buckets`) the position in the epoch, but not the random number generators. The noise and
timesteps of every step come from them, so a resumed run that starts with fresh generators follows another loss curve.
:class:`RNGState` saves python, numpy, torch CPU and CUDA generator states (of each rank) with each checkpoint and puts
them back right before the first training step after a resume: the latest possible moment, so that nothing that runs
in between (model set-up, evaluation, sample images) can shift the sequence.

:class:`GracefulStop` turns SIGTERM (a cluster's preemption notice, ``kill``) and Ctrl-C into "finish this optimizer
step, write ``last.ckpt``, stop": a checkpoint taken in the middle of a step could not be resumed exactly. A second
Ctrl-C or SIGTERM exits at once, as users expect.

:class:`RunFolder` makes a run folder movable (to another disk or machine, or renamed). Lightning's ``ModelCheckpoint``
keeps absolute paths in its state; restored into a folder with another path it drops its bookkeeping (with a
warning), then finds ``last.ckpt`` "taken" by a file it does not know and writes ``last-v1.ckpt`` beside it: the next
resume picked the older ``last.ckpt`` and rolled the run back. So the recorded paths are rebased onto the folder the
checkpoints are in now, before ``ModelCheckpoint`` reads them, and every checkpoint is stamped with the time it was
saved, which :func:`lightning_lora.checkpoint.resolve_resume` uses to find the newest (modification times do not
survive a copy).

:class:`RunLock` keeps a second ``fit`` out of a run folder that one is training into (a job submitted twice, a second
terminal): both would write checkpoints, the config and the LoRA, interleaved. It is an advisory lock of the operating
system (``flock``) on ``<run folder>/lightning-lora.lock``, so it goes when its process does, ``kill -9`` and a power
cut included: there is never a stale lock to remove by hand. The file holds who holds it (process id, host, start
time, command) for the refusal's one line. Only the process of global rank 0 takes it: the other ranks of a DDP run
are new processes of the same command (Lightning's launcher, torchrun, SLURM) and must not refuse each other.
Where Python has no ``fcntl`` (Windows) there is no lock; on a file system without locks it is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_lora.checkpoint import STAMP
from lightning_lora.errors import ConfigError

try:
    import fcntl
except ImportError:  # Windows: no advisory lock (see the module docstring)
    fcntl = None  # type: ignore[assignment]

__all__ = ["GracefulStop", "RNGState", "RunFolder", "RunLock", "capture_rng", "rebase_paths", "restore_rng"]

LOCK_NAME = "lightning-lora.lock"


def capture_rng() -> dict[str, Any]:
    """All generator states of this process, as tensors and plain values (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState(Callback):
    """Save the random state of every rank in checkpoints and restore it on resume."""

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    @property
    @override
    def state_key(self) -> str:
        return "RNGState"

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        state = capture_rng()
        states: list[Any] = [state]
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            # Every rank's generators (save_checkpoint runs on all ranks; rank 0 writes the file).
            states = [None] * trainer.world_size
            torch.distributed.all_gather_object(states, state)
        checkpoint["rng_states"] = states

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("rng_states")
        if states:
            self._pending = states[trainer.global_rank] if trainer.global_rank < len(states) else states[0]

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # seed_everything gives every rank the same seed, so every rank would draw the same noise and timesteps for
        # its (different) images. A fresh multi-rank run gives rank r the seed base + r instead; a resumed run gets
        # each rank's saved state back below.
        if trainer.world_size > 1 and self._pending is None:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) + trainer.global_rank
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._pending is not None:
            restore_rng(self._pending)
            self._pending = None


_PATH_FIELDS = ("best_model_path", "kth_best_model_path", "last_model_path")


def rebase_paths(state: dict[str, Any], new_dirpath: str) -> dict[str, Any]:
    """A ``ModelCheckpoint`` state whose paths inside its old ``dirpath`` now point into ``new_dirpath``."""
    old = state.get("dirpath")
    if not old or old == new_dirpath:
        return state

    def move(path: Any) -> Any:
        if not isinstance(path, str) or not path:
            return path
        relative = os.path.relpath(path, old)
        return path if relative.startswith(os.pardir) else os.path.join(new_dirpath, relative)

    state = {**state, "dirpath": new_dirpath}
    for field in _PATH_FIELDS:
        if field in state:
            state[field] = move(state[field])
    if isinstance(state.get("best_k_models"), dict):
        state["best_k_models"] = {move(k): v for k, v in state["best_k_models"].items()}
    return state


class RunFolder(Callback):
    """Stamp each checkpoint with the time it is saved; rebase ``ModelCheckpoint`` paths after a move."""

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint.setdefault(STAMP, {})["saved_at_ns"] = time.time_ns()

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Runs before Lightning hands each callback its state (callbacks' on_load_checkpoint come first).
        states = checkpoint.get("callbacks") or {}
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath and isinstance(states.get(cb.state_key), dict):
                states[cb.state_key] = rebase_paths(states[cb.state_key], str(cb.dirpath))


class RunLock:
    """The lock of one run folder (see the module docstring): :meth:`acquire` it before anything is written, and
    :meth:`release` it when the run ends (the operating system releases it if the process dies)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`ConfigError` naming the process that holds it."""
        if fcntl is None or self._fd is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(
                f"trainer.default_root_dir: {self.folder} is in use by another run ({holder}). Wait for it to end, "
                "or choose another trainer.default_root_dir."
            ) from None
        except OSError as e:  # a file system without locks (some network file systems)
            os.close(fd)
            rank_zero_warn(f"cannot lock {self.path} ({e.strerror or e}); nothing keeps a second run out of it.")
            return
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "command": _command()}
        try:
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(info) + "\n").encode())
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Let the next run in; the file stays, empty. Unlocked explicitly: a process forked meanwhile (a data loader's
        worker) shares the lock, which closing this descriptor alone would leave held."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        if fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _command() -> str:
    """This process's command line, shortened for a one-line message."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("__main__.py", "lightning-lora")):
        argv[0] = "lightning-lora"
    text = shlex.join(argv)
    return text if len(text) <= 200 else text[:197] + "..."


def _holder(fd: int) -> str:
    """Who holds the lock, as the lock file says (it may be empty for a moment while its holder writes it)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "a process that is starting"
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: {info.get('command')}"


class GracefulStop(Callback):
    """On SIGTERM or Ctrl-C: finish the optimizer step, save ``last.ckpt``, stop. A second signal exits at once."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self.stopped_by_signal = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = signum
        # A second signal gets the original behaviour (KeyboardInterrupt / termination), or Python's default where the
        # signal was ignored before: Lightning leaves SIGINT ignored after a run it stopped on a KeyboardInterrupt, so
        # a second run in the same process (a notebook) would otherwise never exit on the second Ctrl-C.
        for sig, previous in self._previous.items():
            signal.signal(sig, _exits_at_once(sig, previous))
        name = signal.Signals(signum).name
        print(
            f"\n{name} received: saving a checkpoint after this step. Press Ctrl-C again to exit at once.", flush=True
        )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handler)
        except ValueError:  # not the main thread (e.g. a notebook worker): keep the default behaviour
            self._previous.clear()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        requested = trainer.strategy.reduce_boolean_decision(self.requested is not None, all=False)
        if not requested:
            return
        # Only at an optimizer-step boundary: mid-accumulation state is not what a checkpoint restores.
        epoch_loop = trainer.fit_loop.epoch_loop
        if not epoch_loop._should_accumulate() or epoch_loop.batch_progress.is_last_batch:  # noqa: SLF001
            path = _last_path(trainer)
            if path is not None:
                trainer.save_checkpoint(path)
                rank_zero_info(f"Saved {path} at step {trainer.global_step}; resume with --ckpt_path last.")
            self.stopped_by_signal = True
            trainer.should_stop = True

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for sig, previous in self._previous.items():
            try:
                signal.signal(sig, previous)
            except ValueError:
                pass
        self._previous.clear()


def _exits_at_once(sig: int, previous: Any) -> Any:
    """The handler a second ``sig`` gets: ``previous``, unless that ignores it (``SIG_IGN``, or None: not installed
    from Python), then Python's own (KeyboardInterrupt for SIGINT, termination for SIGTERM)."""
    if previous is None or previous == signal.SIG_IGN:
        return signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
    return previous


def _last_path(trainer: Trainer) -> str | None:
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            return os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
    return str(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt") if trainer.default_root_dir else None
