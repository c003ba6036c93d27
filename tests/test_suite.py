"""The test suite's own machinery: what ``make test`` relies on to run in its time on a 2-core CI machine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GROUPED = textwrap.dedent(
    """
    import os
    from pathlib import Path

    import pytest


    @pytest.mark.xdist_group("shared")
    @pytest.mark.parametrize("i", range(4))
    def test_grouped(i):
        Path(os.environ["GROUP_OUT"], str(i)).write_text(os.environ["PYTEST_XDIST_WORKER"])
    """
)


@pytest.mark.subprocess
def test_an_xdist_group_runs_in_one_process(tmp_path: Path) -> None:
    """``make test`` hands each ``xdist_group`` to one process (``--dist loadgroup``): the shared 2-process DDP run of
    tests/test_fsdp.py and tests/test_multinode.py, each family's runs in tests/families/test_contract.py. pytest 9.2
    with pytest-xdist 3.8 spread a group over both processes without a word (pyproject.toml pins pytest below 9.2)."""
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env={**os.environ, "GROUP_OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    workers = {path.name: path.read_text() for path in out.iterdir()}
    assert len(workers) == 4 and len(set(workers.values())) == 1, workers
