"""The CPU demo's entry point (:mod:`lightning_lora.cli.demo`), as ``make demo`` runs it."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.subprocess
def test_the_demo_prints_its_two_lines(tmp_path: Path) -> None:
    """`make demo`'s first step, as it runs: the tiny pipelines and photos are written, and the console shows where
    they are and nothing else (no library note, no save progress bar)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_lora.cli.demo", "--out", str(tmp_path / ".demo")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert [line.split(":")[0] for line in lines] == ["demo model", "demo photos"], lines
    assert (tmp_path / ".demo" / "tiny-flux" / "model_index.json").is_file()
