"""The base of every settings section (``backend.config``'s tree and the sections it imports)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    # Each field's docstring (the string literal under it) is its description: the configuration
    # reference (docs/configuration.md, ``maskserve config-reference``) is generated from them.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def comma_separated(value):
    """A list setting from a variable (``a,b``) or a sequence: stripped, empty items dropped."""
    if isinstance(value, str):
        value = value.split(",")
    return tuple(item.strip() for item in value if item and item.strip())
