"""Work left for after an answer (server/after_answer.py): joined work runs once per kind, first; one
failure stops nothing else."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kv_sidecar.server.after_answer import Joined, Later, run_later


class _Piece(Joined):
    def __init__(self, run_all: Callable[[list[_Piece]], None], name: str) -> None:
        super().__init__(run_all)
        self.name = name


def test_joined_work_runs_once_per_kind_first_then_the_rest_in_order() -> None:
    log: list[object] = []

    def kind_a(pieces: list[_Piece]) -> None:
        log.append(("a", [p.name for p in pieces]))

    def kind_b(pieces: list[_Piece]) -> None:
        log.append(("b", [p.name for p in pieces]))

    later: Later = [
        lambda: log.append("record 1"),
        _Piece(kind_a, "1"),
        _Piece(kind_b, "1"),
        lambda: log.append("record 2"),
        _Piece(kind_a, "2"),
    ]
    run_later(later)
    assert log == [("a", ["1", "2"]), ("b", ["1"]), "record 1", "record 2"]
    assert later == []


def test_a_piece_alone_runs_as_itself() -> None:
    log: list[object] = []
    _Piece(lambda pieces: log.append([p.name for p in pieces]), "x")()
    assert log == [["x"]]


def test_one_failure_stops_neither_the_rest_nor_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    log: list[object] = []

    def fails(_: list[_Piece]) -> None:
        raise RuntimeError("peer gone")

    def boom() -> None:
        raise ValueError("bad record")

    run_later([_Piece(fails, "1"), boom, lambda: log.append("after"), _Piece(lambda p: log.append("b"), "2")])
    assert log == ["b", "after"]
    assert caplog.text.count("work after an answer failed") == 2
