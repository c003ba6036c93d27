"""What the console shows while a ``lightning-lora`` command runs: our lines, the progress bar and the warnings a user
must act on. Everything else the libraries say goes to ``<run folder>/lightning-lora.log`` (``fit``, ``cache``), or
nowhere (``plan``, ``export``: no run folder).

A plain run of the underlying libraries prints, before the first step: Lightning's "GPU available" / "TPU available"
lines and its litlogger tip, "Seed set to", the model summary table, transformers' notes that torchvision is not
installed, bitsandbytes' "Failed to load CPU gemm_4bit_forward" (even without NF4), torchao's import notes, Lightning's
hint that the data loader has few workers (ours serves cached tensors), and a "checkpoint directory is not empty" note
on every resume. None of it asks the user to do anything, and it buries what does. :class:`Console` routes it:

* transformers', diffusers' and huggingface_hub's loggers lose their console handler and write to the run log (the
  hub's retries while the network is down too: the error that follows says what to do);
* a record from any other library that logs with no handler of its own would reach Python's handler of last resort,
  which prints it: :class:`LastResort` takes that place (``logging.lastResort``) and writes it to the run log instead
  (bitsandbytes' CPU kernel note on a CPU with AVX-512 BF16, and the note of the ``kernels`` package that
  transformers >= 5.25 installs, that it skips its publisher check offline). Our own notes still print (on stdout),
  and any library's error (on stderr);
* Lightning's console handler drops its chatter lines (:data:`CHATTER`), which go to the run log;
* a Python warning is shown when it comes from lightning-lora or from Lightning (minus :data:`WARNING_CHATTER`), as
  one plain line (``warning: ...``; the run log keeps where it was raised); any other library's warning goes to the
  run log, and the run summary says how many there were.

One stream: the lines of lightning-lora and Lightning (the start summary, the cache summary, the evaluation losses,
warnings) go to stdout, through the progress bar's ``write`` (:func:`~lightning_lora.callbacks.monitor.console_line`),
so none is printed over the bar and ``2>/dev/null`` loses none of them; stderr carries errors only.

Records that arrive before the run folder is known (imports, config parsing) wait in memory and are written when it
is.
"""

from __future__ import annotations

import logging
import logging.handlers
import re
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, TextIO

__all__ = ["CHATTER", "LOG_NAME", "WARNING_CHATTER", "Console", "LastResort", "quiet_library_loggers"]

LOG_NAME = "lightning-lora.log"

CHATTER = re.compile(
    "|".join(
        (
            r"^GPU available:",
            r"^TPU available:",
            r"^HPU available:",
            r"^💡 Tip:",
            r"^(\[rank: \d+\] )?Seed set to",
            r"^`Trainer\.fit` stopped:",
            r"^Restoring states from the checkpoint path",
            r"^Restored all states from the checkpoint",
            r"^LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES",
            r"^You are using a CUDA device",
            r"^Initializing distributed:",
            r"^-{10,}",
            r"^distributed_backend=",
            r"^All distributed processes registered",
        )
    )
)
"""Lightning's informational lines that ask nothing of the user."""

WARNING_CHATTER = re.compile(
    r"does not have many workers|Checkpoint directory .* exists and is not empty|"
    r"Failed to load CPU gemm_4bit_forward|Unable to import torchao|The number of training batches .* is smaller than"
)
"""Warnings from Lightning or lightning-lora's dependencies that the run log keeps instead of the console."""

_OURS = ("lightning_lora",)
_SHOWN_PACKAGES = ("lightning_lora", "lightning", "lightning_fabric", "pytorch_lightning")


def console_line(text: str) -> None:
    """:func:`lightning_lora.callbacks.monitor.console_line`, imported when first used: importing this module must not
    import the training stack (the demo sets the libraries' verbosity before they are imported)."""
    from lightning_lora.callbacks.monitor import console_line as write

    write(text)


def _package_of(filename: str) -> str:
    parts = Path(filename).parts
    for name in _SHOWN_PACKAGES:
        if name in parts:
            return name
    return ""


def _is_ours(name: str) -> bool:
    return any(name == package or name.startswith(f"{package}.") for package in _OURS)


