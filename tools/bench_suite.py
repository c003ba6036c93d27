"""One GPU call as one command: benchmark rows (tools/bench.py, "ours", and the reference recipe), one process each.

The rows come either as case names or as a plan file:

    python tools/bench_suite.py --ref .bench/ref_recipe.py --out results.jsonl flux-bf16-r16 flux-nf4-r4-gc ...
    python tools/bench_suite.py --ref .bench/ref_recipe.py --plan dev/benchmarks/2026-11-30/call14.plan.jsonl \\
        --out results14.jsonl

A case name is ``<family>-<quant>-r<rank>[-gc][-<h>x<w>][-compile][-adafactor]``; each case runs ours, then the
reference with the same shapes (the reference has no FP8-compute mode: its row is skipped).

A plan file has one JSON object per line (blank lines and lines starting with ``#`` are skipped):

    {"who": "ours", "args": "--quant nf4 --rank 4 --gc 1 --compile 1", "timeout": 120, "gpu": 0, "phase": 2}

- ``who``: ``ours`` runs ``tools/bench.py`` (``script`` names another tool beside this file, e.g. ``bench_text.py``);
  ``ref`` runs the reference recipe given by ``--ref``. Both with the interpreter running this file.
- ``args``: the arguments, a shell-quoted string or a list; ``{outdir}`` stands for the folder of ``--out``.
- ``timeout``: seconds (default ``--timeout``). Past it the row's whole process group gets SIGTERM, and SIGKILL
  ``--kill-after`` seconds later (``timeout -k``); whatever is left of the group is killed when its main process ends.
- ``gpu`` (optional): ``CUDA_VISIBLE_DEVICES`` for the row (an index or ``"0,1"``); without it the row sees every GPU.
- ``phase`` (optional, default 1): phases run one after another, in increasing order. Inside a phase the rows of one
  GPU run one after another in file order, and the rows of different GPUs run at the same time. ``--phase N`` runs
  only phase N (repeatable): a plan longer than one device command's limit runs as one command per phase.
- ``note`` (optional): copied to the row's JSON line.
- ``table`` (optional): ``"<name>/<role>"``, the row's place in the table ``tools/bench_table.py`` makes of the results:
  a config's ``shipped`` row (ours as shipped), the recipe's ``recipe-eager`` and ``recipe-compiled`` rows beside it,
  and its ``second-start`` and ``eager-start`` rows (only their time to the first step counts). Copied to the JSON line.
  ``"<name>,<name>/<role>"``: the row takes that role in each named line (one recipe row beside a config as shipped
  and the same config with an option changed, e.g. ``"sdxl_24gb,sdxl_24gb+cuda_graphs/recipe-eager"``).
- ``cache`` (optional): a name for the row's torch.compile cache. Rows with the same name share one folder, made
  empty for the suite (``TORCHINDUCTOR_CACHE_DIR``, and ``TRITON_CACHE_DIR`` inside it), so the first row of a name
  compiles from nothing on a machine that has compiled before and the next ones start warm from that row alone: a
  cold start and a second start in one call. Without it a row uses whatever cache its command finds (ours:
  ``~/.cache/lightning-lora``; the recipe: torch's under ``/tmp``). The folders are deleted when the suite ends.

Every row writes its output to files (a killed run's compile workers cannot hold a pipe open) and appends one JSON
line to ``--out`` (and stdout), failures included: the row's position, phase, GPU, who, args, the exact command, the
elapsed time, the exit status, the machine and its host's speed just before the row (:func:`host_speed`; each core's
in ``core_dispatch_us``, :func:`core_speeds`), the hypervisor's steal time and the machine's load during the row
(``host_during``, :func:`steal`), and
``result`` (the last JSON line the process printed; ``results`` when it printed several besides lines marked
``"partial"``: ``tools/bench.py``'s training figures before its outputs, which stay the ``result`` of a row stopped
while sampling), or ``error`` and ``stderr_tail``. Each row's stderr goes to
``--log`` (default: ``--out`` ending ``.log``). Installing wheels and setting PYTHONPATH is the environment's
business, not this tool's (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CASE = re.compile(r"^(flux|sdxl)-(bf16|nf4|fp8|fp8c)-r(\d+)((?:-gc)?)((?:-\d+x\d+)?)((?:-compile)?)((?:-adafactor)?)$")
ROW_KEYS = {"who", "args", "timeout", "gpu", "phase", "script", "note", "cache", "table"}
CACHE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
TABLE_ROLES = ("shipped", "recipe-eager", "recipe-compiled", "second-start", "eager-start")
TABLE_NAME = r"[A-Za-z0-9][A-Za-z0-9_.+-]*"
TABLE = re.compile(rf"^{TABLE_NAME}(,{TABLE_NAME})*/({'|'.join(TABLE_ROLES)})$")
GPU = re.compile(r"^\d+(,\d+)*$")


def commands(case: str, ref: str | None, steps: int, warm: int) -> list[tuple[str, list[str]]]:
    m = CASE.match(case)
    if not m:
        raise SystemExit(f"bad case {case!r}: expected e.g. flux-nf4-r4-gc-1024x1024")
    family, quant, rank, gc, size, compile_, adafactor = m.groups()
    h, w = ((512, 768) if family == "flux" else (1024, 1024)) if not size else map(int, size[1:].split("x"))
    ours_quant = {"bf16": "none", "nf4": "nf4", "fp8": "fp8", "fp8c": "fp8_compute"}[quant]
    common = ["--rank", rank, "--gc", "1" if gc else "0", "--h", str(h), "--w", str(w), "--steps", str(steps)]
    common += ["--warm", str(warm)]
    if adafactor:
        common += ["--opt", "adafactor"]
    ours = [sys.executable, str(HERE / "bench.py"), "--family", family, "--quant", ours_quant, *common]
    if compile_:
        ours += ["--compile", "1"]
    runs = [("ours", ours)]
    ref_mode = {"bf16": "bf16", "nf4": "nf4"}.get(quant)  # FP8 rows compare with the bf16 reference
    if ref and ref_mode and not compile_:
        # FLUX's default SDPA crashes in the reference (BENCHMARKS.md); SDXL's default works and is faster there.
        sdp = ["--sdp", "nocudnn"] if family == "flux" else []
        reference = [sys.executable, ref, f"{family}-{ref_mode}", *common, *sdp]
        runs.append(("ref", reference))
    return runs


@dataclass
class Row:
    """One process of a GPU call."""

    index: int  # 1-based position in the plan (or among the cases' runs)
    who: str  # "ours" or "ref"
    args: list[str]
    timeout: float
    gpu: int | str | None = None
    phase: int = 1
    script: str = "bench.py"  # for "ours": a tool beside this file
    note: str | None = None
    case: str | None = None
    cache: str | None = None  # the compile cache's name: rows of one name share a folder the suite made empty
    table: str | None = None  # "<name>/<role>": the row's place in tools/bench_table.py's table


def case_rows(cases: list[str], ref: str | None, steps: int, warm: int, timeout: float) -> list[Row]:
    """The rows of case names: ours then the reference, one after another (phase 1, every GPU visible)."""
    rows: list[Row] = []
    for case in cases:
        for who, command in commands(case, ref, steps, warm):
            rows.append(Row(index=len(rows) + 1, who=who, args=command[2:], timeout=_number(timeout), case=case))
    return rows


def parse_row(obj: Any, index: int, default_timeout: float, where: str = "") -> Row:
    """A plan line's object as a Row; SystemExit naming ``where`` for anything off."""

    def bad(message: str) -> SystemExit:
        return SystemExit(f"{where}: {message}" if where else message)

    if not isinstance(obj, dict):
        raise bad(f"a plan row is a JSON object, not {type(obj).__name__}")
    unknown = set(obj) - ROW_KEYS
    if unknown:
        raise bad(f"unknown key(s) {sorted(unknown)}; a row has {sorted(ROW_KEYS)}")
    who = obj.get("who")
    if who not in ("ours", "ref"):
        raise bad(f"'who' must be 'ours' or 'ref', not {who!r}")
    args = obj.get("args", [])
    if isinstance(args, str):
        args = shlex.split(args)
    if not isinstance(args, list) or not all(isinstance(x, str) for x in args):
        raise bad("'args' must be a string or a list of strings")
    timeout = obj.get("timeout", default_timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise bad(f"'timeout' must be a positive number of seconds, not {timeout!r}")
    gpu = obj.get("gpu")
    if gpu is not None and not (
        (isinstance(gpu, int) and not isinstance(gpu, bool) and gpu >= 0) or (isinstance(gpu, str) and GPU.match(gpu))
    ):
        raise bad(f"'gpu' must be a GPU index or a list like \"0,1\", not {gpu!r}")
    phase = obj.get("phase", 1)
    if isinstance(phase, bool) or not isinstance(phase, int):
        raise bad(f"'phase' must be an integer, not {phase!r}")
    script = obj.get("script", "bench.py")
    if not isinstance(script, str) or not script.endswith(".py") or "/" in script or "\\" in script:
        raise bad(f"'script' must be the file name of a tool beside bench_suite.py, not {script!r}")
    if script != "bench.py" and who != "ours":
        raise bad("'script' is for 'ours' rows (the reference is --ref)")
    note = obj.get("note")
    if note is not None and not isinstance(note, str):
        raise bad("'note' must be a string")
    cache = obj.get("cache")
    if cache is not None and not (isinstance(cache, str) and CACHE_NAME.match(cache)):
        raise bad(f"'cache' must be a name of letters, digits, '.', '_' and '-', not {cache!r}")
    table = obj.get("table")
    if table is not None and not (isinstance(table, str) and TABLE.match(table)):
        raise bad(
            f"'table' must be '<name>/<role>' (or '<name>,<name>/<role>') with a role of "
            f"{', '.join(TABLE_ROLES)}, not {table!r}"
        )
    return Row(index, who, args, _number(timeout), gpu, phase, script, note, cache=cache, table=table)


def _number(x: float) -> float:
    """Seconds as given: 90, not 90.0, in the JSON lines."""
    return int(x) if float(x).is_integer() else float(x)


def load_plan(path: str | Path, default_timeout: float = 300) -> list[Row]:
    """The rows of a plan file (module docstring): one JSON object a line; blank and ``#`` lines skipped."""
    rows: list[Row] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{lineno}: not a JSON object: {e}") from None
        rows.append(parse_row(obj, len(rows) + 1, default_timeout, f"{path}:{lineno}"))
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def row_args(row: Row, outdir: str) -> list[str]:
    return [a.replace("{outdir}", outdir) for a in row.args]


def command_for(row: Row, ref: str | None, outdir: str) -> list[str]:
    """The row's exact command: the running interpreter, the tool (or ``--ref``), the arguments."""
    if row.who == "ref":
        if not ref:
            raise SystemExit(f"row {row.index} runs the reference recipe: give its path with --ref")
        return [sys.executable, ref, *row_args(row, outdir)]
    script = HERE / row.script
    if not script.is_file():
        raise SystemExit(f"row {row.index}: no {script}")
    return [sys.executable, str(script), *row_args(row, outdir)]


_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()
_stop = threading.Event()  # set on Ctrl-C: no lane starts another row


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the process has ended, without reaping it: until reaped its pid (its group's id) cannot be reused."""
    if proc.returncode is not None:
        return True
    if hasattr(os, "waitid"):
        try:
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True
    return proc.poll() is not None


def _wait_exit(proc: subprocess.Popen, deadline: float) -> bool:
    while not _exited(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def run_process(
    argv: list[str],
    gpu: int | str | None,
    timeout: float,
    kill_after: float,
    extra_env: dict[str, str] | None = None,
) -> tuple[int | None, str, str, float, bool]:
    """Run ``argv`` in its own process group, output to files. Returns (rc, stdout, stderr, seconds, timed out)."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    env.update(extra_env or {})
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True
            )
        except OSError as e:
            return None, "", f"could not start: {e}", 0.0, False
        with _running_lock:
            _running.add(proc)
        try:
            timed_out = not _wait_exit(proc, t0 + timeout)
            if timed_out:
                _signal_group(proc.pid, signal.SIGTERM)
                _wait_exit(proc, time.monotonic() + kill_after)
            elapsed = time.monotonic() - t0
            _signal_group(proc.pid, signal.SIGKILL)  # what is left: compile workers, a main process that ignored TERM
            rc = proc.wait()
        finally:
            with _running_lock:
                _running.discard(proc)
        out.seek(0)
        err.seek(0)
        return rc, out.read().decode(errors="replace"), err.read().decode(errors="replace"), elapsed, timed_out


def kill_running() -> None:
    """Kill every row still running and start no other (Ctrl-C)."""
    _stop.set()
    with _running_lock:
        for proc in list(_running):
            _signal_group(proc.pid, signal.SIGKILL)


def json_lines(text: str) -> list[Any]:
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return found


def machine(proc: Path = Path("/proc")) -> dict[str, str]:
    """Which machine ran a row: its boot id (another machine, or the same one rebooted, has another) and its CPU model.
    The device machines all call themselves ``vm``; one H100's host ran the same settings 1.4-1.7x slower than
    another's, and only this tells such rows apart. ``"unknown"`` where ``proc`` has no such file."""

    def read(path: Path) -> str:
        try:
            return path.read_text()
        except OSError:
            return ""

    boot = read(proc / "sys" / "kernel" / "random" / "boot_id").strip() or "unknown"
    models = re.findall(r"^model name\s*:\s*(.+)$", read(proc / "cpuinfo"), flags=re.MULTILINE)
    return {"boot_id": boot, "cpu": f"{len(models)} x {models[0].strip()}" if models else "unknown"}


def best_per_call(body: Callable[[int], object], calls: int) -> float:
    """Seconds a call of ``body(calls)``, which makes ``calls`` calls: the best of three runs."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        body(calls)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def dispatches(calls: int) -> None:
    """PyTorch's dispatch of a one-element CPU add, ``calls`` times."""
    import torch  # the suite itself runs without torch until here (its tests, --dry-run)

    a, b = torch.ones(1), torch.ones(1)
    for _ in range(calls):
        torch.add(a, b)


def python_loop(calls: int) -> int:
    """A plain Python loop of ``calls`` iterations."""
    total = 0
    for i in range(calls):
        total += i
    return total


def host_speed(calls: int = 20_000) -> dict[str, float]:
    """How fast one core of this host does what a launch-bound step is made of, measured just before each row: PyTorch's
    dispatch of a one-element CPU add (microseconds a call) and a plain Python loop (nanoseconds an iteration), each
    the best of three. The GPU-bound rows of two H100s agree to 1% while the host-bound ones differ by up to 1.9x, so
    host-bound rows of two machines compare only beside these figures."""
    dispatch, loop = best_per_call(dispatches, calls), best_per_call(python_loop, calls)
    return {"dispatch_us": round(dispatch * 1e6, 3), "python_loop_ns": round(loop * 1e9, 1)}


def core_speeds(calls: int = 2_000) -> dict[str, float]:
    """PyTorch's dispatch of a one-element CPU add on each core this process may use (microseconds a call, the best of
    three), the process pinned to one core at a time and given back its whole set after. One H100's rows found the
    same machine's :func:`host_speed` at ~1.3 µs before one row and ~2.7 before the next: this tells a slow core (one
    the hypervisor shares) from a slow moment (every core slow: see :func:`steal`)."""
    allowed = sorted(os.sched_getaffinity(0))
    speeds: dict[str, float] = {}
    try:
        for core in allowed:
            os.sched_setaffinity(0, {core})
            speeds[str(core)] = round(best_per_call(dispatches, calls) * 1e6, 3)
    finally:
        os.sched_setaffinity(0, allowed)  # the row's process inherits this process's cores
    return speeds


def cpu_times(proc: Path = Path("/proc")) -> dict[str, list[int]]:
    """``/proc/stat``'s time counters of the whole machine (``cpu``) and of each core (``cpu0``...): user, nice,
    system, idle, iowait, irq, softirq, steal (clock ticks; the guest columns are already inside user and nice).
    Empty where ``proc`` has no such file."""
    try:
        text = (proc / "stat").read_text()
    except OSError:
        return {}
    times = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu"):
            times[name] = [int(v) for v in fields[:8]] + [0] * (8 - len(fields[:8]))
    return times


def steal(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, float]:
    """The share of the time between two :func:`cpu_times` readings that the hypervisor gave to someone else (steal
    time, %), for the whole machine and for its most-stolen core, and how busy the machine was (%, neither idle,
    iowait nor steal). On a KVM guest a host-bound row runs slower while its neighbours take its cores; a row's
    figures then compare with another's only beside this. ``tools/bench.py`` measures the same over its timed steps
    (``cpu_stolen_s``: 0.00-0.02 s in the rows of one H100); this covers the recipe's rows too. Empty without both
    readings."""

    def shares(name: str) -> tuple[float, float] | None:
        delta = [b - a for a, b in zip(before[name], after[name], strict=True)]
        total = sum(delta)
        if total <= 0:
            return None
        return 100 * delta[7] / total, 100 * (total - delta[3] - delta[4] - delta[7]) / total

    if "cpu" not in before or "cpu" not in after:
        return {}
    whole = shares("cpu")
    if whole is None:
        return {}
    cores = [s for name in after if name != "cpu" and name in before if (s := shares(name)) is not None]
    worst = max((s[0] for s in cores), default=whole[0])
    return {"steal_pct": round(whole[0], 2), "steal_pct_worst_core": round(worst, 2), "busy_pct": round(whole[1], 1)}


def cache_env(folder: Path) -> dict[str, str]:
    """The environment that points torch.compile's caches (inductor's, and Triton's kernels) at ``folder``."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(folder), "TRITON_CACHE_DIR": str(folder / "triton")}


def run_row(
    row: Row, argv: list[str], outdir: str, kill_after: float, tail: int, caches: Path
) -> tuple[dict[str, Any], str]:
    """Run one row (its named compile cache a folder under ``caches``); its JSON record and the text for the log."""
    start = time.strftime("%H:%M:%S")
    env: dict[str, str] | None = None
    if row.cache is not None:
        folder = caches / row.cache
        cache_start = "warm" if folder.exists() else "empty"
        folder.mkdir(parents=True, exist_ok=True)
        env = cache_env(folder)
    speed = host_speed()
    cores = core_speeds()
    before = cpu_times()
    rc, stdout, stderr, elapsed, timed_out = run_process(argv, row.gpu, row.timeout, kill_after, env)
    during = steal(before, cpu_times())
    rec: dict[str, Any] = {"row": row.index, "phase": row.phase, "gpu": row.gpu, "who": row.who}
    if row.case:
        rec["case"] = row.case
    if row.note:
        rec["note"] = row.note
    if row.table:
        rec["table"] = row.table
    if row.cache is not None:
        rec["compile_cache"] = {"name": row.cache, "start": cache_start}
    rec.update(
        args=shlex.join(row_args(row, outdir)),
        command=shlex.join(argv),
        timeout_s=row.timeout,
        start=start,
        elapsed_s=round(elapsed, 1),
        rc=rc,
        machine=machine(),
        host_speed=speed,
        core_dispatch_us=cores,
        host_during=during,
    )
    results = json_lines(stdout)
    rec["result"] = results[-1] if results else None
    whole = [r for r in results if not (isinstance(r, dict) and "partial" in r)]
    if len(whole) > 1:
        rec["results"] = whole
    if timed_out:
        rec["error"] = f"timeout after {row.timeout:g} s: process group killed"
    elif rc != 0:
        rec["error"] = f"exit status {rc}" if rc is not None else stderr.strip()
    elif not results:
        rec["error"] = "no JSON line on stdout"
    if "error" in rec:
        rec["stderr_tail"] = stderr[-tail:]
    other = "\n".join(ln for ln in stdout.splitlines() if not ln.startswith("{"))
    head = f"== row {row.index} phase {row.phase} gpu {row.gpu} {row.who} {rec['args']}"
    log = f"{head}\n   {rec['command']}\n   started {start}, {rec['elapsed_s']} s, rc {rc}\n"
    log += (f"-- stdout\n{other}\n" if other.strip() else "") + (f"-- stderr\n{stderr}\n" if stderr else "")
    return rec, log


def run_rows(
    rows: list[Row],
    ref: str | None,
    out: str | Path,
    log: str | Path | None = None,
    kill_after: float = 5.0,
    tail: int = 2000,
    echo: bool = True,
) -> list[dict[str, Any]]:
    """Run the rows phase by phase (GPUs side by side inside a phase); append a JSON line per row to ``out``."""
    out = Path(out)
    log = Path(log) if log else out.with_suffix(".log")
    outdir = str(out.resolve().parent)
    argvs = {row.index: command_for(row, ref, outdir) for row in rows}  # every command checked before anything runs
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="bench-suite-caches-") as caches_dir,
        open(out, "a") as out_f,
        open(log, "a") as log_f,
    ):
        caches = Path(caches_dir)

        def emit(rec: dict[str, Any], text: str) -> None:
            line = json.dumps(rec)
            with lock:
                records.append(rec)
                out_f.write(line + "\n")
                out_f.flush()
                log_f.write(text)
                log_f.flush()
                if echo:
                    print(line, flush=True)

        def lane(lane_rows: list[Row]) -> None:
            for row in lane_rows:
                if _stop.is_set():
                    return
                emit(*run_row(row, argvs[row.index], outdir, kill_after, tail, caches))

        for phase in sorted({row.phase for row in rows}):
            lanes: dict[str, list[Row]] = {}
            for row in rows:
                if row.phase == phase:
                    lanes.setdefault("" if row.gpu is None else str(row.gpu), []).append(row)
            with lock:
                log_f.write(f"== phase {phase} {time.strftime('%H:%M:%S')}: {len(lanes)} lane(s)\n")
                log_f.flush()
            threads = [threading.Thread(target=lane, args=(lr,), daemon=True) for lr in lanes.values()]
            for t in threads:
                t.start()
            try:
                for t in threads:
                    t.join()
            except KeyboardInterrupt:
                kill_running()
                raise
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", help="case names (or give --plan)")
    p.add_argument("--plan", default=None, help="plan file: one JSON row a line (see above)")
    p.add_argument("--ref", default=None, help="path to ref_recipe.py (omit to run ours only)")
    p.add_argument("--out", default="bench_results.jsonl")
    p.add_argument("--log", default=None, help="every row's stderr (default: --out ending .log)")
    p.add_argument("--steps", type=int, default=8, help="cases only")
    p.add_argument("--warm", type=int, default=3, help="cases only")
    p.add_argument("--timeout", type=float, default=300, help="seconds a row, where the plan gives none")
    p.add_argument("--kill-after", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL past a timeout")
    p.add_argument("--only", choices=["ours", "ref"], default=None)
    p.add_argument(
        "--phase",
        type=int,
        action="append",
        default=None,
        help="run only this phase of the plan (repeatable): a "
        "plan longer than one command's time limit runs as one command per phase",
    )
    p.add_argument("--dry-run", action="store_true", help="print each row's command, run nothing")
    a = p.parse_args(argv)
    if bool(a.plan) == bool(a.cases):
        p.error("give case names or --plan, not both")
    if a.plan:
        rows = load_plan(a.plan, a.timeout)
    else:
        ref = a.ref if a.only != "ours" else None
        rows = case_rows(a.cases, ref, a.steps, a.warm, a.timeout)
    if a.only:
        rows = [row for row in rows if row.who == a.only]
    if a.phase:
        missing = sorted(set(a.phase) - {row.phase for row in rows})
        if missing:
            p.error(f"--phase {missing[0]}: the plan has phases {sorted({row.phase for row in rows})}")
        rows = [row for row in rows if row.phase in a.phase]
    if a.dry_run:
        outdir = str(Path(a.out).resolve().parent)
        for row in rows:
            line = {"row": row.index, "phase": row.phase, "gpu": row.gpu, "who": row.who, "timeout_s": row.timeout}
            print(json.dumps({**line, "command": shlex.join(command_for(row, a.ref, outdir))}))
        return
    try:
        run_rows(rows, a.ref, a.out, a.log, a.kill_after)
    except KeyboardInterrupt:
        print("interrupted: the running rows were killed", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
