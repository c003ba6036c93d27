"""tools/offcpu.py: a thread's time on its core and off it lands on the Python line it was spent in."""

from __future__ import annotations

import sys
import threading
import time

from helpers import REPO

sys.path.insert(0, str(REPO / "tools"))

from offcpu import OffCpuSampler, stack_of  # noqa: E402


def waiting(seconds: float) -> None:
    time.sleep(seconds)  # off the core: the sampler sees the thread here


def spinning(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:  # on the core
        pass


def test_the_sleeping_frame_gets_the_off_core_time_and_the_spinning_frame_the_on_core_time(tmp_path) -> None:
    ready, go, done, finish = (threading.Event() for _ in range(4))

    def work() -> None:
        ready.set()
        go.wait()
        for _ in range(3):
            waiting(0.06)
            spinning(0.03)
        done.set()
        finish.wait()  # alive until the sampler stops: its CPU time is read from /proc/self/task

    worker = threading.Thread(target=work, name="watched")
    worker.start()
    ready.wait()
    sampler = OffCpuSampler(worker, interval=0.002, depth=4)
    sampler.start()
    go.set()
    done.wait()
    sampler.stop()
    finish.set()
    worker.join()

    def seconds_in(counts, function: str) -> float:
        return sum(s for stack, s in counts.items() if stack and stack[0].endswith(f" {function}"))

    off_waiting, on_waiting = seconds_in(sampler.off, "waiting"), seconds_in(sampler.on, "waiting")
    assert 0.12 < off_waiting < 0.6 and on_waiting < 0.03  # 3 x 60 ms asleep, plus waking up on a busy machine
    assert seconds_in(sampler.on, "spinning") > 0.05  # 3 x 30 ms of CPU, less what the samples between missed
    assert sum(sampler.on.values()) + sum(sampler.off.values()) <= sampler.wall + 0.01
    assert worker.native_id is not None
    assert any(tid == str(worker.native_id) and cpu > 0.05 for tid, _, cpu in sampler.threads)

    out = tmp_path / "stacks.txt"
    sampler.report(out, per=3)
    text = out.read_text()
    first_off = text.split("stacks by time off the core")[1].splitlines()[1]
    assert "waiting" in first_off and "test_offcpu.py" in first_off  # the sleep is the top off-core stack
    assert "watched" in text


def test_stack_of_names_the_innermost_frames_first() -> None:
    def inner() -> tuple[str, ...]:
        return stack_of(sys._getframe(), 2)

    def outer() -> tuple[str, ...]:
        return inner()

    stack = outer()
    assert len(stack) == 2 and stack[0].endswith(" inner") and stack[1].endswith(" outer")
    assert stack[0].startswith("test_offcpu.py:")
