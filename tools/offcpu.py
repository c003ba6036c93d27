"""Where a thread's wall time goes, on its core and off it, by Python stack: a sampler for host-bound steps.

``time.thread_time`` says how much of a step the training thread spent on a CPU; when that is half the step and the
GPU is idle at the step's end, the rest is time off the core: waiting for the GIL, in a blocking CUDA call, on a lock,
in the run queue. :class:`OffCpuSampler` looks at the watched thread every ``interval`` seconds from a thread of its
own: the thread's CPU clock (``pthread_getcpuclockid``) says whether the interval was spent on the core, and
``sys._current_frames`` says where the thread was. A thread that releases the GIL in a blocking call lets the sampler
run at once, so off-core time is attributed to the call's Python line. Also every native thread of the process with
its CPU time over the window (``/proc/self/task``), and the watched thread's context switches and run-queue wait.

Diagnosis only (``tools/bench.py --stacks FILE``); Linux.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

__all__ = ["OffCpuSampler", "stack_of"]


def stack_of(frame: FrameType | None, depth: int) -> tuple[str, ...]:
    """The innermost ``depth`` frames of ``frame``'s stack, innermost first, as ``file:line function``."""
    out: list[str] = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return tuple(out)


def _native_threads() -> dict[str, tuple[str, float]]:
    """Each native thread of this process: id -> (name, CPU seconds so far)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[str, float]] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[task.name] = (name, (int(fields[11]) + int(fields[12])) / ticks)  # utime + stime
    return out


def _thread_sched(native_id: int) -> dict[str, float]:
    """The thread's context switches and run-queue wait so far (``/proc``; empty where unreadable)."""
    task = Path(f"/proc/self/task/{native_id}")
    out: dict[str, float] = {}
    try:
        for line in (task / "status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                out[key] = float(value)
        out["run_queue_wait_s"] = int((task / "schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    return out


class OffCpuSampler:
    """Samples ``thread`` (default: the calling one) between :meth:`start` and :meth:`stop`; :meth:`report` writes
    the stacks that took the most time off the core and on it, per ``per`` (e.g. per step)."""

    def __init__(self, thread: threading.Thread | None = None, interval: float = 0.001, depth: int = 8) -> None:
        self.thread = thread or threading.current_thread()
        self.interval, self.depth = interval, depth
        self.off: Counter[tuple[str, ...]] = Counter()
        self.on: Counter[tuple[str, ...]] = Counter()
        self._stop = threading.Event()
        self._runner: threading.Thread | None = None
        self.wall = 0.0
        self._threads0: dict[str, tuple[str, float]] = {}
        self._sched0: dict[str, float] = {}
        self.threads: list[tuple[str, str, float]] = []  # (id, name, CPU seconds in the window)
        self.sched: dict[str, float] = {}

    def start(self) -> None:
        assert self.thread.ident is not None and self.thread.native_id is not None
        clock = time.pthread_getcpuclockid(self.thread.ident)
        self._threads0, self._sched0 = _native_threads(), _thread_sched(self.thread.native_id)
        self._t0 = time.perf_counter()
        self._runner = threading.Thread(target=self._run, args=(clock,), name="offcpu-sampler", daemon=True)
        self._runner.start()

    def _run(self, clock: int) -> None:
        ident = self.thread.ident
        wall, cpu = time.perf_counter(), time.clock_gettime(clock)
        while not self._stop.wait(self.interval):
            now, used = time.perf_counter(), time.clock_gettime(clock)
            frame = sys._current_frames().get(ident)  # type: ignore[arg-type]
            stack = stack_of(frame, self.depth)
            spent, on = now - wall, min(used - cpu, now - wall)
            self.on[stack] += on  # type: ignore[assignment]  # seconds: a Counter sums floats too (typeshed: ints)
            self.off[stack] += spent - on  # type: ignore[assignment]
            wall, cpu = now, used

    def stop(self) -> None:
        self._stop.set()
        if self._runner is not None:
            self._runner.join()
        self.wall = time.perf_counter() - self._t0
        after = _native_threads()
        self.threads = sorted(
            ((tid, name, cpu - self._threads0.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()),
            key=lambda row: -row[2],
        )
        assert self.thread.native_id is not None
        end = _thread_sched(self.thread.native_id)
        self.sched = {key: end[key] - self._sched0[key] for key in end if key in self._sched0}

    def report(self, path: str | os.PathLike[str], per: int = 1, top: int = 25) -> None:
        """Writes the summary to ``path``: times in ms per ``per`` (a step when ``per`` is the steps sampled)."""
        ms = 1e3 / max(1, per)
        on, off = sum(self.on.values()), sum(self.off.values())
        lines = [
            f"ms per unit of work (of {per}): wall {self.wall * ms:.1f}, the watched thread on its core {on * ms:.1f}, "
            f"off it {off * ms:.1f}",
            "watched thread per unit: "
            + ", ".join(f"{k} {v * (ms if k.endswith('_s') else 1 / max(1, per)):.1f}" for k, v in self.sched.items())
            + " (the wait in ms)",
            "",
            "threads by CPU time in the window (ms per unit):",
            *(f"  {tid:>8} {name:<24} {cpu * ms:8.1f}" for tid, name, cpu in self.threads[:15]),
        ]
        for title, counts in (("off the core", self.off), ("on the core", self.on)):
            lines += ["", f"stacks by time {title} (ms per unit), innermost frame first:"]
            for stack, seconds in counts.most_common(top):
                lines.append(f"{seconds * ms:8.1f}  " + " <- ".join(stack[:4]))
                lines += [f"{'':10}  <- {' <- '.join(stack[4:])}"] if stack[4:] else []
        Path(path).write_text("\n".join(lines) + "\n")
