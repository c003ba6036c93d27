"""Atomic file writes.

Every file lightning-lora writes (cache entries, LoRA exports, sample images) goes through :func:`atomic_write`:
the bytes are written to a temporary file in the same folder, flushed and fsynced, then renamed over the target.
``os.replace`` is atomic on POSIX and Windows, so a crash or a full disk leaves either the old file or the new one,
never half a file that a later run would load. A failed write raises an ``OSError`` that names the file it was
writing (a bare ``write()`` error names none), so the command line can say which file and why in one line
(:func:`write_failure`: a full disk, no permission, a read-only file system, a file larger than the file system or the
process's file-size limit allows).

**File-size limits.** A write past the limit of ``ulimit -f`` (``RLIMIT_FSIZE``) makes the kernel send ``SIGXFSZ``,
whose default action kills the process without a word; CPython ignores ``SIGXFSZ`` when it starts, so the write fails
with ``EFBIG`` instead and is reported like any other failed write. FAT32 holds at most 4 GiB - 1 byte in a file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save

__all__ = ["atomic_write", "atomic_write_bytes", "fsync_dir", "save_safetensors", "write_failure"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()


@contextlib.contextmanager
def _temporary_sibling(path: Path) -> Iterator[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp creates 0600; give the file the mode a plain open() would (shared caches, files written in Docker).
    os.chmod(tmp, _FILE_MODE)
    try:
        yield Path(tmp)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp_path)`` and move the finished file to ``path`` atomically."""
    path = Path(path)
    try:
        with _temporary_sibling(path) as tmp:
            try:
                write(tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as e:
                if e.errno is None or (e.filename is not None and str(e.filename) != str(tmp)):
                    raise
                raise OSError(e.errno, e.strerror, str(path)) from e  # name the file, not its temporary sibling
    except OSError as e:
        # e.g. mkstemp in a read-only folder, naming its temporary sibling or no file at all: name the file.
        if e.errno is not None and (e.filename is None or Path(e.filename).name.startswith(f".{path.name}.")):
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a power loss could otherwise undo it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open folders; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> Path:
    """Write tensors as a safetensors file, atomically. Tensors are made contiguous and moved to the CPU."""
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return atomic_write_bytes(path, save(cpu, metadata=metadata))


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``, ``RLIMIT_FSIZE``), or None when there is none (or the
    platform has no such limit)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def write_failure(e: OSError, option: str) -> str | None:
    """The one-line message for a file that cannot be written, naming the file, the reason and the fix; None for an
    error that is not about writing. ``option`` is what chooses where the file goes (``--out``)."""
    what = f"cannot write {e.filename or 'a file'} ({e.strerror or e})"
    if e.errno == errno.EFBIG:
        limit = file_size_limit()
        if limit is not None:
            return (
                f"{what}: it would be larger than this process's file-size limit of {_size(limit)} (ulimit -f); "
                "raise the limit (ulimit -f unlimited, or ask the cluster's administrator)"
            )
        return (
            f"{what}: it would be larger than its file system holds in one file (FAT32 holds at most 4 GiB); choose "
            f"a {option} on another disk (NTFS, exFAT, ext4, APFS)"
        )
    fixes = {
        errno.ENOSPC: f"the disk is full: free some space, or choose a {option} on another disk",
        errno.EDQUOT: f"the disk quota is used up: free some space, or choose a {option} on another disk",
        errno.EACCES: f"no permission: fix the permissions, or choose another {option}",
        errno.EPERM: f"no permission: fix the permissions, or choose another {option}",
        errno.EROFS: f"the file system is read-only: choose another {option}",
    }
    fix = fixes.get(e.errno) if e.errno is not None else None
    return None if fix is None else f"{what}; {fix}"
