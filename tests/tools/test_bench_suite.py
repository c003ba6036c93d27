"""tools/bench_suite.py on the CPU: plan files, phases and GPUs, timeouts, the JSON line of a row.

The rows' real commands (tools/bench.py, the reference recipe) need a GPU; these tests swap the command builder for
tiny ``python -c`` scripts, which is all the runner sees of a row.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import bench_suite as bs  # noqa: E402


def write_plan(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def fake_commands(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """Every row runs ``python -S -c code ARGS...`` (the row's args after ``{outdir}`` is filled in)."""

    def command_for(row: bs.Row, ref: str | None, outdir: str) -> list[str]:
        return [sys.executable, "-S", "-c", textwrap.dedent(code), *bs.row_args(row, outdir)]

    monkeypatch.setattr(bs, "command_for", command_for)


def alive(pid: int) -> bool:
    """Running (a zombie left to an init that does not reap counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def test_a_plan_file_parses_into_rows(tmp_path: Path) -> None:
    plan = write_plan(
        tmp_path / "call.plan.jsonl",
        """
        # a comment, then a blank line

        {"who": "ours", "args": "--rank 4 --profile '{outdir}/p f.txt'", "timeout": 120, "gpu": 0, "phase": 2}
        {"who": "ref", "args": ["flux-bf16", "--sdp", "nocudnn"], "gpu": "0,1", "note": "beside row 1"}
        {"who": "ours", "script": "flop_floor.py", "args": "", "table": "flux_4090/second-start"}
        """,
    )
    rows = bs.load_plan(plan, default_timeout=77)
    assert [r.table for r in rows] == [None, None, "flux_4090/second-start"]
    assert [(r.index, r.who, r.phase, r.gpu, r.timeout) for r in rows] == [
        (1, "ours", 2, 0, 120),
        (2, "ref", 1, "0,1", 77),
        (3, "ours", 1, None, 77),
    ]
    assert rows[0].args == ["--rank", "4", "--profile", "{outdir}/p f.txt"]
    assert rows[1].args == ["flux-bf16", "--sdp", "nocudnn"] and rows[1].note == "beside row 1"
    assert rows[2].script == "flop_floor.py" and rows[2].args == []

    # the real commands: the running interpreter, the tool beside bench_suite.py or --ref, {outdir} filled in
    bench = str(REPO / "tools" / "bench.py")
    assert bs.command_for(rows[0], None, "/o") == [sys.executable, bench, "--rank", "4", "--profile", "/o/p f.txt"]
    assert bs.command_for(rows[1], ".bench/ref_recipe.py", "/o") == [
        sys.executable,
        ".bench/ref_recipe.py",
        *rows[1].args,
    ]
    assert bs.command_for(rows[2], None, "/o") == [sys.executable, str(REPO / "tools" / "flop_floor.py")]
    with pytest.raises(SystemExit, match="--ref"):
        bs.command_for(rows[1], None, "/o")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"who": "theirs", "args": ""}', "'who'"),
        ('{"who": "ours", "args": "", "gpus": 0}', "unknown key"),
        ('{"who": "ours", "args": "", "timeout": 0}', "'timeout'"),
        ('{"who": "ours", "args": "", "gpu": "zero"}', "'gpu'"),
        ('{"who": "ours", "args": "", "phase": "2"}', "'phase'"),
        ('{"who": "ref", "args": "", "script": "flop_floor.py"}', "'script'"),
        ('{"who": "ours", "args": 5}', "'args'"),
        ('{"who": "ours", "args": "", "cache": "../home"}', "'cache'"),
        ('{"who": "ours", "args": "", "table": "flux_4090/warm-start"}', "'table'.*second-start"),
        ('{"who": "ours", "args": "", "table": "flux_4090"}', "'table'"),
        ('{"who": "ours", "args": "", "table": "sdxl_24gb,/recipe-eager"}', "'table'"),
        ("--quant nf4", "not a JSON object"),
    ],
)
def test_a_bad_plan_row_is_refused_with_its_line(tmp_path: Path, line: str, message: str) -> None:
    plan = write_plan(tmp_path / "bad.plan.jsonl", '{"who": "ours", "args": "--rank 4"}\n' + line + "\n")
    with pytest.raises(SystemExit, match=rf"bad\.plan\.jsonl:2: .*{message}"):
        bs.load_plan(plan)


#: Tools that dated plans name and that have been removed since (the commit that removed each): their rows parse, and
#: the plans that name them are not dry-run.
REMOVED_TOOLS = {"probe_ckpt_inside.py": "786f378: its checkpointing is the product's"}
#: One-off probes that dated plans name and that live in dev/probes/ since (bench_suite runs a tool beside itself, so
#: those plans are not dry-run either; to run such a row again, copy the probe into tools/).
MOVED_PROBES = {"bench_text.py", "fp8_numerics.py", "fp8_probe.py", "ref_sd15.py", "sdpa_probe.py"}


def test_the_dated_plans_parse(capsys: pytest.CaptureFixture[str]) -> None:
    plans = sorted((REPO / "dev" / "benchmarks").glob("*/call*.plan.jsonl"))
    assert len(plans) >= 10
    removed_named, moved_named = set(), set()
    for plan in plans:
        rows = bs.load_plan(plan)
        gone = {row.script for row in rows if row.script in REMOVED_TOOLS}
        moved = {row.script for row in rows if row.script in MOVED_PROBES}
        if gone or moved:
            removed_named |= gone
            moved_named |= moved
            continue
        bs.main(["--plan", str(plan), "--ref", ".bench/ref_recipe.py", "--out", "/o/r.jsonl", "--dry-run"])
        printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(printed) == len(rows) and all(p["command"].startswith(sys.executable) for p in printed)
    assert removed_named == set(REMOVED_TOOLS)  # a tool that no plan names any more leaves this list
    assert not any((REPO / "tools" / name).exists() for name in REMOVED_TOOLS)
    assert moved_named == MOVED_PROBES
    for name in MOVED_PROBES:
        assert (REPO / "dev" / "probes" / name).is_file() and not (REPO / "tools" / name).exists(), name
    rows = bs.load_plan(REPO / "dev/benchmarks/2026-11-30/call14.plan.jsonl")
    assert {(r.phase, r.gpu) for r in rows} == {(1, 0), (1, 1), (2, 0), (2, 1)}


def test_one_phase_of_a_plan_runs_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """``--phase N``: a plan longer than one command's limit runs as one command per phase (call 28: four)."""
    plan = str(REPO / "dev/benchmarks/2026-12-01/call28.plan.jsonl")
    argv = ["--plan", plan, "--ref", ".bench/ref_recipe.py", "--out", "/o/r.jsonl", "--dry-run"]
    bs.main([*argv, "--phase", "2"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = [row.index for row in bs.load_plan(plan) if row.phase == 2]
    assert [p["row"] for p in printed] == expected and len(expected) == 7
    bs.main([*argv, "--phase", "1", "--phase", "3"])
    assert {json.loads(line)["phase"] for line in capsys.readouterr().out.splitlines()} == {1, 3}
    with pytest.raises(SystemExit):
        bs.main([*argv, "--phase", "5"])
    assert "--phase 5: the plan has phases [1, 2, 3, 4]" in capsys.readouterr().err


@pytest.mark.subprocess
def test_rows_of_a_phase_run_side_by_side_on_their_gpus_and_phases_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_commands(
        monkeypatch,
        """
        import json, os, sys, time
        start = time.time()
        time.sleep(0.5)
        print(json.dumps({"tag": sys.argv[1], "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start,
                          "end": time.time()}))
        """,
    )
    plan = write_plan(
        tmp_path / "p.plan.jsonl",
        """
        {"phase": 2, "gpu": 1, "who": "ours", "args": "C"}
        {"phase": 1, "gpu": 0, "who": "ours", "args": "A"}
        {"phase": 1, "gpu": 1, "who": "ref", "args": "B"}
        {"phase": 1, "gpu": 0, "who": "ours", "args": "A2"}
        {"phase": 2, "gpu": 0, "who": "ours", "args": "D"}
        """,
    )
    records = bs.run_rows(bs.load_plan(plan), None, tmp_path / "r.jsonl", echo=False)
    got = {rec["result"]["tag"]: rec["result"] for rec in records}
    assert set(got) == {"A", "A2", "B", "C", "D"} and all("error" not in rec for rec in records)
    assert {tag: r["gpu"] for tag, r in got.items()} == {"A": "0", "A2": "0", "B": "1", "C": "1", "D": "0"}

    def overlap(x: str, y: str) -> bool:
        return got[x]["start"] < got[y]["end"] and got[y]["start"] < got[x]["end"]

    assert overlap("A", "B") and overlap("C", "D")  # two GPUs of one phase: at the same time
    assert got["A2"]["start"] >= got["A"]["end"]  # one GPU: one row after another, in file order
    assert min(got[t]["start"] for t in "CD") >= max(got[t]["end"] for t in ("A", "A2", "B"))  # phase 2 after 1
    assert [rec["phase"] for rec in records] == [1, 1, 1, 2, 2]


@pytest.mark.subprocess
def test_a_row_past_its_timeout_is_killed_with_its_child_and_recorded_as_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The row ignores SIGTERM (so only the SIGKILL after --kill-after ends it) and leaves a child that also ignores
    # it and shares its output file, like a compile worker.
    fake_commands(
        monkeypatch,
        """
        import json, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(60)"])
        open(sys.argv[1], "w").write(f"{child.pid}")
        print(json.dumps({"partial": 1}), flush=True)
        print("still compiling", file=sys.stderr, flush=True)
        time.sleep(60)
        """,
    )
    pids = tmp_path / "pids"
    rows = [bs.parse_row({"who": "ours", "args": [str(pids)], "timeout": 1.0, "gpu": 0}, 1, 300)]
    t0 = time.monotonic()
    (rec,) = bs.run_rows(rows, None, tmp_path / "r.jsonl", kill_after=0.5, echo=False)
    assert time.monotonic() - t0 < 15
    assert rec["error"].startswith("timeout after 1 s") and rec["rc"] == -9
    assert 1.0 <= rec["elapsed_s"] < 10
    assert rec["result"] == {"partial": 1} and "still compiling" in rec["stderr_tail"]
    child = int(pids.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


@pytest.mark.subprocess
def test_the_json_line_has_the_command_gpu_time_and_result_or_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_commands(
        monkeypatch,
        """
        import json, subprocess, sys
        if sys.argv[1] == "ok":
            child = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(60)"])  # left behind
            print("Lightning says hello")
            print(json.dumps({"s_per_step": 0.5, "partial": "training"}))  # bench's line before its outputs: not kept
            print(json.dumps({"s_per_step": 0.5, "child": child.pid}))
            print(json.dumps({"s_per_step": 0.25}))
        else:
            print("Traceback: out of memory", file=sys.stderr)
            sys.exit(3)
        """,
    )
    out = tmp_path / "calls" / "r.jsonl"
    plan = write_plan(
        tmp_path / "p.plan.jsonl",
        """
        {"gpu": 1, "who": "ours", "args": "ok", "timeout": 30, "note": "n", "table": "sd15/shipped"}
        {"who": "ref", "args": "boom"}
        """,
    )
    bs.main(["--plan", str(plan), "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == lines  # echoed too
    # The two rows (one on GPU 1, one on every GPU) may finish in either order: a line per row, in finishing order.
    ok, bad = sorted(lines, key=lambda line: line["row"])
    argv = bs.command_for(bs.load_plan(plan)[0], None, str(out.parent))
    assert ok["command"] == shlex.join(argv) and ok["args"] == "ok"
    assert (ok["row"], ok["phase"], ok["gpu"], ok["who"], ok["note"], ok["timeout_s"], ok["rc"]) == (
        1,
        1,
        1,
        "ours",
        "n",
        30,
        0,
    )
    assert 0 <= ok["elapsed_s"] < 10 and ok["result"] == {"s_per_step": 0.25}
    assert ok["table"] == "sd15/shipped" and "table" not in bad  # its place in tools/bench_table.py's table
    child = ok["results"][0]["child"]
    assert ok["results"] == [{"s_per_step": 0.5, "child": child}, {"s_per_step": 0.25}] and "error" not in ok
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)  # what the row left behind died with its process group
    assert bad["who"] == "ref" and bad["gpu"] is None and bad["timeout_s"] == 300 and bad["result"] is None
    assert bad["error"] == "exit status 3" and bad["stderr_tail"].strip() == "Traceback: out of memory"
    assert ok["machine"] == bad["machine"] == bs.machine()  # which machine: rows of two machines never pair
    for rec in (ok, bad):  # and how fast its host was just before the row
        assert set(rec["host_speed"]) == {"dispatch_us", "python_loop_ns"}
        assert 0 < rec["host_speed"]["dispatch_us"] < 1000 and 0 < rec["host_speed"]["python_loop_ns"] < 10_000
        assert set(rec["core_dispatch_us"]) == {str(c) for c in os.sched_getaffinity(0)}  # each core's speed
        assert set(rec["host_during"]) == {"steal_pct", "steal_pct_worst_core", "busy_pct"}  # and the load during it
        assert 0 <= rec["host_during"]["steal_pct"] <= rec["host_during"]["steal_pct_worst_core"] <= 100
    log = out.with_suffix(".log").read_text()
    assert "Traceback: out of memory" in log and "Lightning says hello" in log and "== row 2 phase 1" in log


@pytest.mark.subprocess
def test_rows_naming_a_compile_cache_share_a_folder_made_empty_for_the_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold start and a second start in one call on a machine that has compiled before: the first row of a cache's
    name sees an empty folder, the next one what the first left there; another name starts empty; a row without a
    name keeps the environment's cache; the folders go when the suite ends."""
    fake_commands(
        monkeypatch,
        """
        import json, os, sys
        inductor, triton = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")
        found = sorted(os.listdir(inductor)) if inductor and os.path.isdir(inductor) else None
        if inductor and sys.argv[1] != "none":
            open(os.path.join(inductor, "graph-" + sys.argv[1]), "w").close()
        print(json.dumps({"inductor": inductor, "triton": triton, "found": found}))
        """,
    )
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "users"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    plan = write_plan(
        tmp_path / "p.plan.jsonl",
        """
        {"who": "ours", "args": "a1", "cache": "a"}
        {"who": "ref", "args": "a2", "cache": "a"}
        {"who": "ours", "args": "b1", "cache": "b"}
        {"who": "ours", "args": "none"}
        """,
    )
    records = bs.run_rows(bs.load_plan(plan), None, tmp_path / "r.jsonl", echo=False)
    a1, a2, b1, plain = (rec["result"] for rec in sorted(records, key=lambda rec: rec["row"]))
    assert a1["found"] == [] and a2["found"] == ["graph-a1"] and b1["found"] == []
    assert a1["inductor"] == a2["inductor"] != b1["inductor"] and a1["triton"] == a1["inductor"] + "/triton"
    assert plain == {"inductor": str(tmp_path / "users"), "triton": None, "found": None}
    starts = [rec.get("compile_cache") for rec in sorted(records, key=lambda rec: rec["row"])]
    assert starts == [
        {"name": "a", "start": "empty"},
        {"name": "a", "start": "warm"},
        {"name": "b", "start": "empty"},
        None,
    ]
    assert not Path(a1["inductor"]).exists() and not Path(b1["inductor"]).exists()


def test_the_machine_is_its_boot_id_and_cpu_model(tmp_path: Path) -> None:
    """The device machines all call themselves ``vm``: a row names its machine by boot id and CPU model."""
    (tmp_path / "sys" / "kernel" / "random").mkdir(parents=True)
    (tmp_path / "sys" / "kernel" / "random" / "boot_id").write_text("1f2e-boot\n")
    (tmp_path / "cpuinfo").write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9454 48-Core Processor\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9454 48-Core Processor\n"
    )
    assert bs.machine(tmp_path) == {"boot_id": "1f2e-boot", "cpu": "2 x AMD EPYC 9454 48-Core Processor"}
    assert bs.machine(tmp_path / "none") == {"boot_id": "unknown", "cpu": "unknown"}


def test_host_speed_measures_a_slower_host_as_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose dispatch takes longer reads as slower: the probe times the calls, it does not report a constant."""
    fast = bs.host_speed(calls=2_000)
    import torch

    add = torch.add

    def slow_add(*args: object) -> object:
        time.sleep(20e-6)
        return add(*args)

    monkeypatch.setattr(torch, "add", slow_add)
    slow = bs.host_speed(calls=2_000)
    assert slow["dispatch_us"] > fast["dispatch_us"] + 15


def test_core_speeds_time_each_core_pinned_alone_and_give_the_process_its_cores_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One figure per core this process may use, each timed with the process on that core alone; afterwards the
    process (whose cores the row's process inherits) has its whole set again, even when the timing fails."""
    import torch

    allowed = os.sched_getaffinity(0)
    seen: list[frozenset[int]] = []
    add = torch.add

    def watched_add(*args: object) -> object:
        seen.append(frozenset(os.sched_getaffinity(0)))
        return add(*args)

    monkeypatch.setattr(torch, "add", watched_add)
    speeds = bs.core_speeds(calls=50)
    assert set(speeds) == {str(c) for c in allowed} and all(v > 0 for v in speeds.values())
    assert set(seen) == {frozenset({c}) for c in allowed}
    assert os.sched_getaffinity(0) == allowed

    def failing_add(*args: object) -> object:
        raise RuntimeError("boom")

    monkeypatch.setattr(torch, "add", failing_add)
    with pytest.raises(RuntimeError, match="boom"):
        bs.core_speeds(calls=50)
    assert os.sched_getaffinity(0) == allowed


def test_steal_is_the_hypervisors_share_of_the_time_between_two_readings(tmp_path: Path) -> None:
    """/proc/stat's counters read twice: the steal column's share of all time, for the machine and its worst core,
    and the busy share; a reading missing or not moving gives nothing rather than a made-up zero."""
    (tmp_path / "stat").write_text(
        "cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\ncpu1 50 0 25 400 5 0 0 20 0 0\n"
        "intr 1 2 3\nctxt 99\n"
    )
    before = bs.cpu_times(tmp_path)
    assert before["cpu"] == [100, 0, 50, 800, 10, 0, 0, 40] and set(before) == {"cpu", "cpu0", "cpu1"}
    (tmp_path / "stat").write_text(
        # 400 ticks pass: the machine 300 busy + 40 idle + 0 iowait + 60 stolen; core 1 lost 50 of its 200
        "cpu  300 0 150 840 10 0 0 100 0 0\ncpu0 150 0 75 440 5 0 0 30 0 0\ncpu1 150 0 75 400 5 0 0 70 0 0\n"
    )
    after = bs.cpu_times(tmp_path)
    assert bs.steal(before, after) == {"steal_pct": 15.0, "steal_pct_worst_core": 25.0, "busy_pct": 75.0}
    assert bs.steal(before, before) == {} and bs.steal({}, after) == {} and bs.steal(before, {}) == {}
    assert bs.cpu_times(tmp_path / "none") == {}
