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
from dataclasses import dataclass
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
        self.parameters = Parameters.of(module.forward)
        self.owner = type(module).__name__
        return module

    def new_forward(self, module, *args, **kwargs):
        ctx = current_context()
        if ctx is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        arguments = self.parameters.bind(self.owner, args, kwargs)
        self.refuse_unimplemented(arguments)
        return self.run(module, ctx, arguments)

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
            if name == self.parameters.var_keyword:
                yield from value.items()
            else:
                yield name, value


@dataclass(frozen=True)
class Parameters:
    """A forward's parameters, read once from its signature, and the binding of a call's arguments
    to them (``inspect.Signature.bind``'s rules, in plain dicts and tuples that ``torch.compile``
    traces: a compiled step binds every hooked call of its forward)."""

    positional: tuple[str, ...]  # parameters a positional argument fills, in order
    keyword: frozenset[str]  # parameters a keyword argument may name
    defaults: tuple[tuple[str, Any], ...]
    required: tuple[str, ...]
    var_positional: str | None
    var_keyword: str | None

    @classmethod
    def of(cls, function) -> Parameters:
        params = list(inspect.signature(function).parameters.values())
        kinds = inspect.Parameter
        positional = [
            p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        ]
        keyword = [
            p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
        ]
        catch_all = {
            p.kind: p.name for p in params if p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        }
        return cls(
            tuple(positional),
            frozenset(keyword),
            tuple((p.name, p.default) for p in params if p.default is not p.empty),
            tuple(
                p.name for p in params if p.default is p.empty and p.name not in catch_all.values()
            ),
            catch_all.get(kinds.VAR_POSITIONAL),
            catch_all.get(kinds.VAR_KEYWORD),
        )

    def bind(self, owner: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """name -> value of every parameter, defaults applied; ``TypeError`` (as a call of the
        forward itself would raise) for arguments it does not take or parameters left out."""
        if len(args) > len(self.positional) and self.var_positional is None:
            raise TypeError(
                f"{owner}.forward takes {len(self.positional)} positional arguments, "
                f"{len(args)} were given"
            )
        arguments = dict(self.defaults)
        arguments.update(zip(self.positional, args))
        if self.var_positional is not None:
            arguments[self.var_positional] = tuple(args[len(self.positional) :])
        given, extra = self.positional[: len(args)], {}
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(f"{owner}.forward got multiple values for argument {name!r}")
            if name in self.keyword:
                arguments[name] = value
            elif self.var_keyword is not None:
                extra[name] = value
            else:
                raise TypeError(f"{owner}.forward got an unexpected keyword argument {name!r}")
        if self.var_keyword is not None:
            arguments[self.var_keyword] = extra
        missing = [name for name in self.required if name not in arguments]
        if missing:
            raise TypeError(f"{owner}.forward is missing arguments: {', '.join(missing)}")
        return arguments


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
