"""Mutual TLS on every Waltz link (client ↔ server, server ↔ storage node, admin ↔ storage node).

`TlsSection` is the `[tls]` section of a node's or server's TOML file (and the client's
`tls_ca`/`tls_cert`/`tls_key`): one CA that every peer's certificate must chain to, and this
process's own certificate and key, presented both when it accepts and when it connects, since
servers are also clients of the storage nodes. Handshake failures become `TlsError` naming the
peer and the cause; `generate_dev_certificates` makes a CA and certificates for a development
cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from waltz import clock
from waltz.errors import ConfigError, TlsError
from waltz.private_files import private_dir, write_private

log = logging.getLogger("waltz.tls")

_KEYS = ("ca", "cert", "key")


def check(values: Sequence[Path | None], names: Sequence[str] = _KEYS, where: str = "[tls]") -> None:
    """All of the three paths (CA, certificate, key) or none; given ones must be readable PEM
    files, the key that of the certificate. `names` are the keys as the user wrote them and
    `where` the section, for the message."""
    missing = [n for n, v in zip(names, values) if v is None]
    if 0 < len(missing) < len(names):
        given = [n for n, v in zip(names, values) if v is not None]
        raise ConfigError(
            f"{where} sets {', '.join(given)} but not {', '.join(missing)}: mutual TLS needs all of "
            f"{', '.join(names)} (or none of them for plaintext)"
        )
    for name, value in zip(names, values):
        if value is None:
            continue
        try:
            with open(value, "rb") as f:
                f.read(1)
        except FileNotFoundError:
            raise ConfigError(f"{where} {name} = {str(value)!r}: no such file") from None
        except OSError as e:
            raise ConfigError(f"{where} {name} = {str(value)!r}: cannot read it: {e.strerror or e}") from None
    if not missing:
        ca, cert, key = (Path(v) for v in values if v is not None)
        _load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), (ca, cert, key), names, where)


def _load(
    context: ssl.SSLContext, files: tuple[Path, Path, Path], names: Sequence[str] = _KEYS, where: str = "[tls]"
) -> ssl.SSLContext:
    (ca, cert, key), (ca_name, cert_name, key_name) = files, names
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"{where} {ca_name} = {str(ca)!r}: not a PEM certificate file ({e})") from None
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(
            f"{where} {cert_name} = {str(cert)!r}, {key_name} = {str(key)!r}: not a PEM certificate and its private "
            f"key ({e})"
        ) from None
    return context


@dataclasses.dataclass(frozen=True)
class TlsSection:
    """`[tls]`: PEM files. All three set: every port of the process takes only mutual TLS and
    every connection it opens uses it; none set: plaintext (and a warning at start)."""

    ca: Path | None = None
    """The certificate authority (one or more PEM certificates) that peers' certificates must chain to."""
    cert: Path | None = None
    """This process's certificate (PEM, leaf first, then any intermediates)."""
    key: Path | None = None
    """The private key of `cert` (PEM, unencrypted)."""

    def __post_init__(self) -> None:
        for name in _KEYS:  # code may pass strings, as the TOML file does
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, Path(value))
        # At load, not at the first connection: a missing file, one that is not PEM, a key of
        # another certificate.
        check([self.ca, self.cert, self.key])

    @property
    def enabled(self) -> bool:
        return self.ca is not None and self.cert is not None and self.key is not None

    def _files(self) -> tuple[Path, Path, Path]:
        if self.ca is None or self.cert is None or self.key is None:
            raise ConfigError("[tls] is not configured: set ca, cert and key")
        return self.ca, self.cert, self.key

    def server_context(self) -> ssl.SSLContext:
        """For a listening port: our certificate, and a client certificate signed by `ca` required."""
        context = _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), self._files())
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        """For connecting: the peer's certificate must chain to `ca` and name the host we dial;
        ours is presented for the peer to check."""
        context = _load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), self._files())
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
        return context


