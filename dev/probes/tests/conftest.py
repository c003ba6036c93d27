"""The probes' own tests: not part of ``make test`` (pyproject's ``testpaths`` is ``tests``); run them by hand with
``python -m pytest -q -n 0 dev/probes/tests``.

This file puts ``dev/probes`` (the probes) and ``tools`` (``bench.py``, which some probes import) on ``sys.path``, keeps
the hub offline and torch to one thread, as tests/conftest.py does for the product's tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PROBES = Path(__file__).resolve().parents[1]
REPO = PROBES.parents[1]
for folder in (REPO / "tools", PROBES):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402

torch.set_num_threads(1)
