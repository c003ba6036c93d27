"""tools/bench_cache.py, the GPU caching benchmark, runs end to end on the CPU with ``--tiny``."""

from __future__ import annotations

import json
from pathlib import Path


def test_gpu_benchmark_script_runs_on_cpu(capsys) -> None:
    import importlib.util

    path = Path(__file__).parent.parent / "tools" / "bench_cache.py"
    spec = importlib.util.spec_from_file_location("bench_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(
        ["--tiny", "--n", "6", "--size", "96", "--batch-size", "3", "--workers", "0", "--vae-iters", "1"]
    )
    assert report["images"] == report["latent_files"] == 6 and report["skipped"] == 0
    assert report["images_per_s"] > 0 and report["vae"] == "tiny"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
