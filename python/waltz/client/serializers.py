"""Serializers turn an application's transaction data into bytes and back."""

from __future__ import annotations

import json
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class Serializer(Protocol, Generic[T]):
    def serialize(self, value: T) -> bytes: ...

    def deserialize(self, data: bytes) -> T: ...


class BytesSerializer:
    """bytes as they are (the default)."""

    def serialize(self, value: bytes) -> bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"transaction data must be bytes without a serializer, not {type(value).__name__}")
        return bytes(value)

    def deserialize(self, data: bytes) -> bytes:
        return data


class JsonSerializer:
    """Any JSON value, as compact UTF-8 with sorted keys (equal values give equal bytes)."""

    def serialize(self, value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()

    def deserialize(self, data: bytes) -> Any:
        return json.loads(data)


class TextSerializer:
    def serialize(self, value: str) -> bytes:
        return value.encode()

    def deserialize(self, data: bytes) -> str:
        return data.decode()


BYTES = BytesSerializer()
JSON = JsonSerializer()
TEXT = TextSerializer()
