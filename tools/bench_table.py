"""Issue 17's table from the JSON lines of ``tools/bench_suite.py``: each config as shipped beside the recipe.

    python tools/bench_table.py dev/benchmarks/2026-12-07/results57*.jsonl

The rows a plan marks with ``"table": "<name>/<role>"`` (bench_suite's module docstring; ``"<a>,<b>/<role>"`` puts a
row in both lines) are grouped by name, in the order the names first appear: per image, our seconds per optimizer step
over batch x accumulation against the recipe's batch-1 step, both ratios, the peak beside the planner's and the eager
recipe's, the second start against the eager start (time to the first step), and each side's host speed just before
its row (``host_speed``'s dispatch, µs), since host-bound rows follow the host. A failed row's error is shown beside
what figures it kept. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_suite import TABLE_ROLES  # beside this file

# The figure each role's row is there for: a start's time to its first step, else the step.
NEEDS = {role: "to_first_step_s" if role.endswith("-start") else "s_per_step" for role in TABLE_ROLES}


def result_of(rec: dict[str, Any]) -> dict[str, Any] | None:
    """A row's figures: its last whole result (``results``' last) or else its ``result``; None where it printed none."""
    if rec.get("results"):
        return rec["results"][-1]
    res = rec.get("result")
    return res if isinstance(res, dict) else None


def per_image(res: dict[str, Any]) -> float | None:
    """Seconds per image: a step over its batch and accumulation (1 each where the result does not say, as the
    recipe's batch-1 rows)."""
    step = res.get("s_per_step")
    if not isinstance(step, (int, float)):
        return None
    return step / ((res.get("batch") or 1) * (res.get("accumulate") or 1))


@dataclass
class Entry:
    """One config's line: its rows' figures by role, and the errors of those that failed."""

    name: str
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    dispatch_us: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def seconds(self, role: str) -> float | None:
        res = self.figures.get(role)
        return per_image(res) if res else None

    def ratio(self, recipe: str) -> float | None:
        ours, theirs = self.seconds("shipped"), self.seconds(recipe)
        return ours / theirs if ours is not None and theirs else None

    def start_ratio(self) -> float | None:
        second = self.figures.get("second-start", {}).get("to_first_step_s")
        eager = self.figures.get("eager-start", {}).get("to_first_step_s")
        return second / eager if second is not None and eager else None


def entries(records: list[dict[str, Any]]) -> list[Entry]:
    """The marked records grouped by name (first appearance first); a role seen twice keeps its last row with the
    figure it is there for (:data:`NEEDS`)."""
    by_name: dict[str, Entry] = {}
    for rec in records:
        if not rec.get("table"):
            continue
        names, role = rec["table"].split("/", 1)
        res = result_of(rec)
        counts = res if res is not None and NEEDS[role] in res else None  # the figure the role is there for
        speed = (rec.get("host_speed") or {}).get("dispatch_us")
        for name in names.split(","):  # one row may take its role in several lines
            entry = by_name.setdefault(name, Entry(name))
            if rec.get("error"):  # shown even where the figures it kept count (a row stopped while sampling)
                entry.errors[role] = rec["error"]
            if counts is not None:
                entry.figures[role] = counts
                if speed is not None:
                    entry.dispatch_us[role] = speed
    return list(by_name.values())


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _s(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(table: list[Entry]) -> str:
    """The table as Markdown: one line a config."""
    lines = [
        "| config | per image (s/step) | recipe eager / compiled | ratio eager / compiled "
        "| peak GiB (planned) / recipe's | second / eager start | host µs ours / recipe | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in table:
        shipped = e.figures.get("shipped", {})
        peak = shipped.get("peak_alloc_GiB")
        planned = shipped.get("planned_peak_GiB")
        theirs = e.figures.get("recipe-eager", {}).get("peak_alloc_GiB")
        second = e.figures.get("second-start", {}).get("to_first_step_s")
        eager = e.figures.get("eager-start", {}).get("to_first_step_s")
        start = "-" if e.start_ratio() is None else f"{second:.1f} / {eager:.1f} s ({e.start_ratio():.2f}x)"
        host = f"{_s(e.dispatch_us.get('shipped'), 2)} / {_s(e.dispatch_us.get('recipe-eager'), 2)}"
        failed = "; ".join(f"{role}: {error}" for role, error in e.errors.items()) or ""
        lines.append(
            f"| {e.name} | {_s(e.seconds('shipped'))} ({_s(shipped.get('s_per_step'), 4)}) "
            f"| {_s(e.seconds('recipe-eager'), 4)} / {_s(e.seconds('recipe-compiled'), 4)} "
            f"| {_x(e.ratio('recipe-eager'))} / {_x(e.ratio('recipe-compiled'))} "
            f"| {_s(peak, 2)} ({_s(planned, 2)}) / {_s(theirs, 2)} | {start} | {host} | {failed} |"
        )
    return "\n".join(lines)


def read(paths: list[str]) -> list[dict[str, Any]]:
    """Every JSON line of the files, in order."""
    return [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench_suite's --out files")
    print(markdown(entries(read(p.parse_args(argv).results))))


if __name__ == "__main__":
    main()
