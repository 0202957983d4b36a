"""Python 3.11's `asyncio.wait_for` drops a cancellation that arrives in the same turn as the
result it waits for: the task goes on as if never cancelled. A client closing while a refused
mount was answered then retried that mount for ever and `close` never returned (a CI hang of
tests/client/integration/test_client.py). The project waits with `asyncio.timeout`, which keeps it."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
from waltz import client_protocol as cp
from waltz.client.network import Link

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "python" / "waltz"


class _Writer:
    """The little of a StreamWriter that `Link.send` touches: frames are kept, not sent."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def close(self) -> None:
        pass


def test_a_request_cancelled_in_the_turn_its_reply_arrives_stays_cancelled() -> None:
    async def go() -> None:
        link = Link("127.0.0.1:1", "stream", lambda *_: None, lambda *_: None)
        link._transport = _Writer()  # type: ignore[assignment]
        task = asyncio.ensure_future(link.request(lambda seq: cp.HighWaterMarkRequest(seq, 0), 30.0))
        for _ in range(2):  # the request is queued, then written at the end of the turn
            await asyncio.sleep(0)
        assert link._transport.frames  # type: ignore[union-attr]
        link._dispatch(cp.HighWaterMarkResponse(1, 0, 41))  # the reply and the cancellation, one turn
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_the_package_never_waits_with_wait_for() -> None:
    users = [
        f"{p.relative_to(PACKAGE)}:{n}"
        for p in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "asyncio.wait_for(" in line and not line.lstrip().startswith("#")
    ]
    assert users == [], f"asyncio.wait_for can drop a cancellation in Python 3.11; use asyncio.timeout: {users}"
