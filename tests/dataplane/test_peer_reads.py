"""PeerReads: host ranks kept mapped while a peer may READ them by address (dataplane/peer_reads.py),
over real HeldMemory use counts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from kv_sidecar.dataplane.peer_reads import PeerReads
from kv_sidecar.memory.held import HeldMemory


class Gone(Exception):
    pass


class Rank:
    """A host rank as a pin holds it: its use count, and a record of its unmap (and on which thread)."""

    def __init__(self) -> None:
        self.held = HeldMemory(Gone)
        self.unmapped = threading.Event()
        self.unmapped_on = ""

    def acquire(self) -> None:
        self.held.acquire()

    def let_go(self) -> Callable[[], None] | None:
        return self.held.let_go()

    def leave(self) -> None:
        """Its engine unregistered: unmapped now, or once the last holder lets go."""

        def unmap() -> None:
            self.unmapped_on = threading.current_thread().name
            self.unmapped.set()

        self.held.close(unmap)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


READ = ("prefill", "req-1", "decode")


def test_a_rank_that_leaves_mid_read_is_unmapped_once_every_reader_rank_is_done() -> None:
    pins, rank = PeerReads(Clock()), Rank()
    pins.pin(READ, [0, 1], [rank], until=130.0)
    pins.pin(READ, [1], [rank], until=131.0)  # its open came twice (a notification and a call)
    rank.leave()
    pins.done(READ, [0])
    assert not rank.unmapped.wait(0.2)  # reader rank 1 may still READ
    pins.done(READ, [1])
    assert rank.unmapped.wait(5)
    assert rank.unmapped_on == "unmap-after-read"  # never on the caller's thread (the NIXL driver's)
    assert len(pins) == 0


def test_a_close_that_names_no_rank_ends_the_whole_read() -> None:
    pins, rank = PeerReads(Clock()), Rank()
    pins.pin(READ, [0, 1, 2], [rank], until=130.0)
    rank.leave()
    pins.done(READ)
    assert rank.unmapped.wait(5)


def test_a_rank_that_stays_is_not_unmapped_by_its_reads() -> None:
    pins, rank = PeerReads(Clock()), Rank()
    pins.pin(READ, [0], [rank], until=130.0)
    pins.done(READ, [0])
    pins.done(READ, [0])  # a late duplicate changes nothing
    with rank.held.hold():  # still usable: held by nothing left over
        pass
    rank.leave()
    assert rank.unmapped.is_set()  # no pin left: unmapped at once


def test_pins_whose_reader_never_said_done_go_with_their_lease() -> None:
    clock = Clock()
    pins, dead, other = PeerReads(clock), Rank(), Rank()
    pins.pin(READ, [0], [dead], until=130.0)
    dead.leave()
    clock.now = 129.0
    pins.pin(("prefill", "req-0", "decode"), [0], [other], until=160.0)  # an open sweeps, before the lease
    pins.done(("prefill", "req-0", "decode"))
    assert not dead.unmapped.wait(0.2)
    clock.now = 131.0
    pins.pin(("prefill", "req-2", "decode"), [0], [other], until=160.0)  # an open sweeps the expired
    assert dead.unmapped.wait(5)
    assert len(pins) == 1


def test_a_rank_that_left_goes_by_its_last_lease_even_if_nothing_else_comes() -> None:
    pins, rank = PeerReads(), Rank()  # the real clock
    pins.pin(READ, [0], [rank], until=time.monotonic() + 0.3)
    rank.leave()
    pins.left(rank)
    assert not rank.unmapped.is_set()
    assert rank.unmapped.wait(5)
    pins.close()


def test_a_pin_of_a_rank_that_left_already_fails_and_holds_nothing() -> None:
    pins, stays, left = PeerReads(Clock()), Rank(), Rank()
    left.leave()
    with pytest.raises(Gone):
        pins.pin(READ, [0], [stays, left], until=130.0)
    assert len(pins) == 0
    stays.leave()
    assert stays.unmapped.is_set()  # the half-taken pin let it go


def test_closing_lets_every_pin_go() -> None:
    pins, rank = PeerReads(Clock()), Rank()
    pins.pin(READ, [0], [rank], until=130.0)
    pins.close()
    rank.leave()
    assert rank.unmapped.is_set()


def test_ranks_that_left_go_each_by_its_own_lease() -> None:
    pins, late, early = PeerReads(), Rank(), Rank()
    now = time.monotonic()
    pins.pin(("prefill", "late", "decode"), [0], [late], until=now + 30)
    pins.pin(("prefill", "early", "decode"), [0], [early], until=now + 0.3)
    early.leave()
    pins.left(early)  # a timer for 0.3 s from now ...
    late.leave()
    pins.left(late)  # ... is not put off by a rank whose lease ends later
    assert early.unmapped.wait(5)
    assert not late.unmapped.is_set()
    pins.close()


def test_undoing_a_repeated_open_leaves_the_first_opens_pin() -> None:
    """An open refused after its pin takes back only what it added (server/reads.py): the same open
    again adds nothing, and the first one's READ stays covered."""
    pins, rank = PeerReads(Clock()), Rank()
    assert pins.pin(READ, [0, 1], [rank], until=130.0) == [0, 1]
    assert pins.pin(READ, [1, 2], [rank], until=131.0) == [2]  # the retry added reader rank 2 only
    pins.done(READ, [2])  # the retry is refused and undone
    rank.leave()
    assert len(pins) == 1 and not rank.unmapped.wait(0.2)
    pins.done(READ, [0, 1])
    assert rank.unmapped.wait(5)
