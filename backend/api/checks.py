"""Range and shape checks of an edit request's fields, shared by the job service and its tests.

Every check raises ``ServiceError`` (the API answers 4xx with its message) naming the field and
the range to use; none touches Redis, a blob or a model.
"""

from __future__ import annotations

import math

from backend.imaging.masks import MaskError
from backend.imaging.uploads import UploadError, validate_inpaint_area
from backend.imaging.uploads import _validate_ops as validate_mask_ops
from backend.protocol.messages import JOB_MODES

MAX_PROMPT_CHARS = 2000
MAX_STEPS = 150
MAX_GUIDANCE = 50.0
MAX_SEED = 2**32 - 1
RESOLUTION_RANGE = (64, 2048)


class ServiceError(ValueError):
    """A request the service refuses; ``code`` is one of ``invalid``, ``not_found``, ``conflict``,
    ``gone``, ``unsupported_format``, ``too_large``, ``too_many``, ``unavailable``. The message
    says what to fix; ``headers`` and ``detail`` (more fields of the error body) are for the
    HTTP answer. ``field``: the request field to fix, when the error is about one; it is
    ``detail.field`` (the OpenAI-compatible route answers it as ``param``)."""

    headers: dict[str, str] | None = None
    detail: dict | None = None

    def __init__(self, message: str, code: str = "invalid", field: str | None = None):
        super().__init__(message)
        self.code = code
        if field:
            self.detail = {"field": field}


class Overloaded(ServiceError):
    """Admission control refused the job (``too_many``, 429): ``Retry-After`` says when to try
    again, ``detail`` which bound refused it and the numbers behind it
    (``errors.AdmissionRefused``)."""

    def __init__(self, message: str, retry_after_s: int, detail: dict):
        super().__init__(message, "too_many")
        self.retry_after_s = int(retry_after_s)
        self.headers = {"Retry-After": str(self.retry_after_s)}
        self.detail = detail


def check_range(name: str, value, low, high, low_open: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ServiceError(f"{name} must be a finite number, got {value}", field=name)
    if (value <= low if low_open else value < low) or value > high:
        bracket = "(" if low_open else "["
        raise ServiceError(
            f"{name} {value} is out of range: use a value in {bracket}{low}, {high}]", field=name
        )


def check_resolution(resolution: int) -> None:
    if resolution and not RESOLUTION_RANGE[0] <= resolution <= RESOLUTION_RANGE[1]:
        raise ServiceError(
            f"resolution {resolution} is out of range: use 0 (the model's default) or "
            f"{RESOLUTION_RANGE[0]}..{RESOLUTION_RANGE[1]}",
            field="resolution",
        )


def whole(name: str, value) -> int:
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral:
        raise ServiceError(f"{name} must be a whole number, got {value!r}", field=name)
    return int(value)


def check_numbers(request, steps, guidance, seed) -> None:
    """Numbers, texts, mode, mask ops and crop of a request (``JobRequest``) within their
    documented ranges; ``ServiceError`` naming the first that is not."""
    check_range("steps", steps, 1, MAX_STEPS)
    check_range("guidance", float(guidance), 0.0, MAX_GUIDANCE)
    check_range("strength", float(request.strength), 0.0, 1.0, low_open=True)
    check_range("seed", seed, 0, MAX_SEED)
    for name, text in (
        ("prompt", request.prompt),
        ("negative_prompt", request.negative_prompt),
    ):
        if not isinstance(text, str):
            raise ServiceError(f"{name} must be text", field=name)
        if len(text) > MAX_PROMPT_CHARS:
            raise ServiceError(
                f"{name} is {len(text)} characters long, the limit is {MAX_PROMPT_CHARS}: "
                "shorten it",
                field=name,
            )
    check_resolution(request.resolution)
    if request.mode not in JOB_MODES:
        raise ServiceError(
            f"mode {request.mode!r} is not known: use one of {', '.join(JOB_MODES)} (erase "
            "fills the painted area from its surroundings, with no model and no prompt)",
            field="mode",
        )
    try:
        validate_mask_ops(request.mask_ops)
        validate_inpaint_area(request.inpaint_area, request.crop_padding_px)
    except (MaskError, UploadError) as exc:
        raise ServiceError(str(exc)) from None


def check_prompt(request) -> None:
    """A ``generate`` edit paints what its prompt says, so its prompt must have a word: an empty or
    whitespace-only one is refused. An ``erase`` needs none (the area is filled from its
    surroundings, with no model), and a cache recording (``prepare``) is no edit."""
    if request.mode != "erase" and not request.prompt.strip():
        raise ServiceError(
            "prompt is empty: say what to paint in the masked area (or use mode=erase to fill it "
            "from its surroundings, which needs no prompt)",
            field="prompt",
        )
