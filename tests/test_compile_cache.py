"""The compile cache of ``model.compile_blocks`` (issue 17), with the real inductor, read from torch's own counters.

A second run with the same settings must load every compiled graph from ``TORCHINDUCTOR_CACHE_DIR`` (inductor's FX
graph cache and AOTAutograd's cache: hits, no misses), also when only the learning rate or the seed differ; a run
whose compiled graph differs (another LoRA rank) must compile it (misses). Each run is a fresh process
(tests/helpers/compile_step.py), as a user's next run is.

The runs hand the attention's gradient over as CUDA runs do (:mod:`lightning_lora.model.attention`): a custom
``autograd.Function`` in the graph, which AOTAutograd's cache refuses unless told (torch's
``autograd_cache_allow_custom_autograd_functions``); refused, every start of a CUDA run traced and partitioned its
attention blocks' graphs again (dev/LOG.md, call 52g: 0 AOTAutograd hits of 3 graphs on SD1.5's transformer blocks).

Kept small (about 60 s on the 2-core CI machine, most of it gcc compiling ~10 C++ kernels and two interpreter starts):
the tiny FLUX with one single-stream block, one graph forward and one backward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import command_env

pytestmark = pytest.mark.subprocess


def _steps(model_dir: Path, cache: Path, *runs: str) -> list[dict[str, Any]]:
    """Torch's compile counters of each of ``runs`` (``rank=R,seed=S,lr=LR``), stepped in one fresh process."""
    command = [sys.executable, "-m", "helpers.compile_step", str(model_dir), *runs, "--handover"]
    done = subprocess.run(
        command, env=command_env(TORCHINDUCTOR_CACHE_DIR=str(cache)), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def test_a_second_run_compiles_nothing_and_the_cache_key_follows_the_graph(tiny_flux_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "torch-compile"
    (first,) = _steps(tiny_flux_dir, cache, "rank=2,seed=0,lr=1e-3")
    # An empty cache: every graph compiled (forward and backward by inductor, the pair by AOTAutograd), none loaded.
    assert first["graphs"] >= 1
    assert first["fxgraph_cache_miss"] >= 2 and first["autograd_cache_miss"] >= 1, first
    assert first["fxgraph_cache_hit"] == 0 and first["autograd_cache_hit"] == 0, first
    assert first["fxgraph_cache_bypass"] == 0 and first["autograd_cache_bypass"] == 0, first  # cacheable at all

    # The next process, another learning rate and seed (neither is in a compiled graph): everything loaded.
    again, other_rank = _steps(tiny_flux_dir, cache, "rank=2,seed=1,lr=1e-2", "rank=3,seed=0,lr=1e-3")
    assert again["graphs"] == first["graphs"]  # dynamo still traces (its guards are not cached)...
    assert again["fxgraph_cache_miss"] == 0 and again["autograd_cache_miss"] == 0, again  # ...nothing compiles
    assert again["fxgraph_cache_hit"] == first["fxgraph_cache_miss"], again
    assert again["autograd_cache_hit"] == first["autograd_cache_miss"], again
    assert again["loss"] != first["loss"]  # the seed did change the step

    # Another rank changes the LoRA weights' shapes in the graph: a new key, compiled, not a stale entry loaded.
    assert other_rank["fxgraph_cache_miss"] >= 2 and other_rank["autograd_cache_miss"] >= 1, other_rank
    assert other_rank["fxgraph_cache_hit"] == 0 and other_rank["autograd_cache_hit"] == 0, other_rank
    # lora_B starts at zero: the first loss does not depend on the rank; the compiled code of rank 3 gives it.
    assert other_rank["loss"] == pytest.approx(first["loss"], rel=1e-5)
