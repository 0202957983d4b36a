"""Optional dependencies: the core install imports without any extra, and a feature whose extra
is missing fails with one line naming it (`waltz._extras.require`).

"Missing" is simulated in a fresh interpreter by a `sys.meta_path` finder that refuses the
hidden packages the way the import system does when they are not installed (ModuleNotFoundError
naming the module); scripts/check_wheel.sh does the same for real in a venv with the core
install only."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import waltz
from waltz import errors
from waltz._extras import require

OPTIONAL = ("kazoo", "sqlalchemy", "cryptography", "rich", "pyarrow", "pyspark")

# Run first in the child: hides the top-level packages listed in WALTZ_TEST_HIDE.
_HIDE = textwrap.dedent(
    """
    import os, sys

    class _NotInstalled:
        hidden = set(os.environ["WALTZ_TEST_HIDE"].split(","))

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.hidden:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
    """
)


def run_without(hidden: tuple[str, ...], code: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WALTZ_TEST_HIDE": ",".join(hidden)}
    return subprocess.run(
        [sys.executable, "-c", _HIDE + textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def hint(feature: str, extra: str) -> str:
    return f"{feature} needs the '{extra}' extra: pip install 'waltz-log[{extra}]'"


def test_the_core_imports_with_every_extra_missing(tmp_path: pathlib.Path) -> None:
    """What an application's client and the daemons import needs no extra, and pulls none in."""
    proc = run_without(
        OPTIONAL,
        """
        import sys
        import waltz, waltz.client, waltz.storage, waltz.cluster, waltz.cluster.embedded
        import waltz.server.daemon, waltz.storage.daemon, waltz.cli.node, waltz.tls, waltz.spark
        from waltz.cluster import open_store
        open_store("embedded:metadata.db").close()
        print(sorted(m for m in sys.modules if m.partition(".")[0] in _NotInstalled.hidden))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("hidden", "code", "message"),
    [
        ("kazoo", "import waltz.cluster.zookeeper", hint("ZooKeeper metadata", "zookeeper")),
        (
            "kazoo",
            "from waltz.cluster import open_store; open_store('zk://127.0.0.1:2181/w')",
            hint("ZooKeeper metadata", "zookeeper"),
        ),
        ("sqlalchemy", "import waltz.client.sql", hint("waltz.client.sql", "sql")),
        ("sqlalchemy", "import waltz.demo.bank", hint("The demo", "demo")),
        (
            "cryptography",
            "from waltz.tls import generate_dev_certificates; generate_dev_certificates('certs')",
            hint("Generating TLS certificates", "tls"),
        ),
        (
            "pyarrow",
            "from waltz.storage.scan import records_to_arrow; records_to_arrow([], 0)",
            hint("Arrow record batches", "arrow"),
        ),
        ("pyspark", "import waltz.spark.source", hint("The Spark data source", "spark")),
        ("pyspark", "import waltz.spark.sink", hint("The Spark data source", "spark")),
        ("pyarrow", "import waltz.spark.source", hint("The Spark data source", "spark")),
        ("rich", "import waltz.cli.main", hint("The waltz command", "cli")),
        ("rich", "import waltz.demo.runner", hint("The demo", "demo")),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(hidden: str, code: str, message: str, tmp_path: pathlib.Path) -> None:
    proc = run_without((hidden,), code, tmp_path)
    assert proc.returncode == 1
    # The traceback ends with the one error, not chained to the ModuleNotFoundError behind it.
    assert proc.stderr.splitlines()[-1] == f"waltz.errors.MissingExtraError: {message}"
    assert "ModuleNotFoundError" not in proc.stderr and "During handling" not in proc.stderr


def test_the_waltz_command_without_rich_prints_one_line_and_exits_2(tmp_path: pathlib.Path) -> None:
    proc = run_without(
        ("rich",), "import sys; sys.argv = ['waltz', 'cluster', 'show']; from waltz.cli import waltz; waltz()", tmp_path
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"waltz: {hint('The waltz command', 'cli')}\n")


def test_the_waltz_version_needs_no_extra(tmp_path: pathlib.Path) -> None:
    """A core install can tell which version it has before any extra is added."""
    proc = run_without(
        ("rich",), "import sys; sys.argv = ['waltz', '--version']; from waltz.cli import waltz; waltz()", tmp_path
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"waltz {waltz.__version__}\n", "")


def test_waltz_demo_without_its_extra_prints_one_line_and_exits_2(tmp_path: pathlib.Path) -> None:
    """rich is there (the `cli` extra), SQLAlchemy is not: the demo stops before starting anything."""
    proc = run_without(
        ("sqlalchemy",),
        f"import sys; sys.argv = ['waltz', 'demo', '--short', '--directory', {str(tmp_path / 'demo')!r}]; "
        "from waltz.cli import waltz; waltz()",
        tmp_path,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"waltz: {hint('The demo', 'demo')}\n")
    assert not (tmp_path / "demo").exists()


def test_a_server_on_zookeeper_without_kazoo_prints_one_line_and_exits_2(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('[server]\nmetadata = "zk://127.0.0.1:2181/waltz"\nport = 0\nhttp_port = 0\n')
    proc = run_without(
        ("kazoo",),
        f"import sys; sys.argv = ['waltz-node', 'server', '--config', {str(config)!r}]; from waltz.cli.node import "
        "main; main()",
        tmp_path,
    )
    assert (proc.returncode, proc.stderr) == (2, f"waltz-node server: {hint('ZooKeeper metadata', 'zookeeper')}\n")


def test_require_returns_the_module_and_reports_only_a_missing_one(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert require("json.decoder", "x", "JSON") is sys.modules["json.decoder"]

    with pytest.raises(errors.MissingExtraError) as missing:
        require("waltz_test_absent.sub", "extra", "A feature")
    assert str(missing.value) == "A feature needs the 'extra' extra: pip install 'waltz-log[extra]'"
    assert isinstance(missing.value, ImportError) and missing.value.__cause__ is None

    # An installed package that fails on a dependency of its own is a broken install, not a
    # missing extra: its error passes through unchanged.
    (tmp_path / "waltz_test_broken").mkdir()
    (tmp_path / "waltz_test_broken" / "__init__.py").write_text("import waltz_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as broken:
        require("waltz_test_broken", "extra", "A feature")
    assert broken.value.name == "waltz_test_absent_dependency"
