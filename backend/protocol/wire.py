"""Small helpers every reader of Redis replies shares: text from bytes, messages from stream
entries.

Invariant: a stream entry carries one encoded message under ``MESSAGE_FIELD``; ``entry_message``
is the only place that knows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MESSAGE_FIELD = "msg"


def to_text(value: bytes | str | int | float) -> str:
    """A Redis reply value as text (clients may or may not decode responses)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def entry_message(fields: Mapping[Any, Any] | None) -> bytes | str:
    """The encoded message of a stream entry's fields ("" when the entry has none)."""
    fields = fields or {}
    encoded: bytes | str = fields.get(MESSAGE_FIELD.encode()) or fields.get(MESSAGE_FIELD) or b""
    return encoded


def entry_fields(encoded: str) -> dict[str, str]:
    """The fields of a stream entry carrying ``encoded`` (an ``encode``d message)."""
    return {MESSAGE_FIELD: encoded}
