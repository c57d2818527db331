"""The configuration reference (docs/configuration.md), generated from the settings tree.

Invariant: the page is a pure function of ``backend.config``: every section of ``Settings``, every
field with its environment variable, type, constraints, default and description (the field's
docstring). ``tests/test_config_reference.py`` regenerates it and compares it with the committed
file; ``make docs`` (``maskserve config-reference --out docs/configuration.md``) rewrites it.
Imports nothing but the settings module and pydantic: never torch.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from backend import config

REFERENCE_PATH = Path("docs/configuration.md")
_SOURCE_ROOT = Path(config.__file__).resolve().parent.parent

_HEADER = """\
# Configuration reference

<!-- Generated from backend/config.py by `make docs` (`maskserve config-reference`); do not edit.
A test fails when this file differs from what the settings tree generates. -->

Every MaskServe process reads its settings from one typed tree (`backend/config.py`), built from
`MASKSERVE_*` environment variables in one place at start-up. Rules that hold for every variable:

* An unset or empty variable leaves the default.
* Invalid values stop start-up with a message naming the setting and what is wrong.
* A `MASKSERVE_*` variable that sets nothing (a misspelt name) is ignored; every `maskserve`
  command logs a warning naming it and the nearest setting's variable.
* Booleans take `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`.
* Lists (API keys, users, models) are comma-separated.
* A setting shown without a variable keeps its default in deployments; code and tests set it
  through `load_settings(<section>={...})`.
* Command-line flags (`maskserve worker --max-batch`, `dispatcher --policy`, ...) override the
  variables of the process they start.
"""


def _text(doc: str | None) -> str:
    """One markdown line from a docstring: RST literals as code spans, whitespace collapsed."""
    return " ".join((doc or "").replace("``", "`").split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{arg}`" for arg in args)
    if origin in (typing.Union, types.UnionType):
        rest = [arg for arg in args if arg is not type(None)]
        named = " or ".join(_type_name(arg) for arg in rest)
        return f"{named} (optional)" if len(rest) < len(args) else named
    if origin is tuple:
        return f"list of {_type_name(args[0])}" if args else "list"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field: FieldInfo) -> str:
    bounds = []
    for item in field.metadata:
        for kind, attr, symbol in (
            (Ge, "ge", ">="),
            (Gt, "gt", ">"),
            (Le, "le", "<="),
            (Lt, "lt", "<"),
        ):
            if isinstance(item, kind):
                bounds.append(f"{symbol} {_number(getattr(item, attr))}")
        if isinstance(item, MinLen):
            bounds.append(f"length >= {item.min_length}")
        if isinstance(item, MaxLen):
            bounds.append(f"length <= {item.max_length}")
    return ", ".join(bounds)


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, (int, float)):
        return f"`{_number(value)}`"
    if isinstance(value, tuple):
        return "empty" if not value else f"`{','.join(map(str, value))}`"
    if isinstance(value, Path):
        if value.is_absolute() and value.is_relative_to(_SOURCE_ROOT):
            return f"`{value.relative_to(_SOURCE_ROOT)}/` in the source tree"
        return f"`{value}`"
    if value == "":
        return "empty"
    return f"`{value}`"


def _variables() -> dict[tuple[str | None, str], list[str]]:
    """(section, field) -> the environment variables that set it, prefixed name first."""
    names: dict[tuple[str | None, str], list[str]] = {}
    for suffix, where in config._ENV_FIELDS.items():
        names.setdefault(where, []).append(config.ENV_PREFIX + suffix)
    for name, where in config._PLAIN_ENV.items():
        names.setdefault(where, []).append(name)
    return names


def _row(name: str, field: FieldInfo, variables: list[str]) -> str:
    kind = _type_name(field.annotation)
    bounds = _constraints(field)
    if bounds:
        kind = f"{kind}, {bounds}"
    env = ", ".join(f"`{v}`" for v in variables) if variables else "(none)"
    cells = [f"`{name}`", env, kind, _default(field), _text(field.description)]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


_TABLE_HEAD = (
    "| setting | environment variable | type | default | description |\n"
    "| --- | --- | --- | --- | --- |"
)


def generate() -> str:
    """The markdown reference for the live ``Settings`` tree."""
    variables = _variables()
    sections: list[tuple[str, type[BaseModel]]] = []
    top: list[tuple[str, FieldInfo]] = []
    for name, field in config.Settings.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            sections.append((name, annotation))
        else:
            top.append((name, field))
    lines = [_HEADER, "Sections: " + ", ".join(f"[`{n}`](#{n})" for n, _ in sections) + "."]
    if top:
        lines += ["", "## Top level", "", _text(config.Settings.__doc__), "", _TABLE_HEAD]
        lines += [_row(n, f, variables.get((None, n), [])) for n, f in top]
    for section, model in sections:
        lines += ["", f"## {section}", "", _text(model.__doc__), "", _TABLE_HEAD]
        for name, field in model.model_fields.items():
            lines.append(_row(f"{section}.{name}", field, variables.get((section, name), [])))
    return "\n".join(lines) + "\n"


def stale(path: Path = REFERENCE_PATH) -> bool:
    """True when ``path`` differs from what the settings tree generates now."""
    return not path.exists() or path.read_text(encoding="utf-8") != generate()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="maskserve config-reference",
        description="print (or write) the configuration reference generated from the settings",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="write here instead of printing")
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 when --out (default {REFERENCE_PATH}) is stale, write nothing",
    )


def run(args: argparse.Namespace) -> int:
    if args.check:
        path = Path(args.out or REFERENCE_PATH)
        if stale(path):
            print(f"{path} is stale: run `make docs`", file=sys.stderr)
            return 1
        return 0
    text = generate()
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
