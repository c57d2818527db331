"""The edit parameters of a multipart form, declared once for every route that takes them
(``POST /v1/jobs`` and ``POST /v1/batches``): a FastAPI dependency that reads them into the
``JobRequest`` fields they set. The template, the mask(s) and the prompt(s) are each route's own.
"""

from __future__ import annotations

from typing import Any

from fastapi import Form

from backend.api.adapter_requests import FORM_HELP, parse_choices
from backend.imaging.uploads import DEFAULT_CROP_PADDING_PX
from backend.protocol import MaskOps


def edit_form(
    negative_prompt: str = Form(""),
    model: str | None = Form(None, description="Model id (default: the server's model)"),
    steps: int | None = Form(None, description="1..150 (default: the model's)"),
    guidance: float | None = Form(None, description="0..50 (default: the model's)"),
    strength: float = Form(1.0, description="(0, 1]"),
    seed: int | None = Form(None, description="0..2^32-1; empty: random (returned)"),
    threshold: int = Form(127, description="Mask pixels above this are repainted (0..254)"),
    invert: bool = Form(False),
    grow_px: int = Form(0, description="Grow (or, negative, shrink) the mask by this many pixels"),
    feather_px: float = Form(0.0, description="Soften the paste-back edge (0..256 px)"),
    fill_holes: bool = Form(
        False, description="Fill what a closed painted outline encloses (lasso)"
    ),
    min_area_px: int = Form(
        0, description="Drop painted specks smaller than this many pixels (0: keep all)"
    ),
    mode: str = Form(
        "generate",
        description="generate (the model paints the prompt) or erase (the painted area is "
        "filled from its surroundings at once, no model, no prompt)",
    ),
    inpaint_area: str = Form(
        "whole",
        description="whole (the model edits the whole image) or masked (a padded crop around the "
        "mask, edited at the model's resolution and pasted back: more detail for a small mask on "
        "a large image)",
    ),
    crop_padding_px: int = Form(
        DEFAULT_CROP_PADDING_PX,
        description="Context around the mask in the masked-area crop, pixels (0..1024)",
    ),
    resolution: int = Form(0, description="Model resolution bucket side; 0: the model's default"),
    use_cache: bool = Form(True, description="Reuse the template's cached activations"),
    adapters: str = Form("", description=FORM_HELP),
    service_class: str | None = Form(
        None,
        description="interactive (someone waits for it) or batch (default): each class has a "
        "target latency, its default deadline; admission control answers 429 to a class that "
        "sheds (batch by default) when the job would finish too late or the queue is full, and "
        "accepts another class's job marked late",
    ),
    deadline_s: float | None = Form(
        None,
        description="Seconds from now by which the result should be stored, (0, 604800] "
        "(default: the class's target)",
    ),
    priority: int = Form(0, description="0..9, higher goes first among jobs with a deadline"),
) -> dict[str, Any]:
    """The ``JobRequest`` fields these form fields set (empty texts read as not given)."""
    return {
        "negative_prompt": negative_prompt,
        "model": model or None,
        "steps": steps,
        "guidance": guidance,
        "strength": strength,
        "seed": seed,
        "mask_ops": MaskOps(
            threshold=threshold,
            invert=invert,
            grow_px=grow_px,
            feather_px=feather_px,
            fill_holes=fill_holes,
            min_area_px=min_area_px,
        ),
        "mode": mode,
        "inpaint_area": inpaint_area,
        "crop_padding_px": crop_padding_px,
        "resolution": resolution,
        "use_cache": use_cache,
        "adapters": tuple(parse_choices(adapters)),
        "service_class": service_class or None,
        "deadline_s": deadline_s,
        "priority": priority,
    }
