"""tools/bench_table.py: issue 17's table from bench_suite's JSON lines (made-up records; the real ones need a GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import bench_table as bt  # noqa: E402


def rec(table: str | None, result: dict | None = None, dispatch: float | None = None, **extra: object) -> dict:
    out: dict = {"row": 0, "who": "ours", "result": result, **extra}
    if table:
        out["table"] = table
    if dispatch is not None:
        out["host_speed"] = {"dispatch_us": dispatch, "python_loop_ns": 30.0}
    return out


RECORDS = [
    rec(
        "flux_h100/shipped",
        {"s_per_step": 0.7, "batch": 2, "accumulate": 1, "peak_alloc_GiB": 61.9, "planned_peak_GiB": 60.15},
        dispatch=2.98,
    ),
    rec("flux_h100/recipe-eager", {"s_per_step": 0.56, "peak_alloc_GiB": 47.14}, dispatch=1.40),
    rec("flux_h100/recipe-compiled", {"s_per_step": 0.4375}),
    rec(None, {"s_per_step": 9.0}),  # not in the table: a throughput row
    # flux_4090: accumulation 4; the shipped row timed out while sampling and kept its training figures
    rec(
        "flux_4090/shipped",
        {"s_per_step": 1.0, "batch": 1, "accumulate": 4, "partial": "training; outputs follow"},
        error="timeout after 200 s: process group killed",
    ),
    rec("flux_4090/recipe-eager", {"s_per_step": 0.5}),
    rec("flux_4090/recipe-compiled", None, error="exit status 1"),
    rec("flux_4090/second-start", {"s_per_step": 1.1, "to_first_step_s": 27.0}),
    rec("flux_4090/eager-start", {"s_per_step": 2.3, "to_first_step_s": 20.0}),
    rec("flux_4090/eager-start", None, error="timeout after 90 s: process group killed"),  # a second try: failed
]


def test_entries_pair_each_config_with_its_recipe_and_its_starts() -> None:
    h100, f4090 = bt.entries(RECORDS)  # in the order the names first appear; the unmarked row left out
    assert (h100.name, f4090.name) == ("flux_h100", "flux_4090")
    assert h100.seconds("shipped") == pytest.approx(0.35)  # batch 2
    assert h100.ratio("recipe-eager") == pytest.approx(0.625) and h100.ratio("recipe-compiled") == pytest.approx(0.8)
    assert h100.start_ratio() is None and h100.errors == {}
    assert h100.dispatch_us == {"shipped": 2.98, "recipe-eager": 1.40}
    assert f4090.seconds("shipped") == pytest.approx(0.25)  # accumulation 4
    assert f4090.ratio("recipe-eager") == pytest.approx(0.5) and f4090.ratio("recipe-compiled") is None
    assert f4090.start_ratio() == pytest.approx(1.35)  # the failed second try kept the eager start that counted
    assert f4090.errors == {
        "shipped": "timeout after 200 s: process group killed",
        "recipe-compiled": "exit status 1",
        "eager-start": "timeout after 90 s: process group killed",
    }


def test_the_markdown_has_a_line_a_config_with_its_figures_and_failures(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    text = bt.markdown(bt.entries(bt.read([str(path)])))
    header, rule, h100, f4090 = text.splitlines()
    assert header.count("|") == rule.count("|") == h100.count("|") == 9
    assert (
        "| flux_h100 | 0.350 (0.7000) | 0.5600 / 0.4375 | 0.62x / 0.80x | 61.90 (60.15) / 47.14 | - | 2.98 / 1.40 |"
        in (h100)
    )
    assert "| 0.50x / - |" in f4090 and "27.0 / 20.0 s (1.35x)" in f4090 and "recipe-compiled: exit status 1" in f4090


def test_a_row_marked_for_two_lines_takes_its_role_in_both() -> None:
    """One recipe row beside a config as shipped and the same config with an option changed (``cuda_graphs``); a plan
    row may say so, and bench_suite accepts it."""
    import bench_suite as bs

    shared = "sdxl_24gb,sdxl_24gb+cuda_graphs/recipe-eager"
    assert bs.TABLE.match(shared) and not bs.TABLE.match("sdxl_24gb,/recipe-eager")
    base, graphs = bt.entries(
        [
            rec("sdxl_24gb/shipped", {"s_per_step": 0.26}),
            rec("sdxl_24gb+cuda_graphs/shipped", {"s_per_step": 0.15}),
            rec(shared, {"s_per_step": 0.75}, dispatch=1.3),
        ]
    )
    assert (base.name, graphs.name) == ("sdxl_24gb", "sdxl_24gb+cuda_graphs")
    assert base.ratio("recipe-eager") == pytest.approx(0.26 / 0.75)
    assert graphs.ratio("recipe-eager") == pytest.approx(0.2)
    assert base.dispatch_us == graphs.dispatch_us == {"recipe-eager": 1.3}
