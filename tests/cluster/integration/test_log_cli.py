"""`waltz log append/read/tail` against a `waltz dev up` cluster (issue 36, item 11): data from
--data, --file and standard input, ranges, JSON Lines, following as transactions commit, and
Ctrl-C ending --follow cleanly. Every test runs twice: on a plaintext cluster and on one with
mutual TLS on every link (`dev up --tls`, the commands given the admin certificate by the
environment dev up prints); TLS-only tests at the end."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.dev_cluster import WALTZ, dev_cluster, waltz


@pytest.fixture(scope="module", params=["plaintext", "tls"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tls = request.param == "tls"
    with dev_cluster(tmp_path_factory.mktemp("log") / "dev", partitions=2, tls=tls) as up:
        assert ("WALTZ_TLS_CERT" in up["environment"]) == tls
        yield up["environment"]


def run(env: dict[str, str], *args: str, ok: bool | None = True, input: bytes | None = None) -> str:
    return waltz(*args, env=env, ok=ok, input=input).stdout.decode()


def test_append_then_read_ranges(env: dict[str, str], tmp_path: pathlib.Path) -> None:
    assert run(env, "log", "append", "-p", "1", "--data", "hello") == "partition 1: committed transaction 0 (5 bytes)\n"
    data_file = tmp_path / "payload.bin"
    data_file.write_bytes(b"\x00\xffbinary")
    assert json.loads(run(env, "--json", "log", "append", "-p", "1", "--file", str(data_file), "--header", "7")) == {
        "partition": 1,
        "transaction_id": 1,
        "bytes": 8,
    }
    assert "committed transaction 2" in run(env, "log", "append", "-p", "1", "-", input=b"from stdin")
    assert run(env, "log", "read", "-p", "1").splitlines() == [
        "0\t0\thello",
        "1\t7\tbase64:AP9iaW5hcnk=",
        "2\t0\tfrom stdin",
    ]
    assert run(env, "log", "read", "-p", "1", "--from", "1", "--to", "1").splitlines() == ["1\t7\tbase64:AP9iaW5hcnk="]
    assert run(env, "log", "read", "-p", "1", "--from", "latest") == ""  # only what commits from now on
    lines = [json.loads(x) for x in run(env, "log", "read", "-p", "1", "--from", "earliest", "--json").splitlines()]
    assert lines == [
        {"partition": 1, "transaction_id": 0, "header": 0, "data": "hello"},
        {"partition": 1, "transaction_id": 1, "header": 7, "data_base64": "AP9iaW5hcnk="},
        {"partition": 1, "transaction_id": 2, "header": 0, "data": "from stdin"},
    ]
    assert run(env, "log", "read", "-p", "0") == ""  # an empty partition


def test_usage_errors(env: dict[str, str]) -> None:
    both = waltz("log", "append", "-p", "0", "--data", "x", "-", env=env, ok=False, input=b"y")
    assert b"exactly one way" in both.stderr
    assert b"exactly one way" in waltz("log", "append", "-p", "0", env=env, ok=False).stderr
    assert (
        b"earliest, latest or a transaction id"
        in waltz("log", "read", "-p", "0", "--from", "soon", env=env, ok=False).stderr
    )
    assert b"no partition 5" in waltz("log", "read", "-p", "5", env=env, ok=False).stderr
    assert (
        b"no partition 5: the cluster has 2"
        in waltz("log", "append", "-p", "5", "--data", "x", env=env, ok=False).stderr
    )
    no_store = {k: v for k, v in os.environ.items() if k != "WALTZ_METADATA"}
    done = subprocess.run([*WALTZ, "log", "read", "-p", "0"], capture_output=True, env=no_store, timeout=60)
    assert done.returncode == 1 and b"no metadata store given" in done.stderr


class Follower:
    """A `waltz log` process that keeps printing; its lines are read by a thread into a queue."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.proc = subprocess.Popen(
            [*WALTZ, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def next_line(self, timeout: float = 30.0) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout} s (exit code {self.proc.poll()})") from None


