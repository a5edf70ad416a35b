"""HeldMemory: the use count behind host and GPU ranks' memory (memory/held.py)."""

from __future__ import annotations

import threading

import pytest

from kv_sidecar.memory.held import HeldMemory


class Gone(Exception):
    pass


def test_memory_closed_while_held_is_released_once_by_its_last_holder() -> None:
    released: list[str] = []
    held = HeldMemory(Gone)
    with held.hold():
        with held.hold():
            held.close(lambda: released.append("first"))
            held.close(lambda: released.append("again"))  # a second close changes nothing
            with pytest.raises(Gone), held.hold():  # no new holder once closed
                pass
        assert released == []  # one holder left
    assert released == ["first"]


def test_memory_closed_while_free_is_released_at_once() -> None:
    released: list[int] = []
    held = HeldMemory(Gone)
    with held.hold():
        pass
    held.close(lambda: released.append(1))
    assert released == [1]
    with held.lock:
        assert held.closed


def test_many_threads_holding_at_once_release_it_exactly_once() -> None:
    released: list[int] = []
    held = HeldMemory(Gone)
    start = threading.Barrier(9)

    def copy() -> None:
        start.wait()
        for _ in range(2000):
            try:
                with held.hold():
                    pass
            except Gone:  # closed meanwhile
                return

    threads = [threading.Thread(target=copy) for _ in range(8)]
    for t in threads:
        t.start()
    start.wait()
    held.close(lambda: released.append(1))
    for t in threads:
        t.join()
    assert released == [1]
