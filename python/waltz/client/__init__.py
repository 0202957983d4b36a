"""The Waltz client: applications submit transactions through `TransactionContext`s and apply
the committed log in order through `WaltzClientCallbacks`.

- `WaltzClient` (threads, blocking `submit`) and `AsyncWaltzClient` (asyncio)
- `ClientConfig`, `TransactionContext`, `TransactionBuilder`, `PartitionLocalLock`, `Transaction`
- serializers `BYTES` (default), `JSON`, `TEXT`
- `waltz.client.sql`: exactly-once application into a SQL database (SQLAlchemy)
- `waltz.client.mock`: an in-memory cluster and clients for application tests
- `waltz.client.metrics`: a Prometheus collector of a client's pending transactions, retries, lock
  failures and feed lag

See docs/client.md."""

from waltz.client.aio import AsyncWaltzClient
from waltz.client.callbacks import WaltzClientCallbacks
from waltz.client.config import ClientConfig
from waltz.client.context import Append, PartitionLocalLock, TransactionBuilder, TransactionContext
from waltz.client.serializers import BYTES, JSON, TEXT, BytesSerializer, JsonSerializer, Serializer, TextSerializer
from waltz.client.sync import WaltzClient
from waltz.client.transaction import Transaction

__all__ = [
    "BYTES",
    "JSON",
    "TEXT",
    "Append",
    "AsyncWaltzClient",
    "BytesSerializer",
    "ClientConfig",
    "JsonSerializer",
    "PartitionLocalLock",
    "Serializer",
    "TextSerializer",
    "Transaction",
    "TransactionBuilder",
    "TransactionContext",
    "WaltzClient",
    "WaltzClientCallbacks",
]
