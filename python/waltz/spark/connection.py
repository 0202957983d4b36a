"""Reaching the cluster named by a read's or a write's options: the TLS context, a `LogReader`
(the source's reads and plans, the sink's high-water marks) and the client's configuration."""

from __future__ import annotations

import ssl
from pathlib import Path

from waltz.client.config import ClientConfig
from waltz.client.log_reader import LogReader
from waltz.spark.options import Options
from waltz.tls import TlsSection


def client_ssl(opts: Options) -> ssl.SSLContext | None:
    if opts.tls is None:
        return None
    return TlsSection(*(Path(p) for p in opts.tls)).client_context()


def log_reader(opts: Options) -> LogReader:
    assert opts.metadata is not None
    return LogReader(opts.metadata, opts.cluster, ssl=client_ssl(opts), timeout=opts.timeout)


def client_config(opts: Options) -> ClientConfig:
    assert opts.metadata is not None
    return ClientConfig(
        metadata=opts.metadata,
        cluster=opts.cluster,
        request_timeout=opts.timeout,
        **({"tls_ca": opts.tls[0], "tls_cert": opts.tls[1], "tls_key": opts.tls[2]} if opts.tls else {}),  # type: ignore[arg-type]
    )
