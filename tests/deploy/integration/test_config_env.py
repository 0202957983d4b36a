"""Environment variables over the daemons' TOML files (`WALTZ_STORAGE__<SECTION>__<KEY>`,
`WALTZ_SERVER__<SECTION>__<KEY>`): parsing by the key's type, precedence over the file, errors
naming the variable, and a real storage node taking an override."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import uuid

import pytest
from click.testing import CliRunner
from support.processes import free_port, get, stop, wait_http, write_config
from waltz.cli.main import main as waltz_cli
from waltz.config import ConfigError, _env_value, load_server_config, load_storage_node_config


def _node(tmp_path: pathlib.Path, extra: str = "") -> pathlib.Path:
    path = tmp_path / "node.toml"
    path.write_text(
        f'[storage]\ndirectory = "{tmp_path / "data"}"\npartition_count = 4\n\n[node]\nport = 6000\n{extra}'
    )
    return path


def _server(tmp_path: pathlib.Path, body: str = '[server]\nmetadata = "embedded:/m.db"\n') -> pathlib.Path:
    path = tmp_path / "server.toml"
    path.write_text(body)
    return path


def test_each_type_is_parsed_and_overrides_the_file(tmp_path: pathlib.Path) -> None:
    key = uuid.uuid4()
    config = load_storage_node_config(
        _node(tmp_path),
        env={
            "WALTZ_STORAGE__NODE__PORT": "7000",  # int, set in the file too
            "WALTZ_STORAGE__NODE__MAX_LIST_BYTES": "1_048_576",  # TOML integer syntax
            "WALTZ_STORAGE__NODE__IDLE_TIMEOUT": "2.5",  # float
            "WALTZ_STORAGE__NODE__HOST": "10.1.2.3",  # str, as written
            "WALTZ_STORAGE__STORAGE__DIRECTORY": "/srv/waltz",  # path
            "WALTZ_STORAGE__STORAGE__CLUSTER_KEY": str(key),  # UUID
            "WALTZ_STORAGE__LOGGING__JSON": "true",  # bool
            "waltz_storage__logging__level": "debug",  # names are not case-sensitive
        },
    )
    assert config.node.port == 7000
    assert config.node.max_list_bytes == 1 << 20
    assert config.node.idle_timeout == 2.5
    assert config.node.host == "10.1.2.3"
    assert config.storage.directory == pathlib.Path("/srv/waltz")
    assert config.storage.cluster_key == key
    assert config.logging.json is True and config.logging.level == "debug"
    # What no variable names keeps the file's value or the default.
    assert config.storage.partition_count == 4
    assert config.node.admin_port == 55281


@pytest.mark.parametrize(
    "text, value", [("true", True), ("1", True), ("yes", True), ("FALSE", False), ("0", False), ("off", False)]
)
def test_booleans(tmp_path: pathlib.Path, text: str, value: bool) -> None:
    assert load_storage_node_config(_node(tmp_path), env={"WALTZ_STORAGE__LOGGING__JSON": text}).logging.json is value


def test_lists_are_toml_arrays() -> None:
    assert _env_value("WALTZ_SERVER__X__Y", "list[str]", '["a", "b"]') == ["a", "b"]
    assert _env_value("WALTZ_SERVER__X__Y", "list[int]", "[1, 2]") == [1, 2]
    with pytest.raises(ConfigError, match=r"WALTZ_SERVER__X__Y='\[1,': expected a TOML value"):
        _env_value("WALTZ_SERVER__X__Y", "list[int]", "[1,")


def test_an_empty_value_unsets_an_optional_key(tmp_path: pathlib.Path) -> None:
    config = load_storage_node_config(_node(tmp_path), env={"WALTZ_STORAGE__STORAGE__PARTITION_COUNT": ""})
    assert config.storage.partition_count is None


def test_a_required_key_may_come_from_the_environment_alone(tmp_path: pathlib.Path) -> None:
    path = _server(tmp_path, "[server]\nport = 1234\n")
    with pytest.raises(ConfigError, match=r"\[server\] metadata is required"):
        load_server_config(path, env={})
    config = load_server_config(
        path, env={"WALTZ_SERVER__SERVER__METADATA": "zk://zk:2181/waltz", "WALTZ_SERVER__PARTITION__QUEUE_LIMIT": "50"}
    )
    assert config.server.metadata == "zk://zk:2181/waltz" and config.server.port == 1234
    assert config.partition.queue_limit == 50


def test_each_daemon_reads_only_its_own_prefix(tmp_path: pathlib.Path) -> None:
    env = {"WALTZ_SERVER__SERVER__PORT": "9", "WALTZ_STORAGE__NODE__PORT": "8", "WALTZ_METADATA": "embedded:/x.db"}
    assert load_storage_node_config(_node(tmp_path), env=env).node.port == 8
    assert load_server_config(_server(tmp_path), env=env).server.port == 9


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "WALTZ_STORAGE__NODE__PROT",
            "1",
            r"^WALTZ_STORAGE__NODE__PROT: no key prot in \[node\] \(known: host, port, ",
        ),
        (
            "WALTZ_STORAGE__NOD__PORT",
            "1",
            r"^WALTZ_STORAGE__NOD__PORT: no section \[nod\] \(known: storage, node, logging, tls, role_secrets\)",
        ),
        (
            "WALTZ_STORAGE__NODE",
            "1",
            r"^WALTZ_STORAGE__NODE: name a section and a key, as WALTZ_STORAGE__<SECTION>__<KEY>",
        ),
        ("WALTZ_STORAGE__NODE__PORT", "55 280", r"^WALTZ_STORAGE__NODE__PORT='55 280': expected an integer"),
        ("WALTZ_STORAGE__NODE__PORT", "", r"^WALTZ_STORAGE__NODE__PORT='': expected an integer"),
        ("WALTZ_STORAGE__NODE__IDLE_TIMEOUT", "soon", r"^WALTZ_STORAGE__NODE__IDLE_TIMEOUT='soon': expected a number"),
        ("WALTZ_STORAGE__LOGGING__JSON", "maybe", r"^WALTZ_STORAGE__LOGGING__JSON='maybe': expected true or false"),
        # Parsed, then refused by the key's own check: the message names the variables in force.
        (
            "WALTZ_STORAGE__NODE__PORT",
            "70000",
            r"node.toml \(with WALTZ_STORAGE__NODE__PORT\): \[node\] port must be between 0 and 65535",
        ),
        (
            "WALTZ_STORAGE__NODE__PORT",
            "1.5",
            r"node.toml \(with WALTZ_STORAGE__NODE__PORT\) \[node\].port: expected an integer",
        ),
        (
            "WALTZ_STORAGE__STORAGE__CLUSTER_KEY",
            "nope",
            r"\(with WALTZ_STORAGE__STORAGE__CLUSTER_KEY\) \[storage\].cluster_key: badly formed",
        ),
    ],
)
def test_mistakes_name_the_variable(tmp_path: pathlib.Path, variable: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_storage_node_config(_node(tmp_path), env={variable: value})


def test_cluster_create_takes_the_key_the_nodes_were_given(tmp_path: pathlib.Path) -> None:
    key, other = uuid.uuid4(), uuid.uuid4()
    env = {"WALTZ_METADATA": f"embedded:{tmp_path / 'm.db'}", "WALTZ_CLUSTER": "c"}
    run = CliRunner().invoke
    created = run(
        waltz_cli,
        ["--json", "cluster", "create", "--partitions", "2", "--replicas", "1"],
        env={**env, "WALTZ_CLUSTER_KEY": str(key)},
    )
    assert created.exit_code == 0, created.output
    assert f'"cluster_key": "{key}"' in created.output and '"created": true' in created.output
    again = run(
        waltz_cli, ["--json", "cluster", "create", "--partitions", "2", "--replicas", "1", "--key", str(key)], env=env
    )
    assert again.exit_code == 0 and '"created": false' in again.output, again.output
    refused = run(
        waltz_cli, ["cluster", "create", "--partitions", "2", "--replicas", "1", "--key", str(other)], env=env
    )
    assert refused.exit_code == 1
    # Without either key: an error message ends up in logs, and the key is the cluster's credential.
    assert "exists with another cluster key" in refused.output and str(key) not in refused.output


def test_a_storage_node_serves_where_the_environment_says(tmp_path: pathlib.Path) -> None:
    """The file says one HTTP port and log format, the environment another: the node listens on
    the environment's port and logs plain lines."""
    config, ports = write_config(tmp_path, uuid.uuid4())
    http_port = free_port()
    env = {**os.environ, "WALTZ_STORAGE__NODE__HTTP_PORT": str(http_port), "WALTZ_STORAGE__LOGGING__JSON": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "waltz.cli.node", "storage", "--config", str(config)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        wait_http(http_port, proc)
        assert get(http_port, "/health")[0] == 200
        with pytest.raises(OSError):
            get(ports["http_port"], "/health")
    finally:
        err = stop(proc)
    assert f"http 127.0.0.1:{http_port}" in err
    assert not err.lstrip().startswith("{"), err[:200]


def test_a_bad_variable_stops_the_daemon_with_one_line(tmp_path: pathlib.Path) -> None:
    config, _ = write_config(tmp_path, uuid.uuid4())
    env = {**os.environ, "WALTZ_STORAGE__NODE__HTTP_PROT": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "waltz.cli.node", "storage", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "waltz-node storage: WALTZ_STORAGE__NODE__HTTP_PROT: no key http_prot in [node] (known: host, port, "
        "admin_port, "
        "http_port, max_frame, max_list_count, max_list_bytes, idle_timeout, max_in_flight, max_connections, "
        "retention_interval, retention_rate)"
    ]
