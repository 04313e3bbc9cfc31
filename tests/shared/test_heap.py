"""shared/heap.py: the start-up heap leaves the collector's generations, later garbage
does not."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from shared.heap import freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test process collects as usual


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_live_objects_are_frozen_and_later_cycles_still_collected(unfrozen: None) -> None:
    built_at_startup: list[object] = [{"block": 1}]
    assert _tracked(built_at_startup)
    frozen = freeze_startup_heap()
    # a frozen object that dies leaves the count (other tests' threads free theirs)
    assert frozen > 0 and gc.get_freeze_count() > 0
    assert not _tracked(built_at_startup)  # out of every generation a collection walks

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made after the freeze
    del a, b
    assert gc.collect() >= 2


def test_garbage_left_by_startup_is_collected_not_frozen(unfrozen: None) -> None:
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # start-up garbage: only the collector can free a cycle
    gone = weakref.ref(a)
    del a, b
    freeze_startup_heap()
    assert gone() is None