# -- why a handshake failed ------------------------------------------------------------------

_NOT_TLS = {
    "WRONG_VERSION_NUMBER",
    "RECORD_LAYER_FAILURE",
    "PACKET_LENGTH_TOO_LONG",
    "UNKNOWN_PROTOCOL",
    "HTTP_REQUEST",
    "UNEXPECTED_RECORD",
    "RECORD_TOO_LARGE",
}
_CERT_REFUSED = {
    "TLSV1_ALERT_UNKNOWN_CA",
    "SSLV3_ALERT_BAD_CERTIFICATE",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    "TLSV1_ALERT_DECRYPT_ERROR",
}


def describe(exc: BaseException, *, client: bool) -> str:
    """The cause of a failed handshake in words, from our side (`client`: we connected)."""
    reason = getattr(exc, "reason", None) or ""
    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = str(exc.verify_message or exc)
        if "mismatch" in detail:
            return f"certificate verify failed ({detail}): the peer's certificate does not name the address we dialled"
        if client:
            return f"certificate verify failed ({detail}): the peer's certificate is not signed by our CA"
        return f"certificate verify failed ({detail}): the client's certificate is not signed by our CA"
    if isinstance(exc, TimeoutError) or (isinstance(exc, ConnectionAbortedError) and "longer than" in str(exc)):
        return "no TLS handshake in time"
    if reason in _NOT_TLS:
        return (
            f"the {'peer' if client else 'client'} does not speak TLS: a plaintext "
            f"{'port' if client else 'client on this TLS port'} [{reason}]"
        )
    if client:
        if reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
            return f"the peer requires a client certificate and we presented none [{reason}]"
        if reason == "SSLV3_ALERT_HANDSHAKE_FAILURE":
            return f"the peer refused the handshake: it requires a client certificate (did we present one?) [{reason}]"
        if reason in _CERT_REFUSED:
            return f"the peer refused our certificate: it is not signed by a CA the peer trusts [{reason}]"
        if (
            isinstance(exc, (ssl.SSLEOFError, ConnectionResetError, EOFError, asyncio.IncompleteReadError))
            or "EOF" in reason
        ):
            return (
                "the peer closed the connection during the handshake: a plaintext port, it refused our "
                "certificate, or it was at its connection limit (a storage node's [node] max_connections); its log "
                "says which"
            )
    else:
        if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return f"the client presented no certificate (mutual TLS requires one) [{reason}]"
        if reason in _CERT_REFUSED:
            return f"the client does not trust our certificate: it is not signed by the client's CA [{reason}]"
        if (
            isinstance(exc, (ssl.SSLEOFError, ConnectionResetError, EOFError, asyncio.IncompleteReadError))
            or "EOF" in reason
        ):
            return "the client closed the connection during the handshake (it may not trust our certificate)"
    return str(exc) or type(exc).__name__


def handshake_error(peer: str, exc: BaseException) -> TlsError:
    """A `TlsError` for a connection of ours to `peer` ("storage node host:port", "server ...")."""
    error = TlsError(f"TLS with {peer} failed: {describe(exc, client=True)}")
    error.__cause__ = exc
    return error


def looks_like_tls(data: bytes) -> bool:
    """True when a peer's first bytes are a TLS record (handshake or alert) rather than one of our
    frames: a frame would need a length of over 350 MB to start this way."""
    return len(data) >= 2 and data[0] in (0x15, 0x16) and data[1] == 0x03


def plaintext_refused(peer: str) -> TlsError:
    """For a plaintext connection of ours whose peer answered with TLS (an alert)."""
    return TlsError(
        f"{peer} answered with TLS: it requires mutual TLS, and this connection is plaintext "
        "(configure the CA, certificate and key: [tls], tls_ca/tls_cert/tls_key or --tls-*)"
    )


# -- connecting and accepting ------------------------------------------------------------------

