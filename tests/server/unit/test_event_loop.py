"""The event loop setting of the server (`[server] event_loop`) and of `WaltzClient`
(`event_loop`): uvloop by default, the standard library's on request, a clear error for
anything else and for a uvloop that cannot be imported."""

from __future__ import annotations

import asyncio
import pathlib
import sys

import pytest
import uvloop
from waltz.client import ClientConfig
from waltz.config import ConfigError, load_server_config
from waltz.event_loop import loop_factory, tell_listener


def _server(tmp_path: pathlib.Path, server: str = "") -> pathlib.Path:
    path = tmp_path / "server.toml"
    path.write_text(f'[server]\nmetadata = "embedded:{tmp_path}/m.db"\n{server}')
    return path


def test_uvloop_unless_asyncio_is_asked_for(tmp_path: pathlib.Path) -> None:
    assert load_server_config(_server(tmp_path)).server.event_loop == "uvloop"
    assert load_server_config(_server(tmp_path, 'event_loop = "asyncio"\n')).server.event_loop == "asyncio"
    assert ClientConfig(metadata="embedded:/m.db").event_loop == "uvloop"
    assert ClientConfig(metadata="embedded:/m.db", event_loop="asyncio").event_loop == "asyncio"
    with pytest.raises(ConfigError, match=r"\[server\] event_loop must be one of 'uvloop', 'asyncio'"):
        load_server_config(_server(tmp_path, 'event_loop = "trio"\n'))
    with pytest.raises(ConfigError, match=r"event_loop must be one of 'uvloop', 'asyncio'"):
        ClientConfig(metadata="embedded:/m.db", event_loop="trio")


@pytest.mark.parametrize("name", ["uvloop", "asyncio"])
def test_the_factory_makes_the_loop_named(name: str) -> None:
    loop = loop_factory(name, "event_loop")()
    try:
        assert isinstance(loop, uvloop.Loop) == (name == "uvloop")
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()


def test_a_missing_uvloop_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what `import uvloop` meets where it is not installed
    with pytest.raises(
        ConfigError, match=r'\[server\] event_loop is "uvloop" but it cannot be imported .*set it to "asyncio"'
    ):
        loop_factory("uvloop", "[server] event_loop")
    assert loop_factory("asyncio", "[server] event_loop") is asyncio.new_event_loop


def test_a_listener_is_told_at_once_and_its_failure_goes_to_the_loop() -> None:
    loop = asyncio.new_event_loop()
    try:
        reported: list[dict[str, object]] = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        fut: asyncio.Future[int] = loop.create_future()
        fut.set_result(7)
        seen: list[int] = []
        tell_listener(lambda f: seen.append(f.result()), fut, "a listener")
        assert seen == [7]  # called before any loop turn
        tell_listener(None, fut, "nobody")

        def broken(f: asyncio.Future[int]) -> None:
            raise RuntimeError("bug in a listener")

        tell_listener(broken, fut, "the commit listener")  # does not raise into the caller
        assert len(reported) == 1
        assert reported[0]["message"] == "the commit listener failed"
        assert isinstance(reported[0]["exception"], RuntimeError) and reported[0]["future"] is fut
    finally:
        loop.close()
