"""Per-role shared secrets: what a plaintext cluster asks of a peer at Hello (issue 34), the
minimum without TLS. A process configured with `[role_secrets]` gives its own role's secret in
the Hello of every connection it opens, and a port checks the secret of the roles it admits
(storage and admin ports: server, admin; a server's client port: client, admin). Secrets are
compared as SHA-256 digests in constant time; they cross the network in clear, so anyone who
can read the traffic can take them (docs/operations.md, "Security model")."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from collections.abc import Mapping

from waltz.errors import ConfigError

ROLES = ("server", "admin", "client")
MIN_LENGTH = 16
ADMIN_SECRET_ENV = "WALTZ_ADMIN_SECRET"
"""Where the `waltz` CLI (and other admin tools) read the admin role's secret."""

Credential = tuple[str, bytes]
"""(role, secret) as sent in a Hello."""


@dataclasses.dataclass(frozen=True)
class RoleSecretsSection:
    """`[role_secrets]`: one secret per role (at least 16 characters; empty: not set). A storage
    node checks `server` and `admin`; a server gives `server` to the storage nodes and checks
    `client` and `admin` on its client port. Once a port has any of its roles' secrets, a peer
    without one of them is refused at Hello."""

    server: str = dataclasses.field(default="", repr=False)
    admin: str = dataclasses.field(default="", repr=False)
    client: str = dataclasses.field(default="", repr=False)

    def __post_init__(self) -> None:
        for role in ROLES:
            value = getattr(self, role)
            if value and len(value) < MIN_LENGTH:
                raise ConfigError(f"[role_secrets] {role}: at least {MIN_LENGTH} characters")

    def admitted(self, *roles: str) -> dict[str, str]:
        """The secrets of `roles` that are set: what a port admitting them checks."""
        return {r: getattr(self, r) for r in roles if getattr(self, r)}

    def credential(self, role: str) -> Credential | None:
        """What a process of `role` gives at Hello, or None when its secret is not set."""
        secret = getattr(self, role)
        return (role, secret.encode()) if secret else None


def credential_from_env(env: Mapping[str, str] | None = None) -> Credential | None:
    """The admin role's credential from `WALTZ_ADMIN_SECRET` (the `waltz` CLI's), or None."""
    secret = (os.environ if env is None else env).get(ADMIN_SECRET_ENV, "")
    return ("admin", secret.encode()) if secret else None


ROLE_SECRET_ENVS = {"server": "WALTZ_SERVER_SECRET", "admin": ADMIN_SECRET_ENV, "client": "WALTZ_CLIENT_SECRET"}
"""Where `waltz cluster set-acls` (and `cluster create`) read the three roles' secrets: the
passwords of ZooKeeper's per-role digest users."""


def secrets_from_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The roles' secrets set in the environment (`ROLE_SECRET_ENVS`)."""
    source = os.environ if env is None else env
    return {role: source[name] for role, name in ROLE_SECRET_ENVS.items() if source.get(name)}


def check(secrets: dict[str, str], credential: Credential | None) -> str | None:
    """None when `credential` proves a role of `secrets` (or `secrets` is empty); else why it is
    refused, never echoing the secret given."""
    if not secrets:
        return None
    admitted = ", ".join(sorted(secrets))
    if credential is None:
        return f"this server requires a role secret in Hello (one of {admitted}) and none was given"
    role, given = credential
    expected = secrets.get(role)
    if expected is None:
        # Still one digest comparison, so the answer takes as long as for a known role.
        hmac.compare_digest(hashlib.sha256(given).digest(), hashlib.sha256(b"").digest())
        return f"role {role!r} is not admitted on this port (only {admitted})"
    if not hmac.compare_digest(hashlib.sha256(given).digest(), hashlib.sha256(expected.encode()).digest()):
        return f"wrong secret for role {role}"
    return None
