"""Unknown fields refused by name on the REST routes (``/v1/templates``, ``/v1/adapters``,
``/v1/jobs``, ``/v1/batches``).

Rule: a route takes the form fields (and query parameters) it declares and nothing else. FastAPI
ignores any other, so a misspelt one (``stepz=3``) would be dropped and the job would run with the
default; instead the request is refused (422, ``field`` naming it) with the closest declared name
when there is one: ``unknown field 'stepz': did you mean 'steps'?``. The OpenAI-compatible route
parses its own form and refuses unknown fields itself (``openai_images``).
"""

from __future__ import annotations

import difflib

from fastapi import Request

from backend.api.checks import ServiceError
from backend.api.security import API_KEY_QUERY

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def declared_names(route) -> tuple[frozenset[str], frozenset[str]]:
    """(query parameter names, form field names) a route declares, its dependencies' included.
    The key's query parameter is declared everywhere: the guard says where it is taken."""
    query, form = {API_KEY_QUERY}, set()
    pending = [route.dependant]
    while pending:
        dependant = pending.pop()
        query.update(field.alias for field in dependant.query_params)
        form.update(field.alias for field in dependant.body_params)
        pending.extend(dependant.dependencies)
    return frozenset(query), frozenset(form)


def unknown_message(kind: str, unknown: list[str], known: frozenset[str]) -> str:
    """One clause per unknown name, each with the closest known name when one is close; the
    known names listed when any has none."""
    clauses, lost = [], False
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        if close:
            clauses.append(f"unknown {kind} {name[:40]!r}: did you mean {close[0]!r}?")
        else:
            clauses.append(f"unknown {kind} {name[:40]!r}")
            lost = True
    accepted = f" (this route takes {', '.join(sorted(known)) or 'none'})" if lost else ""
    return "; ".join(clauses) + accepted


async def refuse_unknown_fields(request: Request) -> None:
    """A route dependency: ``ServiceError`` (422) naming every query parameter and form field the
    matched route does not declare."""
    route = request.scope.get("route")
    if route is None:
        return
    query, form = declared_names(route)
    unknown_query = [name for name in dict.fromkeys(request.query_params) if name not in query]
    if unknown_query:
        raise ServiceError(
            unknown_message("query parameter", unknown_query, query - {API_KEY_QUERY}),
            field=unknown_query[0],
        )
    content_type = request.headers.get("content-type", "")
    if not form or not content_type.startswith(FORM_TYPES):
        return  # a route without form fields read no form; another body type is FastAPI's to refuse
    sent = await request.form()  # the one FastAPI parsed already (Starlette keeps it)
    unknown_form = [name for name in dict.fromkeys(sent.keys()) if name not in form]
    if unknown_form:
        raise ServiceError(unknown_message("field", unknown_form, form), field=unknown_form[0])
