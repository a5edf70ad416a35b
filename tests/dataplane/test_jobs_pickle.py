"""Jobs cross to a device's worker pickled (dataplane/workers.py): `Tokens` goes as raw id bytes, and
must come back as the same ids, int64 and writable, whatever array it was made of."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kv_sidecar.dataplane.jobs import LocalCopy, RankKey, RankRead, Tokens

ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)


@given(ids, ids, st.sampled_from([np.int64, np.int32]), st.booleans(), st.integers(0, 10**6))
def test_tokens_come_back_from_a_worker_message_as_they_went(
    src: list[int], dst: list[int], dtype: type, strided: bool, num_tokens: int
) -> None:
    def array(values: list[int]) -> np.ndarray:
        a = np.array(values, dtype=dtype)
        if strided:  # a view with gaps, as a slice of a request's ids is
            a = np.repeat(a, 2)[::2]
        return a

    t = Tokens(array(src), array(dst), num_tokens, num_tokens // 3)
    copy = LocalCopy((RankRead(RankKey("d", 0), RankKey("p", 1), (0, 2)),), t, whole_blocks=False)
    for back in (
        pickle.loads(pickle.dumps(copy, protocol=pickle.HIGHEST_PROTOCOL)),
        pickle.loads(bytes(ForkingPickler.dumps(copy))),  # as Connection.send pickles
    ):
        got = back.tokens
        assert (got.num_tokens, got.start_token) == (t.num_tokens, t.start_token)
        for mine, theirs in ((got.src_blocks, src), (got.dst_blocks, dst)):
            assert mine.dtype == np.int64
            assert mine.tolist() == theirs
            assert mine.flags.writeable
        assert back.reads == copy.reads and back.whole_blocks is False
