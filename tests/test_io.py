"""Atomic writes: the old file survives a failed write, no temporary files are left, safetensors round-trips."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lightning_lora.io import atomic_write, atomic_write_bytes, save_safetensors


def _only(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_atomic_write_creates_file_and_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "out.bin"
    result = atomic_write(target, lambda tmp: tmp.write_bytes(b"hello"))
    assert result == target and target.read_bytes() == b"hello"
    assert _only(target.parent) == ["out.bin"]


def test_atomic_write_writes_to_a_sibling_temp_file(tmp_path: Path) -> None:
    seen: list[Path] = []

    def write(tmp: Path) -> None:
        seen.append(tmp)
        assert tmp.parent == tmp_path and tmp != tmp_path / "out.bin"  # same folder: os.replace stays atomic
        assert not (tmp_path / "out.bin").exists()  # nothing visible at the target while writing
        tmp.write_bytes(b"x")

    atomic_write(tmp_path / "out.bin", write)
    assert seen and not seen[0].exists()


def test_atomic_write_replaces_existing(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert _only(tmp_path) == ["out.txt"]


@pytest.mark.parametrize("partial", [False, True])
def test_atomic_write_failure_keeps_old_file(tmp_path: Path, partial: bool) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old content")

    def write(tmp: Path) -> None:
        if partial:
            tmp.write_bytes(b"half a fi")  # a crash half way through
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, write)
    assert target.read_text() == "old content"
    assert _only(tmp_path) == ["out.txt"]  # no temp file left behind


def test_atomic_write_failure_without_old_file(tmp_path: Path) -> None:
    def write(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "new.bin", write)
    assert _only(tmp_path) == []


def test_save_safetensors_round_trip(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "int": torch.arange(7, dtype=torch.int64),
        "strided": base.t(),  # non-contiguous: must be made contiguous, not rejected
        "grad": torch.randn(2, 2, generator=g, requires_grad=True),
    }
    path = save_safetensors(tensors, tmp_path / "t.safetensors", metadata={"rank": "4", "note": "ünïcode"})
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype
        assert torch.equal(loaded[k], v.detach()), k
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"rank": "4", "note": "ünïcode"}
    assert _only(tmp_path) == ["t.safetensors"]


def test_atomic_write_respects_umask(tmp_path: Path) -> None:
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = atomic_write_bytes(tmp_path / "lora.safetensors", b"x")
    finally:
        os.umask(old)
    # Like open(): 0666 & ~umask, so exported LoRAs and a shared cache are readable by others (e.g. outside Docker).
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_real_file_size_limit_fails_the_write_with_efbig_naming_file_and_limit(tmp_path: Path) -> None:
    """Under ``ulimit -f`` a write past the limit raises SIGXFSZ, which kills a process by default: the command must
    get EFBIG instead (CPython ignores SIGXFSZ), and the message names the file and the limit; no temporary is left."""
    import subprocess

    script = (
        "import resource, sys\n"
        "from lightning_lora.io import atomic_write_bytes, write_failure\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        "    atomic_write_bytes(sys.argv[1], b'0' * 200_000)\n"
        "except OSError as e:\n"
        "    print(write_failure(e, '--out'))\n"
    )
    target = tmp_path / "big.safetensors"
    done = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -25 (SIGXFSZ) if the signal killed it
    assert done.stdout.strip() == (
        f"cannot write {target} (File too large): it would be larger than this process's file-size limit of 64.0 KiB "
        "(ulimit -f); raise the limit (ulimit -f unlimited, or ask the cluster's administrator)"
    )
    assert _only(tmp_path) == []
