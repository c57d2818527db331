"""Field values of a decoded message checked against its dataclass's annotations.

JSON carries no types a dataclass enforces: without this check ``{"steps": "20"}`` would decode
into an ``EditJob`` whose ``steps`` is text, and the reader would fail later, far from the bad
message. ``conform_fields`` makes a decoded message exactly as typed as one built in Python.

Invariants: a value either already has its field's type or raises TypeError naming the field; the
one conversion is an integral JSON number into a ``float`` field (``7`` for ``7.0``), so what a
Python writer sends always comes back equal. ``bool`` is never accepted for ``int`` or ``float``.
"""

from __future__ import annotations

import dataclasses
import types
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _scalar(hint: Any, value: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    return isinstance(value, hint) and not isinstance(value, bool)


def conform(hint: Any, value: Any) -> Any:
    """``value`` as a value of type ``hint``; TypeError when it is not one."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        for option in get_args(hint):
            try:
                return conform(option, value)
            except TypeError:
                continue
    elif hint is type(None):
        if value is None:
            return None
    elif hint is float:
        if _scalar(int, value) or _scalar(float, value):
            return float(value)
    elif hint in (int, str, bool):
        if _scalar(hint, value):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item,) = get_args(hint)
            return [conform(item, v) for v in value]
    elif origin is dict:
        if isinstance(value, dict):
            key, item = get_args(hint)
            return {conform(key, k): conform(item, v) for k, v in value.items()}
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, hint):
        return value
    raise TypeError(f"expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")


def conform_fields(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (field name -> value, all fields of ``cls``) conformed to their annotations;
    TypeError naming the first field whose value is not of its type."""
    hints = _hints(cls)
    out = {}
    for name, value in values.items():
        try:
            out[name] = conform(hints[name], value)
        except TypeError as exc:
            raise TypeError(f"field {name!r}: {exc}") from None
    return out
