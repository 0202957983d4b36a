"""The cluster manager's planner is a pure function: checked here exhaustively-ish with hypothesis,
simulating servers that apply what they are given (and report it), join, leave and crash."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from waltz.cluster.manager import plan
from waltz.cluster.metadata import Assignment, PartitionAssignment, ServerInfo


def server(
    sid: int, session: int | None = None, preferred: tuple[int, ...] = (), serving: dict[int, int] | None = None
) -> ServerInfo:
    return ServerInfo(
        sid, "127.0.0.1", 6000 + sid, preferred, serving or {}, 0, session if session is not None else 100 + sid
    )


def apply(servers: dict[int, ServerInfo], a: Assignment) -> dict[int, ServerInfo]:
    """Each live server serves exactly what is assigned to its incarnation, and reports it."""
    out = {}
    for sid, s in servers.items():
        mine = {p: x.generation for p, x in a.items() if x.server == sid and x.session == s.session}
        out[sid] = ServerInfo(s.server_id, s.host, s.port, s.preferred, mine, 0, s.session)
    return out


def check_step(partitions: int, servers: dict[int, ServerInfo], before: Assignment, after: Assignment) -> None:
    for p in range(partitions):
        b = before.get(p, PartitionAssignment(None, 0))
        a = after[p]
        assert a.generation >= b.generation
        if (a.server, a.session) != (b.server, b.session):
            assert a.generation > b.generation, "an owner change must bump the generation"
        if a.server is not None and (a.server, a.session) != (b.server, b.session):
            # A new owner only when nobody else alive serves the partition and the old live owner let go.
            assert not any(p in s.serving for sid, s in servers.items() if sid != a.server)
            old_alive = b.server in servers and servers[b.server].session == b.session
            assert not old_alive or b.server == a.server
            assert servers[a.server].session == a.session


def converge(
    partitions: int, servers: dict[int, ServerInfo], a: Assignment, seen: dict[int, dict[int, tuple[int | None, int]]]
) -> tuple[Assignment, dict[int, ServerInfo]]:
    for _ in range(6):
        nxt = plan(partitions, servers, a)
        check_step(partitions, servers, a, nxt)
        for p, x in nxt.items():
            prev = seen.setdefault(p, {}).setdefault(x.generation, (x.server, x.session))
            assert prev == (x.server, x.session), f"generation {x.generation} of partition {p} reused"
        servers = apply(servers, nxt)
        if nxt == a:
            return a, servers
        a = nxt
    raise AssertionError("the plan did not converge in 6 steps")


def test_even_spread_and_stickiness() -> None:
    servers = {1: server(1), 2: server(2), 3: server(3)}
    a, servers = converge(8, servers, {}, {})
    loads = sorted(sum(1 for x in a.values() if x.server == s) for s in servers)
    assert loads == [2, 3, 3]
    assert plan(8, servers, a) == a


def test_preferred_partitions_are_honoured() -> None:
    servers = {1: server(1), 2: server(2, preferred=(0, 1, 2))}
    a, _ = converge(6, servers, {}, {})
    assert all(a[p].server == 2 for p in (0, 1, 2))
    assert all(a[p].server == 1 for p in (3, 4, 5))


def test_a_move_between_live_servers_goes_through_unassigned() -> None:
    servers = {1: server(1)}
    a, servers = converge(4, servers, {}, {})
    assert {x.server for x in a.values()} == {1}
    servers[2] = server(2)
    step = plan(4, servers, a)
    revoked = [p for p in range(4) if step[p].server is None]
    assert len(revoked) == 2 and all(step[p].generation == a[p].generation + 1 for p in revoked)
    # Server 1 has not let go yet (still reports serving): nothing is handed to 2.
    assert plan(4, servers, step) == step
    servers = apply(servers, step)
    handed = plan(4, servers, step)
    assert all(handed[p].server == 2 and handed[p].generation == a[p].generation + 2 for p in revoked)


def test_a_server_that_lost_its_session_is_a_new_incarnation() -> None:
    servers = {1: server(1, session=10), 2: server(2)}
    a, servers = converge(4, servers, {}, {})
    ones = [p for p in range(4) if a[p].server == 1]
    servers[1] = server(1, session=11)  # same id, new session: it serves nothing now
    b, servers = converge(4, servers, a, {})
    for p in ones:
        assert b[p].server == 1 and b[p].session == 11 and b[p].generation > a[p].generation


def test_no_servers_unassigns_everything_once() -> None:
    a, _ = converge(3, {1: server(1)}, {}, {})
    empty = plan(3, {}, a)
    assert all(x.server is None and x.generation == a[p].generation + 1 for p, x in empty.items())
    assert plan(3, {}, empty) == empty


events = st.lists(
    st.tuples(
        st.sampled_from(["join", "leave", "crash", "reconnect"]),
        st.integers(1, 5),
        st.lists(st.integers(0, 9), max_size=2),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(partitions=st.integers(1, 10), history=events)
def test_random_membership_histories(partitions: int, history: list[tuple[str, int, list[int]]]) -> None:
    servers: dict[int, ServerInfo] = {}
    a: Assignment = {}
    seen: dict[int, dict[int, tuple[int | None, int]]] = {}
    session = 1000
    for kind, sid, preferred in history:
        session += 1
        if kind == "join" and sid not in servers:
            servers[sid] = server(sid, session, tuple(p for p in preferred if p < partitions))
        elif kind in ("leave", "crash"):
            servers.pop(sid, None)
        elif kind == "reconnect" and sid in servers:
            s = servers[sid]
            servers[sid] = server(sid, session, s.preferred)
        a, servers = converge(partitions, servers, a, seen)
        if servers:
            assert all(x.server in servers and servers[x.server].session == x.session for x in a.values())
            pinned = {p for s in servers.values() for p in s.preferred}
            if not pinned:
                loads = [sum(1 for x in a.values() if x.server == s) for s in servers]
                assert max(loads) - min(loads) <= 1
            for p in pinned:
                assert a[p].server == min(s for s in servers if p in servers[s].preferred)
        else:
            assert all(x.server is None for x in a.values())
