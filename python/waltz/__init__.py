"""Waltz: a distributed, replicated write-ahead log with optimistic locking.

The storage engine is native (Rust); `waltz.storage` is its Python face.
"""

from waltz._native import __version__
from waltz.errors import WaltzError

__all__ = ["WaltzError", "__version__"]
