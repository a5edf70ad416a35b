"""`kv-sidecar serve` takes its start-up objects out of the collector's full collections
(commands/serve.py: freeze_startup_objects)."""

from __future__ import annotations

import gc

from kv_sidecar.commands.serve import freeze_startup_objects


def test_frozen_objects_leave_the_collections_and_are_still_freed() -> None:
    held = [[i] for i in range(1000)]  # long-lived: what modules and the sidecar's parts hold
    try:
        frozen = freeze_startup_objects()
        assert frozen >= 1000
        tracked = {id(o) for o in gc.get_objects()}  # what a full collection walks
        assert not any(id(o) in tracked for o in held)
        # Freed by reference count as before: a frozen object that nothing refers to is gone.
        probe = [held.pop()]
        gone = id(probe[0])
        probe.clear()
        assert all(id(o) != gone for o in held)
    finally:
        gc.unfreeze()
