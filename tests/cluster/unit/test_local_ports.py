"""Ports for local members (`waltz dev`, torture, the tests' daemons)."""

from __future__ import annotations

from waltz.local.cluster import free_port


def test_free_port_never_hands_out_a_port_twice() -> None:
    """A member's ports are chosen one after another before any listens: a port returned twice
    made a storage node fail with "Address already in use" on its own second port."""
    ports = [free_port() for _ in range(1500)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < 65536 for p in ports)
