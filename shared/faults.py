"""Fault injection for tests: a process told to fail on purpose, at a chosen step.

The ``fault`` setting (``--fault`` / ``PAGODA_FAULT``) is honoured only with
``--testing`` (``shared/config.py`` refuses it otherwise), so a production process never
runs it. Its value is ``<role>_<action>_after=<N>``: the role's process, on its N-th step
(counted from 1), does the action instead of the step:

- ``worker_raise_after=N``: the worker raises (an exception in the forward pass);
- ``worker_hang_after=N``: the worker never finishes the step (the step watchdog's case);
- ``worker_exit_after=N``: the worker process exits at once with status 3;
- ``worker_drop_after=N`` / ``worker_dup_after=N``: rank 0 does the step but never sends
  its result frame, or sends it twice (a lost or a repeated frame on the result link);
- ``scheduler_exit_after=N``: the scheduler process exits at once with status 3, mid-step;
- ``scheduler_raise_after=N``: the scheduler's loop raises on its N-th step (a bug that
  kills the loop thread);
- ``frontend_exit_after=N``: a frontend exits with status 3 on its N-th request;
- ``frontend_raise_after=N``: a frontend's receive loop (the task that reads the
  scheduler link) raises on its N-th ``EngineOutputs`` message (not counting the answers
  to its heartbeats, which come on their own clock: counted, they let the fault fire
  before a request's first token, some runs, and its client got an error response
  instead of the mid-stream error event the fault is for).

Tests use it where killing a process from outside could not pick the moment.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

# what each role can be made to do
ACTIONS_BY_ROLE = {
    "worker": ("raise", "hang", "exit", "drop", "dup"),
    "scheduler": ("raise", "exit"),
    "frontend": ("raise", "exit"),
}
ROLES = tuple(ACTIONS_BY_ROLE)
ACTIONS = ("raise", "hang", "exit", "drop", "dup")
FRAME_ACTIONS = ("drop", "dup")  # the caller acts on these: step() returns them
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
        if parts[1] not in ACTIONS_BY_ROLE[parts[0]]:
            raise ValueError(f"fault {text!r}: a {parts[0]} can only "
                             f"{', '.join(ACTIONS_BY_ROLE[parts[0]])}")
        return cls(parts[0], parts[1], int(count))


class FaultPoint:
    """Where one process counts its steps; ``step()`` fails the one the fault names."""

    def __init__(self, role: str, setting: str | None,
                 actions: tuple[str, ...] = ACTIONS) -> None:
        """Armed when ``setting`` names ``role`` and one of ``actions`` (a process with
        two counting places, e.g. requests and messages, has one point for each)."""
        fault = Fault.parse(setting) if setting else None
        armed = fault is not None and fault.role == role and fault.action in actions
        self._fault = fault if armed else None
        self._steps = 0

    def step(self) -> str | None:
        """Count one step; on the fault's step raise, hang or exit, or return ``drop`` /
        ``dup`` for the caller to do to the frame it was about to send. None otherwise."""
        fault = self._fault
        if fault is None:
            return None
        self._steps += 1
        if self._steps != fault.after:
            return None
        if fault.action in FRAME_ACTIONS:
            return fault.action
        if fault.action == "raise":
            raise InjectedFault(f"injected fault: {fault.role}_{fault.action}_after={fault.after}")
        if fault.action == "hang":
            threading.Event().wait()  # forever: the watchdog's case
        os._exit(EXIT_STATUS)
