"""Which addresses dial this sidecar (server/identity.py): an engine's ranks on one node may name their
leader by a loopback address, and the leader's own rank must then still be the leader's."""

from __future__ import annotations

import pytest

from kv_sidecar.server.identity import Identity

ME = Identity("kvs-a", "10.0.0.5:50061")


@pytest.mark.parametrize("address", ["10.0.0.5:50061", "127.0.0.1:50061", "localhost:50061", "[::1]:50061"])
def test_its_advertised_address_and_loopback_on_its_port_are_it(address: str) -> None:
    assert ME.is_me(address)


@pytest.mark.parametrize(
    "address", ["10.0.0.6:50061", "127.0.0.1:50062", "localhost:5006", "10.0.0.5:50062", "50061", ""]
)
def test_another_host_or_port_is_not(address: str) -> None:
    assert not ME.is_me(address)
