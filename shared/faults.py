"""Fault injection for tests: a process told to fail on purpose, at a chosen step.

The ``fault`` setting (``--fault`` / ``PAGODA_FAULT``) is honoured only with
``--testing`` (``shared/config.py`` refuses it otherwise), so a production process never
runs it. Its value is ``<role>_<action>_after=<N>``: the role's process, on its N-th step
(counted from 1), does the action instead of the step:

- ``worker_raise_after=N``: the worker raises (an exception in the forward pass);
- ``worker_hang_after=N``: the worker never finishes the step (the step watchdog's case);
- ``worker_exit_after=N``: the worker process exits at once with status 3;
- ``scheduler_exit_after=N``: the scheduler process exits at once with status 3, mid-step.

Tests use it where killing a process from outside could not pick the moment.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

ROLES = ("worker", "scheduler")
ACTIONS = ("raise", "hang", "exit")
EXIT_STATUS = 3


class InjectedFault(RuntimeError):
    """The exception ``*_raise_after`` raises."""


@dataclass(frozen=True)
class Fault:
    role: str
    action: str
    after: int  # the step it happens on, from 1

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``worker_raise_after=3`` and the like; ValueError naming what is wrong."""
        name, sep, count = text.partition("=")
        parts = name.split("_")
        if (not sep or len(parts) != 3 or parts[0] not in ROLES or parts[1] not in ACTIONS
                or parts[2] != "after" or not count.isdigit() or int(count) < 1):
            raise ValueError(f"fault {text!r}: expected <role>_<action>_after=<N>, role one of "
                             f"{', '.join(ROLES)}, action one of {', '.join(ACTIONS)}, N >= 1")
        if parts[0] == "scheduler" and parts[1] != "exit":
            raise ValueError(f"fault {text!r}: the scheduler can only exit")
        return cls(parts[0], parts[1], int(count))


class FaultPoint:
    """Where one process counts its steps; ``step()`` fails the one the fault names."""

    def __init__(self, role: str, setting: str | None) -> None:
        fault = Fault.parse(setting) if setting else None
        self._fault = fault if fault is not None and fault.role == role else None
        self._steps = 0

    def step(self) -> None:
        fault = self._fault
        if fault is None:
            return
        self._steps += 1
        if self._steps != fault.after:
            return
        if fault.action == "raise":
            raise InjectedFault(f"injected fault: {fault.role}_{fault.action}_after={fault.after}")
        if fault.action == "hang":
            threading.Event().wait()  # forever: the watchdog's case
        os._exit(EXIT_STATUS)
