"""What every `waltz` command needs: the metadata store and cluster chosen by the root options,
and one-shot calls to a storage node's admin port."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import click

from waltz import errors, role_secrets
from waltz.cluster import open_store
from waltz.cluster.layout import cluster_root
from waltz.cluster.metadata import ClusterMetadata, StorageNodeInfo
from waltz.storage.client import StorageAdminClient
from waltz.tls import TlsSection, check

T = TypeVar("T")


def _root_params() -> dict[str, object]:
    return click.get_current_context().find_root().params


def cluster_name() -> str:
    return str(_root_params().get("cluster") or "default")


def tls_context() -> ssl.SSLContext | None:
    """The client side of mutual TLS from --tls-ca/--tls-cert/--tls-key, or None (plaintext)."""
    names = ("tls_ca", "tls_cert", "tls_key")
    values = [_root_params().get(n) for n in names]
    if all(v is None for v in values):
        return None
    paths = [None if v is None else pathlib.Path(str(v)) for v in values]
    check(paths, [f"--{n.replace('_', '-')}" for n in names], "TLS options:")
    return TlsSection(*paths).client_context()


@contextlib.contextmanager
def cluster_metadata(name: str | None = None) -> Iterator[ClusterMetadata]:
    """The chosen cluster's metadata over a short-lived session."""
    url = _root_params().get("metadata")
    if not url:
        raise errors.ClusterError("no metadata store given: pass --metadata URL or set WALTZ_METADATA")
    try:
        root = cluster_root(name or cluster_name())
    except ValueError as e:
        raise errors.ClusterError(str(e)) from e
    store = open_store(str(url), role=role_secrets.credential_from_env(), acl_secrets=role_secrets.secrets_from_env())
    store.start(timeout=float(_root_params().get("connect_timeout") or 10.0))  # type: ignore[arg-type]
    try:
        yield ClusterMetadata(store, root)
    finally:
        store.close()


def admin_call(
    meta: ClusterMetadata,
    node: StorageNodeInfo,
    call: Callable[[StorageAdminClient], Awaitable[T]],
    timeout: float = 10.0,
) -> T:
    """Opens the node's admin port with the cluster's key, runs `call`, closes."""
    if not node.admin_port:
        raise errors.ClusterError(f"storage node {node.address} has no admin port in the metadata")
    info = meta.info()
    host, port = node.host, node.admin_port

    async def run() -> T:
        async with await StorageAdminClient.connect(
            host,
            port,
            cluster_key=info.cluster_key,
            partition_count=info.partitions,
            timeout=timeout,
            ssl=tls_context(),
            credential=role_secrets.credential_from_env(),
        ) as client:
            return await call(client)

    return asyncio.run(run())
