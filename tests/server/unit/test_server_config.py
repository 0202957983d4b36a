"""The server's `[partition]` settings: defaults, bounds, and the one that may be zero."""

from __future__ import annotations

import pathlib

import pytest
from waltz.config import ConfigError, PartitionSection, load_server_config


def _server(tmp_path: pathlib.Path, partition: str) -> pathlib.Path:
    path = tmp_path / "server.toml"
    path.write_text(f'[server]\nmetadata = "embedded:{tmp_path}/m.db"\n\n[partition]\n{partition}')
    return path


def test_gather_turns_default_zero_and_bounds(tmp_path: pathlib.Path) -> None:
    assert load_server_config(_server(tmp_path, "")).partition.gather_turns == PartitionSection().gather_turns == 6
    assert load_server_config(_server(tmp_path, "gather_turns = 0\n")).partition.gather_turns == 0  # cut at once
    for bad in (-1, 1001):
        with pytest.raises(ConfigError, match=r"\[partition\] gather_turns must be between 0 and 1000"):
            load_server_config(_server(tmp_path, f"gather_turns = {bad}\n"))
    with pytest.raises(ConfigError, match=r"\[partition\] max_batches_in_flight must be positive"):
        load_server_config(_server(tmp_path, "max_batches_in_flight = 0\n"))


def test_a_whole_batch_must_fit_a_frame(tmp_path: pathlib.Path) -> None:
    """A batch gathers while under max_batch_bytes, so its last transaction may bring it to
    max_batch_bytes + max_transaction_bytes: more than a storage node's 64 MiB frame could never
    be appended (the node would close every replica's connection, again at each retry)."""
    ok = (64 << 20) - (4 << 20) - 1000 * 64 - 1024
    assert (
        load_server_config(_server(tmp_path, f"max_transaction_bytes = {ok}\n")).partition.max_transaction_bytes == ok
    )
    with pytest.raises(
        ConfigError,
        match=r"\[partition\] max_batch_bytes \+ max_transaction_bytes .* must fit one frame of 67108864 bytes",
    ):
        load_server_config(_server(tmp_path, f"max_transaction_bytes = {ok + 1}\n"))
    with pytest.raises(ConfigError, match=r"must fit one frame"):
        load_server_config(_server(tmp_path, f"max_batch_bytes = {60 << 20}\n"))
