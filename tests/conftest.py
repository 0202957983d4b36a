import pathlib
import signal
import sys
import uuid

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

# A shell starts a background job (`cmd &`) with SIGINT ignored, and an ignored signal stays
# ignored across fork and exec: a suite started so gave every CLI it ran an ignored Ctrl-C, and
# the tests that stop `waltz demo` or `waltz log read --follow` with SIGINT timed out (three
# failures of a fresh-clone run beside a torture run). The tests play a terminal's Ctrl-C, so
# the processes they start get SIGINT as a terminal's would: not ignored.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def cluster_key() -> uuid.UUID:
    return uuid.uuid4()


@pytest.fixture
def data_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory on the real disk: fsync has to mean something in these tests."""
    d = tmp_path / "storage"
    return d


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory: pytest.TempPathFactory):
    """One real ZooKeeper server for the session; tests isolate themselves by chroot."""
    from support.processes import ZooKeeperServer, zookeeper_available

    if not zookeeper_available():
        pytest.fail("ZooKeeper is not installed: run scripts/setup.sh (apt package `zookeeper`, Java)")
    server = ZooKeeperServer(tmp_path_factory.mktemp("zookeeper"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgresql():
    """One real PostgreSQL server for the session; tests create their own databases."""
    from support.processes import PostgresServer

    server = PostgresServer()
    try:
        server.start()
    except Exception as e:
        server.stop()
        pytest.fail(f"PostgreSQL did not start: {e} {getattr(e, 'stderr', '')}")
    yield server
    server.stop()


@pytest.fixture(params=["embedded", "zookeeper"])
def metadata_url(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> str:
    """A fresh, empty metadata store of each kind: an embedded SQLite file, or a new chroot on
    the session's real ZooKeeper."""
    if request.param == "embedded":
        return f"embedded:{tmp_path / 'metadata.db'}"
    server = request.getfixturevalue("zookeeper")
    return server.url(f"/t-{uuid.uuid4().hex[:12]}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--seeds", type=int, default=300, help="seeds of the deterministic recovery simulation (tests/simulation)"
    )
    parser.addoption("--first-seed", type=int, default=0, help="the first simulation seed")
