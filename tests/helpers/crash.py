"""Callbacks that simulate crashes, for the resume tests.

A config loads them by class path (``helpers.crash.KillAt``), in-process (tests/ is on ``sys.path``, see
tests/conftest.py) or in the process :func:`helpers.cli.fit_in_subprocess` starts (tests/ is on its ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class KillAt(Callback):
    """SIGKILL this process when the training loop is about to run global batch ``batch`` (0-based, all epochs).

    Nothing runs after a SIGKILL (no ``finally``, no ``atexit``): it is a power cut from the process's point of view.
    With gradient accumulation, a ``batch`` that is not a multiple of the accumulation lands between micro-batches.
    """

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop.total_batch_idx >= self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


class InterruptAt(Callback):
    """Send ``signal_name`` (SIGINT is Ctrl-C) to this process at global batch ``batch``, ``times`` times.

    To this thread (the training loop's), so that each signal's handler runs before the next is sent: sent to the
    process, a signal may land on another of its threads after ``os.kill`` returns, and two signals still pending
    together are delivered as one."""

    def __init__(self, batch: int, times: int = 1, signal_name: str = "SIGINT") -> None:
        self.batch = batch
        self.times = times
        self.signal = signal.Signals[signal_name]

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop.total_batch_idx == self.batch:
            for _ in range(self.times):
                signal.pthread_kill(threading.get_ident(), self.signal)
