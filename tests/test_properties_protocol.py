"""Properties of the wire format: every message type round-trips with generated field values,
unknown fields are ignored within the major version, and any bytes or JSON given to ``decode``
either give a message whose fields have their declared types or raise ProtocolError.

Messages are generated from the dataclasses' own annotations, so a message type or field added to
``backend.protocol.messages`` is covered without touching this file.
"""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend import protocol
from backend.protocol import JOB_STATES, MESSAGE_TYPES, SCHEMA_MAJOR, ProtocolError
from backend.protocol.fieldtypes import conform_fields
from tests.property_settings import examples

text = st.text(max_size=12)
numbers = st.floats(allow_nan=False)  # JSON has no NaN that compares equal to itself
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | numbers | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
# fields whose values are constrained beyond their type
FIELD_OVERRIDES = {"status": st.sampled_from(JOB_STATES)}


def strategy_for(hint: Any) -> st.SearchStrategy:
    """Values of the annotation ``hint`` (the types messages use)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return st.one_of([strategy_for(arg) for arg in args])
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(strategy_for(args[0]), strategy_for(args[1]), max_size=3)
    if dataclasses.is_dataclass(hint):
        return dataclass_values(hint)
    scalars = {str: text, int: st.integers(), float: numbers, bool: st.booleans()}
    scalars |= {type(None): st.none(), Any: json_values}
    return scalars[hint]


def dataclass_values(cls: type) -> st.SearchStrategy:
    hints = get_type_hints(cls)
    return st.builds(
        cls,
        **{
            f.name: FIELD_OVERRIDES.get(f.name, strategy_for(hints[f.name]))
            for f in dataclasses.fields(cls)
        },
    )


messages = st.one_of([dataclass_values(cls) for cls in MESSAGE_TYPES.values()])
minor_versions = st.integers(0, 10**6).map(lambda minor: f"{SCHEMA_MAJOR}.{minor}")


def assert_valid(message) -> None:
    """A decoded message: a known type, every field of its declared type, and it round-trips."""
    assert type(message) in MESSAGE_TYPES.values()
    values = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    assert conform_fields(type(message), values) == values
    assert protocol.decode(protocol.encode(message)) == message


@examples(300)
@given(message=messages)
def test_every_message_round_trips(message):
    encoded = protocol.encode(message)
    assert protocol.decode(encoded) == message
    assert protocol.decode(encoded.encode()) == message  # Redis replies may be bytes


@examples(200)
@given(
    message=messages,
    extra=st.dictionaries(text.map(lambda name: "x_" + name), json_values, max_size=4),
    version=minor_versions,
)
def test_unknown_fields_are_ignored_within_the_major_version(message, extra, version):
    payload = protocol.to_dict(message) | extra | {"version": version}
    for name, value in payload.items():  # nested objects of a newer minor version too
        if isinstance(value, dict) and name in ("mask_ops", "paste"):
            payload[name] = value | extra
    assert protocol.decode(json.dumps(payload)) == message


@examples(150)
@given(
    message=messages,
    version=st.one_of(st.integers(), text, json_values, st.sampled_from([True, 1.0, "1", "01.5"])),
)
def test_another_major_version_is_refused(message, version):
    payload = protocol.to_dict(message) | {"version": version}
    head = version.split(".")[0] if isinstance(version, str) else ""
    same_major = (type(version) is int and version == SCHEMA_MAJOR) or (
        head.isascii() and head.isdigit() and int(head) == SCHEMA_MAJOR
    )
    if same_major:
        assert protocol.decode(json.dumps(payload)) == message
        return
    with pytest.raises(ProtocolError, match="version"):
        protocol.decode(json.dumps(payload))


@examples(300)
@given(data=st.binary(max_size=200) | text.map(str.encode))
def test_any_bytes_decode_to_a_valid_message_or_raise_protocol_error(data):
    try:
        message = protocol.decode(data)
    except ProtocolError:
        pass
    else:
        assert_valid(message)
    job_id = protocol.job_id_of(data)  # never raises either
    assert job_id is None or (isinstance(job_id, str) and job_id)


@examples(300)
@given(
    type_name=st.sampled_from(sorted(MESSAGE_TYPES)),
    data=st.data(),
    version=minor_versions,
)
def test_any_field_values_decode_to_a_valid_message_or_raise_protocol_error(
    type_name, data, version
):
    """Every field of a real message type, each given either a value of its own type or any JSON
    value (wrong types, nulls, nested junk)."""
    cls = MESSAGE_TYPES[type_name]
    real = protocol.to_dict(data.draw(dataclass_values(cls)))
    names = [f.name for f in dataclasses.fields(cls)]
    junk = data.draw(st.dictionaries(st.sampled_from(names), json_values, max_size=len(names)))
    dropped = data.draw(st.sets(st.sampled_from(names), max_size=2))
    payload = {k: v for k, v in (real | junk).items() if k not in dropped}
    try:
        message = protocol.decode(json.dumps(payload | {"type": type_name, "version": version}))
    except ProtocolError:
        return
    assert_valid(message)
    assert type(message) is cls


@examples(200)
@given(value=json_values)
def test_any_json_decodes_or_raises_protocol_error(value):
    try:
        message = protocol.decode(json.dumps(value))
    except ProtocolError:
        return
    assert_valid(message)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,  # nested beyond the JSON reader's recursion limit
        "1" * 5000,  # a number of more digits than int() converts
        '{"type": "cancel_job", "version": "\u00b2.0", "job_id": "j"}',  # a non-ASCII digit
        '{"type": "cancel_job", "version": "' + "1" * 5000 + '", "job_id": "j"}',
        '{"type": "edit_job", "version": "1.1", "job_id": "j", "model_id": "m", '
        '"template_ref": "t", "mask_ref": "m", "prompt": "p", "seed": true, "steps": 4, '
        '"guidance": 7}',  # a bool is not a seed
    ],
)
def test_pathological_payloads_raise_protocol_error(text):
    with pytest.raises(ProtocolError):
        protocol.decode(text)
