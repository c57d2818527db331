"""The LoRA adapters an edit request names: parsed from the caller's field, checked against the
registry and the settings, turned into what travels with the job (``AdapterUse``).

Invariants: every check runs before the job stores anything (a refused request leaves nothing
behind); an adapter is used only by its owner's jobs and only with the model it was registered
for (its layers were checked against that model's shapes when it was uploaded); each adapter
appears once per request; scales are finite and inside the configured range.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from backend.adapters.store import AdapterNotFound, AdapterStore
from backend.api.checks import ServiceError
from backend.config import AdapterSettings
from backend.protocol import AdapterUse


@dataclass(frozen=True)
class AdapterChoice:
    """One adapter as a caller names it: its id (``GET /v1/adapters``) and a scale."""

    adapter_id: str
    scale: float = 1.0


FORM_HELP = (
    'LoRA adapters, as JSON: [{"id": "<adapter id>", "scale": 0.8}, ...] (scale defaults to 1); '
    "ids from GET /v1/adapters"
)


def _refused(message: str) -> ServiceError:
    """The request's adapters refused (422): the error names the ``adapters`` field."""
    return ServiceError(message, field="adapters")


def parse_choices(text: str) -> list[AdapterChoice]:
    """The adapters of a form field (JSON list of ``{"id", "scale"}``; empty: none)."""
    if not text.strip():
        return []
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise _refused(f"adapters is not JSON ({exc}): {FORM_HELP}") from None
    if not isinstance(items, list):
        raise _refused(f"adapters must be a JSON list: {FORM_HELP}")
    return [_choice(item) for item in items]


def _choice(item: object) -> AdapterChoice:
    if not isinstance(item, dict) or not isinstance(item.get("id"), str):
        raise _refused(f"each adapter needs a string id: {FORM_HELP}")
    unknown = sorted(set(item) - {"id", "scale"})
    if unknown:
        raise _refused(f"unknown adapter fields {', '.join(unknown)}: {FORM_HELP}")
    scale = item.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise _refused(f"the scale of adapter {item['id']} must be a number, got {scale!r}")
    return AdapterChoice(item["id"], float(scale))


def resolve_uses(
    choices: Sequence[AdapterChoice],
    store: AdapterStore,
    owner: str,
    model_id: str,
    limits: AdapterSettings,
) -> list[AdapterUse]:
    """What travels with the job for ``choices``; ``ServiceError`` (422) naming what to fix."""
    if len(choices) > limits.max_per_request:
        raise _refused(
            f"{len(choices)} adapters named: a request may use at most {limits.max_per_request}"
        )
    ids = [c.adapter_id for c in choices]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise _refused(
            f"adapter {', '.join(repeated)} is named more than once: name each once, with "
            "the sum of the scales"
        )
    return [_use(choice, store, owner, model_id, limits) for choice in choices]


def _use(
    choice: AdapterChoice, store: AdapterStore, owner: str, model_id: str, limits: AdapterSettings
) -> AdapterUse:
    scale = choice.scale
    if not math.isfinite(scale) or not limits.scale_min <= scale <= limits.scale_max:
        raise _refused(
            f"the scale of adapter {choice.adapter_id} is {scale}: use a value in "
            f"[{limits.scale_min}, {limits.scale_max}]"
        )
    try:
        record = store.get(choice.adapter_id, owner)
    except AdapterNotFound:
        raise _refused(
            f"adapter {choice.adapter_id[:64]} does not exist: upload it with POST /v1/adapters "
            "or pick one of GET /v1/adapters"
        ) from None
    if record.model_id != model_id:
        raise _refused(
            f"adapter {record.adapter_id} ({record.name}) was registered for {record.model_id}; "
            f"this edit runs {model_id}: pick that model, or register the adapter for this one"
        )
    return AdapterUse(record.adapter_id, record.sha256, scale, record.nbytes)


def adapter_fields(uses: Sequence[AdapterUse]) -> list[dict]:
    """The adapters of a job (or a pinned cache) as its record and answers show them."""
    return [{"id": use.adapter_id, "scale": use.scale} for use in uses]
