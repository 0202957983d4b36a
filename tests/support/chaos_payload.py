"""Payloads for crash tests: a function of (txid, epoch), with a length read back from the bytes."""

import hashlib
import struct


def payload_for(txid: int, epoch: int, size: int) -> bytes:
    head = struct.pack(">qqi", txid, epoch, size)
    seed = hashlib.blake2b(head, digest_size=32).digest()
    body = (seed * (size // 32 + 1))[:size]
    return head + body


def check_payload(txid: int, data: bytes) -> int:
    """Returns the payload's epoch; raises AssertionError if the bytes are not a valid payload."""
    t, epoch, size = struct.unpack(">qqi", data[:20])
    assert t == txid, f"payload of {txid} claims id {t}"
    assert data == payload_for(txid, epoch, size), f"payload of {txid} is damaged"
    return epoch
