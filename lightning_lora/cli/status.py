"""The verbs' exit status (see :mod:`lightning_lora.cli`): 0 done; 2 (:data:`USER_ERROR`) a problem the user can fix,
printed as one line without a traceback; 128 + the signal after Ctrl-C / SIGTERM (:func:`interrupted`).

A problem the user can fix is a :class:`~lightning_lora.errors.ConfigError` (it names the option and the fix), or a
file that cannot be written (full disk, no permission: :func:`write_error` names the file and what to do). Anything
else is a bug in lightning-lora or a library, and keeps its traceback.
"""

from __future__ import annotations

import sys

from lightning_lora.errors import ConfigError
from lightning_lora.io import write_failure

__all__ = ["USER_ERROR", "interrupted", "user_error", "write_error"]

USER_ERROR = 2
"""The exit status of a problem the user can fix (argparse's for a wrong argument too)."""


def interrupted(signum: int) -> int:
    """The exit status after the signal ``signum`` stopped a command: 128 + its number, the shell's convention
    (130 after Ctrl-C, 143 after SIGTERM), so a job scheduler can tell an interrupted run from a finished one."""
    return 128 + int(signum)


def write_error(e: OSError) -> str | None:
    """The one-line message for a file that cannot be written (full disk, no permission, a file-size limit:
    :func:`~lightning_lora.io.write_failure`), with what to do next; None for other errors."""
    message = write_failure(e, "trainer.default_root_dir / data.cache_dir")
    if message is None:
        return None
    return (
        f"{message}. Files already written are intact (every write is atomic): run the same command again to continue "
        "(add --ckpt_path last if training had started)."
    )


def user_error(prog: str, error: ConfigError | OSError) -> int:
    """Print ``error`` as the one line ``<prog>: error: ...`` on stderr and return :data:`USER_ERROR`; an ``OSError``
    that is not a file the user cannot write (:func:`write_error`) is raised again, with its traceback."""
    message = str(error) if isinstance(error, ConfigError) else write_error(error)
    if message is None:
        raise error
    print(f"{prog}: error: {message}", file=sys.stderr)
    return USER_ERROR
