"""Sliding-window requests: which prompt tokens a prefill computes and publishes, and which a decode pulls.

vLLM's SlidingWindowManager frees the blocks that no later token attends and puts its null block (id 0)
in their place in the request's block table. After n computed tokens it keeps the blocks from the one
holding token `n - W + 1` on, W being the window plus any extra tokens the engine retains (see
`skipped_tokens`, vLLM's `get_num_skipped_tokens`). A decode engine that loads n tokens from outside
pads the same way: null blocks up to that token's block, new blocks after.

So that the decode engine continues exactly as one engine would, three things must hold (docs/vllm.md,
"Sliding-window models"):
- The decode engine computes at least one prompt token itself (the last), and its first computed token
  n attends from token n - W + 1: the prefill computes and publishes n tokens and must still hold that
  token. If the prefill computed the whole prompt, it would free by the window of the token after the
  prompt, which may drop the block of the token the decode engine recomputes first (vLLM always
  recomputes the last prompt token of a full load). vLLM's own NixlConnector stops its prefill short
  the same way for Mamba state (`_truncate_request_for_prefill`).
- Every decode block it fills is complete: the decode engine's first in-window block starts on its grid,
  the prefill's on its own, and a partly filled decode block would be cached by the decode engine's
  prefix cache as if it were whole. The prefill therefore stops where the window start of its last
  token's successor is a multiple of `alignment` (a multiple of both block sizes), or before any block
  is freed; the decode engine computes the few tokens after (at most `alignment`).
- Nothing before the published range is read: the decode pulls from its first in-window block on, which
  the sidecar checks against the published `first_token`.

Pure functions of token counts, so that the same rule can serve each sliding-window group of a hybrid
model (issue 33). No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence

# vLLM's BlockPool takes block 0 as its null block: the placeholder of freed (out-of-window) blocks.
NULL_BLOCK_ID = 0


def skipped_tokens(num_computed: int, window: int) -> int:
    """Tokens before the window of the token after `num_computed` ones: those whose blocks vLLM frees."""
    return max(0, num_computed - window + 1)


def first_kept_token(num_computed: int, window: int, block_size: int) -> int:
    """The first token of the first block vLLM keeps (not a null block) after `num_computed` tokens."""
    return skipped_tokens(num_computed, window) // block_size * block_size


def prefill_tokens(num_prompt: int, window: int, alignment: int) -> int:
    """How many prompt tokens the prefill of a windowed request computes and publishes.

    At most num_prompt - 1: the decode engine computes the last token. Where the window has moved
    (some prompt token falls out of it), also the largest count whose kept range starts at a
    multiple of `alignment`, so that the decode engine's first in-window block and the prefill's
    start at the same token whatever their block sizes (both divide `alignment`)."""
    if num_prompt <= 1:
        return num_prompt
    n = num_prompt - 1
    start = skipped_tokens(n, window)
    aligned = n - start % alignment
    return aligned if aligned >= 1 else n


def leading_nulls(block_ids: Sequence[int]) -> int:
    """How many of a request's blocks, from its first, are vLLM's null block (freed, out of the window)."""
    count = 0
    for block in block_ids:
        if block != NULL_BLOCK_ID:
            break
        count += 1
    return count
