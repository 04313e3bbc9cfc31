"""CPU accounting of a benchmark's processes (``pagoda.bench.cpu_usage``) against the
kernel's own figures for this process and a child that burns a known amount of CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pagoda.bench.cpu_usage import CpuMeter, process_cpu_s, role_of

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_own_process_matches_process_time() -> None:
    _burn(0.2)
    ours, kernel = process_cpu_s(os.getpid()), time.process_time()
    assert ours is not None
    assert ours == pytest.approx(kernel, abs=0.05)  # clock ticks: 10 ms resolution


def test_a_gone_process_reads_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_cpu_s(child.pid) is None


def test_roles_of_launcher_children() -> None:
    assert [role_of(n) for n in ("worker-0", "worker-1", "scheduler", "frontend-0", "frontend-3")] == [
        "worker", "worker", "scheduler", "frontends", "frontends"]


_CHILD = """\
import sys, time
def burn(s):
    end = time.process_time() + s
    while time.process_time() < end:
        pass
burn(0.3)  # before the interval: must not count
print("ready", flush=True)
sys.stdin.readline()
burn(float(sys.argv[1]))  # inside it
print("done", flush=True)
sys.stdin.read()
"""


def test_meter_sums_a_role_and_counts_only_the_interval() -> None:
    burns = (0.2, 0.3)
    kids = [subprocess.Popen([sys.executable, "-c", _CHILD, str(b)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for b in burns]
    try:
        assert all(k.stdout.readline().strip() == "ready" for k in kids)  # type: ignore[union-attr]
        meter = CpuMeter({"frontend-0": kids[0].pid, "frontend-1": kids[1].pid})
        meter.start()
        for k in kids:
            k.stdin.write("go\n")  # type: ignore[union-attr]
            k.stdin.flush()  # type: ignore[union-attr]
        _burn(0.2)
        assert all(k.stdout.readline().strip() == "done" for k in kids)  # type: ignore[union-attr]
        figures = meter.stop()
    finally:
        for k in kids:
            k.communicate("")
    assert set(figures) == {"frontends", "client", "wall_s"}
    assert figures["frontends"] == pytest.approx(sum(burns), abs=0.08)  # both, and only the interval
    assert figures["client"] == pytest.approx(0.2, abs=0.05)
    assert figures["wall_s"] >= 0.3
