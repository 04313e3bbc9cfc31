"""CPU time the processes of a benchmark run take, by role (worker, scheduler, frontends,
the benchmark's own client), read from ``/proc/<pid>/stat`` before and after the run.

Online serving shares the machine's cores between the worker and everything around it;
these figures say how much of the run's CPU went to each, so an online/offline gap can
be put where it is spent. Linux only; elsewhere (no ``/proc``) a role reads as None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of every thread of process ``pid`` so far; None when it
    cannot be read (gone, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces or parentheses: split after its last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def role_of(child: str) -> str:
    """worker-0 -> worker, frontend-1 -> frontends, scheduler -> scheduler."""
    base = child.split("-", 1)[0]
    return "frontends" if base == "frontend" else base


class CpuMeter:
    """CPU seconds each role took between ``start()`` and ``stop()``; the client is this
    process (every thread of it: the asyncio driver, the HTTP client, the metrics scraper)."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self._before: dict[str, float | None] = {}
        self._client_before = 0.0
        self._wall_before = 0.0

    def start(self) -> None:
        self._before = {name: process_cpu_s(pid) for name, pid in self.pids.items()}
        self._client_before = time.process_time()
        self._wall_before = time.perf_counter()

    def stop(self) -> dict[str, float | None]:
        """{role: CPU seconds (None if unreadable)} plus ``client`` and ``wall_s``."""
        out: dict[str, float | None] = {}
        for name, pid in self.pids.items():
            before, after = self._before.get(name), process_cpu_s(pid)
            role = role_of(name)
            if before is None or after is None:
                out[role] = None
                continue
            prior = out.get(role, 0.0)
            out[role] = None if prior is None else prior + after - before
        out["client"] = time.process_time() - self._client_before
        out["wall_s"] = time.perf_counter() - self._wall_before
        return out