_HANDSHAKE_FAILURES = (ssl.SSLError, ConnectionResetError, ConnectionAbortedError, EOFError)

REFUSAL_WAIT = 2.0
"""How long a peer refused for its certificate's role has to send its Hello, which is answered
with the reason (`TlsListener`)."""


async def create_connection(
    factory: Callable[[], asyncio.BaseProtocol],
    host: str,
    port: int,
    *,
    context: ssl.SSLContext | None,
    timeout: float,
    peer: str,
) -> asyncio.Transport:
    """`loop.create_connection` with `factory`'s protocol, through TLS when `context` is given; a
    failed handshake raises `TlsError`, other failures (refused, unreachable, timeout) what
    asyncio raises."""
    loop = asyncio.get_running_loop()
    # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation that arrives as
    # the connect ends, and a closing client would then never see it.
    async with asyncio.timeout(timeout):
        if context is None:
            transport, _ = await loop.create_connection(factory, host, port)
            return transport
        try:
            transport, _ = await loop.create_connection(factory, host, port, ssl=context, ssl_handshake_timeout=timeout)
        except _HANDSHAKE_FAILURES as e:
            raise handshake_error(peer, e) from e
        return transport


async def open_connection(
    host: str, port: int, *, context: ssl.SSLContext | None, timeout: float, peer: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """`asyncio.open_connection` on `create_connection`: a reader and a writer."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport = await create_connection(lambda: protocol, host, port, context=context, timeout=timeout, peer=peer)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


def first_read_error(peer: str, exc: BaseException | None, tls: bool) -> BaseException | None:
    """What to raise when the first read of a new connection failed (`exc`) or hit EOF (None).
    With TLS 1.3 a peer refuses our certificate only after our side of the handshake is done,
    so its refusal arrives here rather than at connect."""
    if not tls:
        return None
    if exc is None or isinstance(exc, (ssl.SSLEOFError, ConnectionResetError, ConnectionAbortedError, EOFError)):
        # Our side of the handshake succeeded, so the peer speaks TLS and we trust it: a close
        # without an alert (Python peers send none) is its refusal of our certificate.
        error = TlsError(
            f"TLS with {peer} failed: the peer closed the connection right after the handshake: it "
            "refused our certificate (none, one not signed by a CA it trusts, or one without a role "
            "that port admits), or it was at its connection limit (a server's [server] "
            "max_connections); its log says which"
        )
        error.__cause__ = exc
        return error
    if isinstance(exc, ssl.SSLError):
        return handshake_error(peer, exc)
    return None


async def start_server(
    on_client: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    host: str,
    port: int,
    context: ssl.SSLContext | None,
    *,
    what: str,
    timeout: float = 10.0,
    roles: frozenset[str] | None = None,
    refusal: Callable[[str], bytes] | None = None,
) -> asyncio.Server | TlsListener:
    """`asyncio.start_server`, or with a context a `TlsListener`: every connection is TLS before
    `on_client` sees it, and a failed handshake is one warning line naming the peer and why.
    `roles`: the certificate roles admitted (others are refused after the handshake, with a
    warning); None admits any certificate of the CA. `refusal(why)`: the frame that answers a
    refused peer's first frame (its Hello), so that it learns why instead of seeing a close."""
    if context is None:
        return await asyncio.start_server(on_client, host, port)
    # The loop's resolver (a thread), as asyncio.start_server does: a host name must not block the loop.
    infos = await asyncio.get_running_loop().getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, _, _, _, address = infos[0]
    return TlsListener(socket.create_server(address, family=family), on_client, context, what, timeout, roles, refusal)


class TlsListener:
    """Accepts connections and has the loop wrap each in TLS as it is accepted, before one byte
    is read. Upgrading a plain stream afterwards (`StreamWriter.start_tls`) races with a loop
    that reads as soon as a connection is made (uvloop): the ClientHello lands in the plain
    stream and the handshake waits for it until it times out. `start_server(ssl=)` has no race
    but drops a failed handshake without a word, so each connection gets a task of its own here."""

    def __init__(
        self,
        sock: socket.socket,
        on_client: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
        context: ssl.SSLContext,
        what: str,
        timeout: float,
        roles: frozenset[str] | None = None,
        refusal: Callable[[str], bytes] | None = None,
    ) -> None:
        sock.setblocking(False)
        self.sockets = [sock]
        self._roles, self._refusal = roles, refusal
        self._on_client, self._context, self._what, self._timeout = on_client, context, what, timeout
        self._connections: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.ensure_future(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self.sockets[0])
            except OSError as e:  # out of file descriptors, say: back off instead of spinning
                log.warning("accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve(conn, peer))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket, peer: object) -> None:
        loop = asyncio.get_running_loop()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = asyncio.StreamReader(loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, conn, ssl=self._context, ssl_handshake_timeout=self._timeout
            )
        except (TimeoutError, *_HANDSHAKE_FAILURES, OSError) as e:
            log.warning("TLS handshake with %s %s failed: %s", self._what, _address(peer), describe(e, client=False))
            conn.close()
            return
        if self._roles is not None:
            ssl_object = transport.get_extra_info("ssl_object")
            why = refuse_role(ssl_object.getpeercert() if ssl_object is not None else None, self._roles)
            if why is not None:
                log.warning("%s connection from %s refused: %s", self._what, _address(peer), why)
                await self._refuse(reader, transport, why)
                return
        await self._on_client(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    async def _refuse(self, reader: asyncio.StreamReader, transport: asyncio.BaseTransport, why: str) -> None:
        """Answers the refused peer's Hello with `why` and closes. The answer waits for the Hello:
        closing with its bytes unread would reset the connection, and a reset can reach the peer
        before it reads the answer."""
        try:
            if self._refusal is not None:
                with contextlib.suppress(TimeoutError, OSError):
                    async with asyncio.timeout(REFUSAL_WAIT):
                        await reader.read(65536)
                    transport.write(self._refusal(why))  # type: ignore[attr-defined]
        finally:
            transport.close()

    def close(self) -> None:
        """Stops accepting; connections already made go on, as with `asyncio.Server.close`."""
        self._accepting.cancel()
        self.sockets[0].close()


def _address(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


# -- development certificates --------------------------------------------------------------------


CA_PRIVATE_DIR = "ca-private"
"""Where `generate_dev_certificates` puts the CA's key, under its directory: a folder of its own
that no node or client is given (whoever holds the CA key can issue any certificate)."""


ROLES = ("storage", "server", "admin", "client")
"""What a certificate may do, named in its URI subject alternative name `waltz:role:<role>`
(docs/operations.md, "Security model"): storage nodes, servers, operators, applications."""

ROLE_URI_PREFIX = "waltz:role:"

CLIENT_PORT_ROLES = frozenset({"client", "admin"})
"""Who a server's client port admits: applications, and operators (the `waltz` CLI with an
admin certificate reads and appends as a client does)."""


def peer_roles(peercert: dict[str, object] | None) -> set[str]:
    """The roles in a verified peer certificate (`SSLObject.getpeercert()`)."""
    names = (peercert or {}).get("subjectAltName") or ()
    return {
        value[len(ROLE_URI_PREFIX) :]
        for kind, value in names  # type: ignore[attr-defined]
        if kind == "URI" and value.startswith(ROLE_URI_PREFIX)
    }


def refuse_role(peercert: dict[str, object] | None, allowed: frozenset[str]) -> str | None:
    """None when the peer's certificate carries one of `allowed` roles, else why it is refused."""
    roles = peer_roles(peercert)
    if roles & allowed:
        return None
    has = (
        f"role {', '.join(sorted(roles))}"
        if roles
        else (f"no role (no {ROLE_URI_PREFIX}<role> URI subject alternative name; reissue it with a role)")
    )
    return f"the client's certificate has {has}; this port admits only {', '.join(sorted(allowed))}"


@dataclasses.dataclass(frozen=True)
class DevCertificates:
    """PEM files of a development CA and one certificate per role it signed."""

    ca: Path
    ca_key: Path
    storage_cert: Path
    """For storage nodes (role storage; serverAuth)."""
    storage_key: Path
    server_cert: Path
    """For servers (role server; serverAuth for clients, clientAuth for the storage nodes they dial)."""
    server_key: Path
    admin_cert: Path
    """For operators and the `waltz` CLI (role admin; clientAuth)."""
    admin_key: Path
    client_cert: Path
    """For applications (role client; clientAuth)."""
    client_key: Path

    @classmethod
    def at(cls, directory: str | os.PathLike[str]) -> DevCertificates:
        """The file names `generate_dev_certificates` writes in `directory` (nothing is read)."""
        d = Path(directory)
        pairs = [(d / f"{role}.pem", d / f"{role}-key.pem") for role in ROLES]
        return cls(d / "ca.pem", d / CA_PRIVATE_DIR / "ca-key.pem", *(p for pair in pairs for p in pair))

    def tls(self, role: str) -> TlsSection:
        """The `[tls]` section of a process of `role`."""
        if role not in ROLES:
            raise ValueError(f"no role {role!r}: one of {', '.join(ROLES)}")
        return TlsSection(self.ca, getattr(self, f"{role}_cert"), getattr(self, f"{role}_key"))

    def client_tls(self) -> TlsSection:
        return self.tls("client")


def generate_dev_certificates(
    directory: str | os.PathLike[str],
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    *,
    overwrite: bool = False,
    days: int = 825,
) -> DevCertificates:
    """Writes a new CA and a certificate per role signed by it into `directory` (created if
    missing; key files mode 0600). `hosts` become the storage and server certificates' subject
    alternative names (IP addresses or DNS names): peers check that the address they dial is among them.
    Existing files are an error unless `overwrite`. For development: a production CA keeps its
    key offline and gives each node its own certificate."""
    from waltz import dev_certs  # cryptography is only needed here

    if not hosts:
        raise ConfigError("generate_dev_certificates: give at least one host for the node certificate")
    files = DevCertificates.at(directory)
    existing = [str(p) for p in dataclasses.astuple(files) if Path(p).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"certificate files already exist: {', '.join(existing)} (overwrite them explicitly)")
    private_dir(directory)
    private_dir(Path(directory) / CA_PRIVATE_DIR)
    now = datetime.datetime.fromtimestamp(clock.time(), datetime.UTC)
    ca_key, ca_cert = dev_certs.certificate_authority(now, days)
    sans = [_san(h) for h in hosts]
    written: list[tuple[Path, bytes, bool]] = [(files.ca, ca_cert, False), (files.ca_key, ca_key, True)]
    for role in ROLES:
        listens = role in ("storage", "server")
        key, cert = dev_certs.leaf(
            ca_key, ca_cert, f"waltz {role}", sans if listens else [], role=role, server=listens, now=now, days=days
        )
        written += [(getattr(files, f"{role}_cert"), cert, False), (getattr(files, f"{role}_key"), key, True)]
    for path, data, secret in written:
        _write(path, data, 0o600 if secret else 0o644)
    return files


def _san(host: str) -> tuple[str, str]:
    try:
        return ("ip", str(ipaddress.ip_address(host)))
    except ValueError:
        return ("dns", host)


def _write(path: Path, data: bytes, mode: int) -> None:
    write_private(path, data, mode)


__all__ = [
    "CLIENT_PORT_ROLES",
    "ROLES",
    "DevCertificates",
    "TlsSection",
    "check",
    "generate_dev_certificates",
    "handshake_error",
    "looks_like_tls",
    "create_connection",
    "open_connection",
    "peer_roles",
    "refuse_role",
]
