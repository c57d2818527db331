"""Hooked forwards that refuse what they do not implement, instead of dropping it.

The mask-aware forwards replace a diffusers module's ``forward`` while a ``ForwardContext`` is
active. ``StrictForwardHook`` binds every call to the stock forward's signature, so positional and
keyword arguments are seen alike, and raises ``UnsupportedForwardError`` (naming the argument and
what to do) for any argument the mask-aware forward does not implement whose value is not inert
(None, False or an empty mapping: values for which the stock forward does nothing). With no active
context the stock forward runs, untouched.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any

from diffusers.hooks import ModelHook

from backend.engine.context import ForwardContext, current_context

RUN_ORDINARY = "run the ordinary pipeline (no template cache) for this request"


class UnsupportedForwardError(ValueError):
    """The mask-aware forward was asked for something it does not compute."""


class StrictForwardHook(ModelHook, ABC):
    """Subclasses name the arguments they implement (``implemented``), give advice for arguments
    callers are known to pass (``advice``: name -> what to do instead) and compute the output in
    ``run(module, ctx, arguments)`` from the bound arguments, defaults applied."""

    implemented: frozenset[str] = frozenset()
    advice: dict[str, str] = {}

    def initialize_hook(self, module):
        self.signature = inspect.signature(module.forward)
        self.owner = type(module).__name__
        return module

    def new_forward(self, module, *args, **kwargs):
        ctx = current_context()
        if ctx is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self.refuse_unimplemented(bound.arguments)
        return self.run(module, ctx, bound.arguments)

    @abstractmethod
    def run(self, module, ctx: ForwardContext, arguments: dict[str, Any]): ...

    def refuse_unimplemented(self, arguments: dict[str, Any]) -> None:
        for name, value in self._named_values(arguments):
            if name not in self.implemented and not _inert(value):
                raise UnsupportedForwardError(
                    f"{self.owner}.forward got {name}={_describe(value)}, which the mask-aware "
                    f"forward does not implement: {self.advice.get(name, RUN_ORDINARY)}"
                )

    def _named_values(self, arguments: dict[str, Any]):
        """(name, value) of every argument; the entries of a ``**kwargs`` catch-all by their own
        names (a forward that accepts them would otherwise drop them unseen)."""
        for name, value in arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                yield from value.items()
            else:
                yield name, value


def _inert(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (dict, tuple)) and not value)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"dict with keys {sorted(value)}"
    shape = getattr(value, "shape", None)
    return f"a tensor of shape {tuple(shape)}" if shape is not None else repr(value)[:80]


class UnsupportedModelError(ValueError):
    """The model holds a part the mask-aware forward does not reproduce (checked at install, so it
    fails at load instead of giving wrong pixels later)."""


def require_type(part: Any, allowed: tuple[type, ...], where: str) -> None:
    """Raise ``UnsupportedModelError`` unless ``part`` is exactly one of ``allowed`` (a subclass may
    compute something else)."""
    if type(part) not in allowed:
        names = " or ".join(cls.__name__ for cls in allowed)
        raise UnsupportedModelError(
            f"mask-aware engine: {where} is {type(part).__module__}.{type(part).__qualname__}, "
            f"expected {names}; the mask-aware forward reimplements only those, so load the model "
            "without custom attention processors, adapters or replaced layers"
        )


def require(condition: bool, where: str, what: str) -> None:
    """Raise ``UnsupportedModelError`` naming the part and the setting it needs."""
    if not condition:
        raise UnsupportedModelError(f"mask-aware engine: {where} must have {what}")
