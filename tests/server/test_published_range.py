"""A published range in the store: the data plane's full-form block list, and the source's own refusal to
read before the range (a Push names only its start token; the reader's checks are not the source's)."""

from __future__ import annotations

import pytest

from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.server.published import Published, PublishedStore


def _store() -> PublishedStore:
    return PublishedStore(on_consumed=lambda *_: None, on_expired=lambda _: None)


def test_a_window_is_held_with_placeholders_before_it() -> None:
    item = _store().publish("e", "r", [7, 3, 9], 100, 30.0, first_token=64, block_size=16)
    assert item.block_ids == [7, 3, 9]  # what was published, and what events and OpenRead answers name
    assert item.source_blocks == [7, 7, 7, 7, 7, 3, 9]  # by position from token 0, for the executors
    assert item.first_token == 64


def test_a_whole_prompt_is_its_own_source_list() -> None:
    assert _store().publish("e", "r", [4, 5], 20, 30.0, block_size=16).source_blocks == [4, 5]
    assert Published("e", "r2", [1, 2], 20, 30.0, 0.0).source_blocks == [1, 2]


@pytest.mark.parametrize("start", [0, 48, 63])
def test_the_source_refuses_a_read_from_before_its_range(start: int) -> None:
    item = _store().publish("e", "r", [7, 3, 9], 100, 30.0, first_token=64, block_size=16)
    with pytest.raises(SidecarError) as info:
        item.check_read_from(start)
    assert info.value.code is Code.OUT_OF_RANGE
    assert f"request 'r': start_token {start} is before the published range" in info.value.message
    assert "holds tokens [64, 100)" in info.value.message
    item.check_read_from(64)
    item.check_read_from(96)
