"""The caching probes (dev/probes/bench_text.py, dev/probes/bench_cache.py) run on the CPU with tiny models (the same
code path their GPU numbers come from)."""

from __future__ import annotations

import json

import pytest


def test_bench_text_measures_quantized_text_encoders(capsys) -> None:
    import bench_text

    sys_argv = ["bench_text.py", "--tiny", "--modes", "none", "fp8", "--batch", "2", "--tlen", "16", "--repeat", "1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", sys_argv)
        bench_text.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["mode"] for line in lines] == ["none", "fp8"]
    assert all("error" not in line for line in lines), lines
    plain, fp8 = lines
    assert plain["quantized_layers"] == 0 and fp8["quantized_layers"] > 0
    assert 0.9 < fp8["cosine_vs_bf16"] < 1.0  # close to the bf16 encoders' embeddings, not the same


def test_gpu_benchmark_script_runs_on_cpu(capsys) -> None:
    """dev/probes/bench_cache.py, the GPU caching benchmark, runs end to end on the CPU with ``--tiny``."""
    import bench_cache

    report = bench_cache.main(
        ["--tiny", "--n", "6", "--size", "96", "--batch-size", "3", "--workers", "0", "--vae-iters", "1"]
    )
    assert report["images"] == report["latent_files"] == 6 and report["skipped"] == 0
    assert report["images_per_s"] > 0 and report["vae"] == "tiny"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
