"""Fault injection settings (shared/faults.py): parsed strictly, honoured only in test mode."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, load_config
from shared.faults import Fault, FaultPoint, InjectedFault


def test_parse() -> None:
    assert Fault.parse("worker_hang_after=7") == Fault("worker", "hang", 7)
    assert Fault.parse("frontend_exit_after=1") == Fault("frontend", "exit", 1)
    assert Fault.parse("scheduler_raise_after=2") == Fault("scheduler", "raise", 2)
    for bad in ("worker_raise", "worker_explode_after=1", "frontend_hang_after=1",
                "worker_raise_after=0", "worker_raise_after=x", "scheduler_dup_after=2",
                "tokenizer_exit_after=1"):
        with pytest.raises(ValueError, match="fault"):
            Fault.parse(bad)


def test_only_in_test_mode() -> None:
    with pytest.raises(ConfigError, match="only in test mode"):
        load_config({"fault": "worker_raise_after=1"}, env={})
    with pytest.raises(ConfigError, match="expected"):
        load_config({"fault": "nonsense", "testing": True}, env={})
    config = load_config({"fault": "worker_raise_after=2", "testing": True}, env={})
    assert config.process.fault == "worker_raise_after=2"


def test_the_named_step_fails_and_only_in_its_role() -> None:
    point = FaultPoint("worker", "worker_raise_after=2")
    point.step()
    with pytest.raises(InjectedFault):
        point.step()
    other = FaultPoint("scheduler", "worker_raise_after=1")
    for _ in range(3):
        other.step()  # not the scheduler's fault


def test_frame_faults_are_returned_to_the_caller_once() -> None:
    point = FaultPoint("worker", "worker_dup_after=2")
    assert [point.step() for _ in range(4)] == [None, "dup", None, None]


def test_a_point_is_armed_only_for_its_actions() -> None:
    """A frontend counts requests (exit) and messages (raise) apart."""
    requests = FaultPoint("frontend", "frontend_raise_after=1", actions=("exit",))
    messages = FaultPoint("frontend", "frontend_raise_after=1", actions=("raise",))
    assert requests.step() is None
    with pytest.raises(InjectedFault):
        messages.step()