def stop_with_ctrl_c(f: Follower) -> tuple[int, str]:
    f.proc.send_signal(signal.SIGINT)
    f.proc.wait(30)
    assert f.proc.stderr is not None
    return f.proc.returncode, f.proc.stderr.read()


def test_read_follow_and_tail_until_ctrl_c(env: dict[str, str]) -> None:
    run(env, "log", "append", "-p", "0", "--data", "before")
    reader = Follower(env, "log", "read", "-p", "0", "--from", "earliest", "--follow", "--json")
    tail = Follower(env, "log", "tail", "-p", "0")
    try:
        first: Any = json.loads(reader.next_line())
        assert first["data"] == "before"
        time.sleep(1.5)  # the tail has read the high-water mark: it starts after "before"
        for word in ("one", "two"):
            run(env, "log", "append", "-p", "0", "--data", word)
        assert [json.loads(reader.next_line())["data"] for _ in range(2)] == ["one", "two"]
        assert [tail.next_line().split("\t")[2] for _ in range(2)] == ["one", "two"]
    finally:
        outcomes = [stop_with_ctrl_c(p) for p in (reader, tail)]
    for code, err in outcomes:
        assert code == 0 and "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_follow_with_an_end_stops_there(env: dict[str, str]) -> None:
    start = int(json.loads(run(env, "--json", "log", "append", "-p", "1", "--data", "a"))["transaction_id"])
    reader = Follower(env, "log", "read", "-p", "1", "--from", str(start), "--to", str(start + 1), "--follow")
    assert reader.next_line() == f"{start}\t0\ta"
    run(env, "log", "append", "-p", "1", "--data", "b")
    assert reader.next_line() == f"{start + 1}\t0\tb"
    assert reader.proc.wait(30) == 0  # reached --to: done without Ctrl-C


@pytest.mark.parametrize("env", ["tls"], indirect=True)
def test_on_tls_a_client_certificate_appends_and_cannot_read_the_storage_nodes(env: dict[str, str]) -> None:
    certs = pathlib.Path(env["WALTZ_TLS_CERT"]).parent
    as_client = {**env, "WALTZ_TLS_CERT": str(certs / "client.pem"), "WALTZ_TLS_KEY": str(certs / "client-key.pem")}
    committed = json.loads(run(as_client, "--json", "log", "append", "-p", "0", "--data", "role client"))
    txid = committed["transaction_id"]
    assert run(env, "log", "read", "-p", "0", "--from", str(txid)) == f"{txid}\t0\trole client\n"
    # Reading is from the storage nodes, whose ports admit the server and admin roles only: the
    # node answers the Hello with why, and the reader says so at once (it used to retry for its
    # 30 s request timeout, a refusal then looking like a node at its connection limit).
    started = time.monotonic()
    refused = waltz("log", "read", "-p", "0", "--from", str(txid), env=as_client, ok=False, timeout=120).stderr
    assert time.monotonic() - started < 15, refused
    assert b"the client's certificate has role client; this port admits only server, admin" in refused, refused
    assert b"give it an admin certificate" in refused, refused


@pytest.mark.parametrize("env", ["tls"], indirect=True)
def test_on_tls_a_reader_refused_by_a_server_says_why_at_once(env: dict[str, str]) -> None:
    # A server's certificate opens the storage nodes, but not the servers' client ports, where the
    # reader asks for the high-water mark: the server answers the Hello with why.
    certs = pathlib.Path(env["WALTZ_TLS_CERT"]).parent
    as_server = {**env, "WALTZ_TLS_CERT": str(certs / "server.pem"), "WALTZ_TLS_KEY": str(certs / "server-key.pem")}
    started = time.monotonic()
    refused = waltz("log", "read", "-p", "0", env=as_server, ok=False, timeout=120).stderr
    assert time.monotonic() - started < 15, refused
    assert b"refused our Hello" in refused and b"has role server" in refused, refused
