"""A pull's work as steps, so that one thread can carry several pulls to where their bytes move.

A pull (Puller.pull_steps) is a generator: it yields each thing that moves bytes, a staged read
(`StagedRead`: server/staged_reader.py) or a copy between ranks of this node (`DirectCopy`:
server/pull_direct.py), and is sent the bytes moved, or thrown what failed; before a step that may
wait for a peer it yields `Apart`. `run_steps` runs one pull on its own thread, each move as it
comes; a PullBatch runs its members to their moves, moves them together, and sends each its outcome
(server/pull_batch.py), letting a member that steps apart go on on a thread of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

from kv_sidecar.dataplane.jobs import LocalCopy
from kv_sidecar.server.pull_job import PullJob
from kv_sidecar.server.staged_reader import StagedRead


@dataclass
class DirectCopy:
    """A copy between ranks of this node (host-direct, gpu-direct), stopped by its pull's job."""

    copy: LocalCopy
    job: PullJob


@dataclass
class Apart:
    """Not a move: what follows may wait for a peer (an OpenRead to a source that may hang), so the pull
    goes on apart from any others it runs with (a PullBatch's unit hands it to a thread of its own).
    Alone it goes on at once (it is sent 0)."""


Want = StagedRead | DirectCopy | Apart
R = TypeVar("R")
Steps = Generator[Want, int, R]
# Told moves that ended together (Puller.move_all): each one's index, and its bytes or what failed it.
Made = Callable[[list[tuple[int, int | BaseException]]], None]


def run_steps(steps: Steps[R], move: Callable[[Want], int], start: Callable[[], Want] | None = None) -> R:
    """Run a pull's steps to its answer on this thread, each move as `move` (Puller.move) makes it;
    `start`: how the steps go on (resumed after a move that another thread made or failed), else from
    their beginning."""
    try:
        want = start() if start is not None else next(steps)
        while True:
            try:
                moved = move(want)
            except Exception as e:
                want = steps.throw(e)
            else:
                want = steps.send(moved)
    except StopIteration as done:
        return done.value