class LastResort(logging.Handler):
    """Python's handler of last resort while a command runs (``logging.lastResort``: it receives the records of every
    logger that has no handler up its chain). lightning-lora's notes print on stdout with our other lines
    (:func:`~lightning_lora.callbacks.monitor.console_line`); its errors, and any library's, go to the handler it
    replaced (which prints them on stderr); a library's other records go to ``target`` (the run log), or nowhere when
    ``target`` is None. ``restore()`` puts the previous handler back."""

    def __init__(self, target: logging.Handler | None) -> None:
        self.previous = logging.lastResort
        super().__init__(self.previous.level if self.previous is not None else logging.WARNING)
        self.target = target

    def install(self) -> LastResort:
        logging.lastResort = self
        return self

    def restore(self) -> None:
        if logging.lastResort is self:
            logging.lastResort = self.previous

    def emit(self, record: logging.LogRecord) -> None:
        ours = _is_ours(record.name)
        if ours and record.levelno < logging.ERROR:
            console_line(record.getMessage())  # our notes join our other lines on stdout
        elif (ours or record.levelno >= logging.ERROR) and self.previous is not None:
            self.previous.handle(record)
        if not ours and self.target is not None:
            self.target.handle(record)


def quiet_library_loggers() -> None:
    """For the verbs (``plan``, ``cache``, ``export``), which end their process after their :class:`Console` closes: a
    library that logs with no handler of its own prints its errors only (:class:`LastResort`, for the rest of the
    process)."""
    LastResort(target=None).install()


class Console:
    """Routes library chatter to the run log (see the module docstring). ``install()`` at the start of the command,
    ``attach(run_folder)`` once the run folder is known, ``close()`` at the end."""

    active: ClassVar[Console | None] = None
    """The console of the command that runs now (installed and not yet closed), or None (code run from Python)."""

    def __init__(self) -> None:
        self.memory = logging.handlers.MemoryHandler(capacity=10**6, flushLevel=logging.CRITICAL + 10)
        self.memory.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        self.file: logging.FileHandler | None = None
        self.path: Path | None = None
        self.library_warnings = 0
        self._showwarning: Any = None
        self._filtered: list[logging.Handler] = []
        self._last_resort: LastResort | None = None
        self._hub_handlers: list[logging.Handler] | None = None

    # -- setting up ---------------------------------------------------------------------------------------------
    def install(self) -> None:
        import lightning.pytorch  # noqa: F401 - its console handlers exist once it is imported

        Console.active = self
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._show
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # whichever holds the console handler
            for handler in logging.getLogger(name).handlers:
                handler.addFilter(self._lightning_line)
                self._filtered.append(handler)
        for library in ("transformers", "diffusers"):
            try:
                module = __import__(f"{library}.utils.logging", fromlist=["logging"])
            except ImportError:  # pragma: no cover - both are dependencies
                continue
            module.disable_default_handler()
            module.add_handler(self.memory)
        hub = logging.getLogger("huggingface_hub")  # its own console handler (huggingface_hub.utils.logging)
        self._hub_handlers = list(hub.handlers)
        hub.handlers = [self.memory]
        self._last_resort = LastResort(target=self.memory).install()

    def attach(self, folder: str | Path) -> None:
        """Write what waited in memory, and everything from now on, to ``<folder>/lightning-lora.log``."""
        if self.file is not None:
            return
        folder = Path(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.file = logging.FileHandler(folder / LOG_NAME, encoding="utf-8", errors="backslashreplace")
        except OSError:
            return  # a folder that cannot be written is reported by the start-up check, not here
        self.file.setFormatter(self.memory.formatter)
        self.path = folder / LOG_NAME
        self.memory.setTarget(self.file)
        self.memory.flush()

    def close(self) -> None:
        if Console.active is self:
            Console.active = None
        if self._showwarning is not None:
            warnings.showwarning = self._showwarning
            self._showwarning = None
        for handler in self._filtered:
            handler.removeFilter(self._lightning_line)
        self._filtered.clear()
        if self._last_resort is not None:
            self._last_resort.restore()
            self._last_resort = None
        if self._hub_handlers is not None:
            logging.getLogger("huggingface_hub").handlers = self._hub_handlers
            self._hub_handlers = None
        self.memory.flush()
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> Console:
        self.install()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- routing -----------------------------------------------------------------------------------------------
    def _lightning_line(self, record: logging.LogRecord) -> bool:
        """Chatter to the run log, information (ours and Lightning's) to stdout; what Lightning's handler still prints
        (on stderr): its errors."""
        message = record.getMessage()
        if CHATTER.search(message):
            self.memory.handle(record)
            return False
        if record.levelno < logging.WARNING:
            console_line(message)
            return False
        return True

    def _show(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = str(message)
        package = _package_of(filename)
        record = logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, text, None, None)
        record.msg = f"{category.__name__}: {text} ({filename}:{lineno})"
        self.memory.handle(record)  # the run log says where each warning was raised
        if package and not WARNING_CHATTER.search(text):
            console_line(f"warning: {text}")
        elif package not in _OURS:
            self.library_warnings += 1

    def summary(self) -> str | None:
        """One line for the run summary: where the libraries' messages went."""
        if self.path is None:
            return None
        extra = f" ({self.library_warnings} library warnings)" if self.library_warnings else ""
        return f"  library messages:         {self.path}{extra}"
