"""`ClientStats`: what a client counts over its life, for `waltz.client.metrics`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ClientStats:
    commits: int = 0
    """Contexts whose transaction committed."""
    retries: int = 0
    """Executions again after an attempt failed (lost a lock race, dropped, cut off by a remount)."""
    lock_failures: int = 0
    """Attempts that lost a lock race."""
    data_requests: int = 0
    """Round trips for transactions' data (one per `Transaction.data()` that fetched alone, one
    per range `ClientConfig.data_prefetch_bytes` fetched)."""
