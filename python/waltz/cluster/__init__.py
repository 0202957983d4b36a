"""Cluster metadata: the store interface and its two implementations, the znode layout, typed
records, and the cluster manager that assigns partitions to servers."""

from __future__ import annotations

import os
from collections.abc import Mapping

from waltz import errors
from waltz.cluster.store import MetadataStore

DEFAULT_SESSION_TIMEOUT = 10.0


def open_store(
    url: str,
    *,
    session_timeout: float = DEFAULT_SESSION_TIMEOUT,
    role: tuple[str, bytes] | None = None,
    acl_secrets: Mapping[str, str] | None = None,
) -> MetadataStore:
    """A store for `url`, not yet started: `zk://[user:secret@]host:port[,...][/chroot]`, or
    `embedded:PATH` (a SQLite file, created on first use). `role`: (role, secret), the process's
    role secret, as which it logs in to ZooKeeper when the URL names no user (per-role ACLs);
    `acl_secrets`: every role's secret this process has, to give the entries it creates their
    parent's per-role access list."""
    if url.startswith("zk://"):
        from waltz.cluster.zookeeper import ZooKeeperStore

        return ZooKeeperStore.from_url(url, session_timeout=session_timeout, role=role, acl_secrets=acl_secrets)
    if url.startswith("embedded:"):
        from waltz.cluster.embedded import EmbeddedStore

        path = url[len("embedded:") :]
        if not path:
            raise errors.MetadataError("embedded metadata URL needs a file: embedded:/path/to/metadata.db")
        return EmbeddedStore(os.path.expanduser(path), session_timeout=session_timeout)
    raise errors.MetadataError(
        f"unknown metadata store {url!r}: use zk://host:port[/chroot] or embedded:/path/to/file.db"
    )


__all__ = ["DEFAULT_SESSION_TIMEOUT", "MetadataStore", "open_store"]
