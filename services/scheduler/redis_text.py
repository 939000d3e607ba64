"""The text of what the stores read from Redis."""

from __future__ import annotations


def as_text(value: bytes | str) -> str:
    """A Redis reply as text. The stores' client returns bytes (``connect_redis``:
    decode_responses=False); redis-py types every reply as bytes | str."""
    return value.decode() if isinstance(value, bytes) else value
