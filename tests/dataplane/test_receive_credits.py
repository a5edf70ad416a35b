"""The reader's credit poller (dataplane/receive._Credits) on its own: a scattered slot goes back to the
source as a credit notification, the poller parks while no scatter is in flight, and a send that fails because the source is gone ends the pull as
UNAVAILABLE, not as an internal error. The agent here is a stand-in for NIXL's: on the 2-core CPU machine
UCX does not fail a notification to a killed peer (the Push call's failure ends the pull there), so the
real failure cannot be made here. On a GPU host a reader whose source was killed answered INTERNAL
(tests/e2e/test_staged_ring.py, 2026-11-25; its message was not kept); an unmapped NIXL error from this
send is one way to get that answer."""

from __future__ import annotations

from typing import Any

import torch

from kv_sidecar.dataplane import staged_protocol as sp
from kv_sidecar.dataplane.jobs import HOST
from kv_sidecar.dataplane.receive import _Credits
from kv_sidecar.dataplane.rings import Ring
from kv_sidecar.errors import Code, SidecarError
from kv_sidecar.mailbox import Mailbox
from kv_sidecar.transport.nixl_driver import PARK


class Agent:
    """What _Credits calls on the NIXL agent: send_notif, which fails once `gone` is set."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.gone = False

    def send_notif(self, agent: str, msg: bytes) -> None:
        if self.gone:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")  # what the binding raises, in kind
        self.sent.append((agent, msg))


def _credits(inbox: Mailbox[Any], resumed: list[Any] | None = None) -> tuple[_Credits, sp.RecvState]:
    # Four one-block chunks through two slots: each of the first two scatters owes the source a credit.
    state = sp.RecvState(0, 64, 16, {0: 100, 1: 100}, lambda k: k * 100)
    ring = Ring(HOST, torch.empty(200, dtype=torch.uint8), 2, 100, sp.SlotPool(2), 0)
    resume = (resumed if resumed is not None else []).append
    return _Credits(state, lambda marker: True, ring, [0, 1], "source-agent", "t" * 16, inbox, resume), state


def test_a_scattered_slot_is_credited_to_the_source_then_the_poller_parks() -> None:
    inbox: Mailbox[Any] = Mailbox()
    resumed: list[Any] = []
    credits, state = _credits(inbox, resumed)
    agent = Agent()
    assert credits.poll(agent) == PARK  # nothing scattered yet: no need to be polled
    state.arrive(0, 4, 0, 0, 16)
    credits.add("scatter-0", 0)
    assert resumed == [credits.poll]  # a scatter was launched: poll me again
    assert credits.poll(agent) == PARK  # credited; parked until the next scatter
    assert agent.sent == [("source-agent", sp.credit_notif("t" * 16, 0))]
    assert inbox.empty()
    credits.close()
    assert resumed == [credits.poll, credits.poll]  # run once more, to be dropped
    assert credits.poll(agent) is True


def test_a_scatter_still_running_keeps_the_poller_polling() -> None:
    inbox: Mailbox[Any] = Mailbox()
    state = sp.RecvState(0, 64, 16, {0: 100, 1: 100}, lambda k: k * 100)
    ring = Ring(HOST, torch.empty(200, dtype=torch.uint8), 2, 100, sp.SlotPool(2), 0)
    done: set[str] = set()
    credits = _Credits(
        state, done.__contains__, ring, [0, 1], "source-agent", "t" * 16, inbox, lambda fn: None
    )
    agent = Agent()
    state.arrive(0, 4, 0, 0, 16)
    credits.add("scatter-0", 0)
    assert credits.poll(agent) is False and agent.sent == []  # its marker is not done: poll again
    done.add("scatter-0")
    assert credits.poll(agent) == PARK and len(agent.sent) == 1


def test_a_credit_the_dead_source_cannot_take_ends_the_pull_as_unavailable() -> None:
    inbox: Mailbox[Any] = Mailbox()
    credits, state = _credits(inbox)
    agent = Agent()
    agent.gone = True
    state.arrive(0, 4, 0, 0, 16)
    credits.add("scatter-0", 0)
    assert credits.poll(agent) is True  # done: the reader's thread takes it from here
    err = inbox.get_nowait()
    assert isinstance(err, SidecarError) and err.code is Code.UNAVAILABLE, err
    assert "source sidecar (NIXL agent source-agent) is not reachable" in err.message
    assert "NIXL_ERR_REMOTE_DISCONNECT" in err.message
