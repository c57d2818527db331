"""A request's service level: its class, deadline and priority, checked and resolved at submission
(``ServiceLevel``), and what the API can tell of its mask before pre-processing.

* ``service_class``: ``interactive`` (someone waits for it: the studio's default) or ``batch`` (the
  REST default, and every template preparation);
* ``deadline_s``: seconds from submission by which its result should be stored, in (0, 7 days];
  default: the class's target (``DeadlineSettings.interactive_target_s`` / ``batch_target_s``);
* ``priority``: 0..``MAX_PRIORITY``, higher goes first (after rows past the starvation bound).

Every check raises ``ServiceError`` (422) naming the field and what to use; nothing is stored.
"""

from __future__ import annotations

import numpy as np

from backend.api.checks import ServiceError, check_range, whole
from backend.config_deadlines import MAX_PRIORITY, SERVICE_CLASSES, DeadlineSettings
from backend.protocol import ServiceLevel

MAX_DEADLINE_S = 7 * 86_400.0
REST_DEFAULT_CLASS = "batch"


def service_level(
    service_class: str | None,
    deadline_s: float | None,
    priority: int | float | None,
    settings: DeadlineSettings,
    now: float,
) -> ServiceLevel:
    """The request's ``ServiceLevel`` (deadline: epoch seconds, ``now`` + ``deadline_s``); ``None``
    (or an empty class) means the default."""
    service_class = service_class or REST_DEFAULT_CLASS
    if service_class not in SERVICE_CLASSES:
        raise ServiceError(
            f"service_class {str(service_class)[:40]!r} is not known: use interactive (someone "
            f"waits for it; target {settings.interactive_target_s:g} s) or batch (target "
            f"{settings.batch_target_s:g} s)",
            field="service_class",
        )
    if deadline_s is None:
        deadline_s = settings.target_s(service_class)
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float):
        raise ServiceError(
            f"deadline_s must be a number of seconds, got {deadline_s!r}", field="deadline_s"
        )
    check_range("deadline_s", float(deadline_s), 0, MAX_DEADLINE_S, low_open=True)
    priority = whole("priority", 0 if priority is None else priority)
    check_range("priority", priority, 0, MAX_PRIORITY)
    return ServiceLevel(
        service_class=service_class, deadline=now + float(deadline_s), priority=priority
    )


def mask_ratio_estimate(painted: np.ndarray, inpaint_area: str) -> float:
    """The job's mask ratio as far as the API can tell before pre-processing: the painted share of
    the image (``whole``), or of the mask's bounding box for a ``masked`` crop (the crop pads that
    box, so its ratio is at most this: an estimate on the safe side). Pre-processing measures the
    real one at the model's resolution (``PreparedJob.mask_ratio``)."""
    if not painted.any():
        return 0.0
    if inpaint_area == "masked":
        rows, cols = np.flatnonzero(painted.any(axis=1)), np.flatnonzero(painted.any(axis=0))
        painted = painted[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    return float(painted.mean())


def level_fields(level: ServiceLevel, forecast=None) -> dict:
    """The job record's fields of its service level and of the API's forecast at admission
    (``admission_control.Forecast``; None: no forecast, the worker's comes later)."""
    fields: dict = {
        "service_class": level.service_class,
        "priority": level.priority,
        "deadline": level.deadline,
        "late": level.late,
    }
    if forecast is not None:
        fields |= {"predicted_start": forecast.start, "predicted_finish": forecast.finish}
    return fields
