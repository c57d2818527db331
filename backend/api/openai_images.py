"""What an OpenAI images-edit call asks for, in MaskServe's terms: the form's fields, the size, the
OpenAI mask convention. Pure: no HTTP, Redis or model here (the route, ``routes_openai``, is the
shell around it).

Invariants:
* every field is checked before any image is decoded and any job is built: a bad field is an
  ``OpenAIError`` (400) whose ``param`` names it, an unknown field is refused by name (a misspelt
  extra must not be ignored silently);
* the mask follows OpenAI's convention: fully transparent pixels (alpha 0) of ``mask``, or of the
  image itself when no mask is sent, are where to edit; it becomes a MaskServe mask (white = edit,
  black = keep), so the rest of the pipeline sees an ordinary job;
* ``size`` is the size of the result: an upload of another size is centre-cropped to the size's
  aspect and resized (image and mask through the same box), and the model runs at the resolution
  bucket of that size; ``auto`` keeps the image's own size and the model's default resolution;
* the seeds of ``n`` edits are ``seed, seed + 1, ..., seed + n - 1`` (one random base when none is
  given), each within ``[0, MAX_SEED]``.
"""

from __future__ import annotations

import io
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from backend.api.checks import MAX_SEED
from backend.api.openai_errors import OpenAIError
from backend.imaging.uploads import UploadError, decode_image, fit_to_bucket, require_edit_size

SIZES = ("256x256", "512x512", "1024x1024", "1536x1024", "1024x1536", "auto")
RESPONSE_FORMATS = ("url", "b64_json")
MAX_N = 10
# OpenAI's model names: each stands for this deployment's default model
OPENAI_MODEL_PREFIXES = ("dall-e", "gpt-image", "chatgpt-image")
# models whose default response_format is url (OpenAI's DALL-E); every other: b64_json
URL_DEFAULT_PREFIX = "dall-e"
IMAGE_FIELDS = ("image", "image[]")
# OpenAI fields with nothing to change here, accepted with the values that ask for nothing else
NEUTRAL_VALUES = {
    "background": ("auto", "opaque"),
    "quality": ("auto", "standard"),
    "output_format": ("png",),
    "stream": ("false",),
    "moderation": ("auto", "low"),
}
# OpenAI fields this server has no equivalent for: refused, so nobody expects their effect
UNSUPPORTED = (
    "complexity",
    "frame_count",
    "frame_duration_ms",
    "input_fidelity",
    "markup",
    "output_compression",
    "partial_images",
    "style",
)
RECORDED = ("user", "safety_identifier")  # who asked (OpenAI's abuse-monitoring id): logged
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _whole(name: str, text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise OpenAIError(f"{name} must be a whole number, got {text[:40]!r}", param=name) from None
    if not value.is_integer():
        raise OpenAIError(f"{name} must be a whole number, got {text[:40]!r}", param=name)
    return int(value)


def _number(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise OpenAIError(f"{name} must be a number, got {text[:40]!r}", param=name) from None
    if not math.isfinite(value):
        raise OpenAIError(f"{name} must be a finite number, got {text[:40]!r}", param=name)
    return value


def _flag(name: str, text: str) -> bool:
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise OpenAIError(f"{name} must be true or false, got {text[:40]!r}", param=name)


def _text(_name: str, text: str) -> str:
    return text


# MaskServe's own parameters, sent through the openai client's ``extra_body``: name -> parser.
# Ranges are checked by the job service, as for POST /v1/jobs.
EXTRA_FIELDS = {
    "steps": _whole,
    "seed": _whole,
    "guidance": _number,
    "negative_prompt": _text,
    "adapters": _text,  # JSON, as POST /v1/jobs takes it
    "service_class": _text,
    "deadline_s": _number,
    "priority": _whole,
    "use_cache": _flag,
    "template_id": _text,
}
OPENAI_FIELDS = (
    *IMAGE_FIELDS,
    "mask",
    "prompt",
    "n",
    "size",
    "response_format",
    "model",
    *RECORDED,
    *NEUTRAL_VALUES,
    *UNSUPPORTED,
)


@dataclass(frozen=True)
class EditCall:
    """One call's fields, checked. ``size`` None: auto. ``model`` None: the deployment's default.
    ``extras``: the MaskServe parameters given (parsed), by name."""

    image: bytes
    prompt: str
    mask: bytes | None = None
    n: int = 1
    size: tuple[int, int] | None = None
    response_format: str = "b64_json"
    model: str | None = None
    user: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


def parse_size(text: str) -> tuple[int, int] | None:
    """(width, height) of an accepted size; None for ``auto``."""
    if text not in SIZES:
        raise OpenAIError(
            f"size {text[:40]!r} is not supported: use one of {', '.join(SIZES)} (auto keeps the "
            "image's own size)",
            param="size",
        )
    if text == "auto":
        return None
    width, height = text.split("x")
    return int(width), int(height)


def resolution_for(size: tuple[int, int] | None) -> int:
    """The model resolution bucket (side of a square of the same area) for a result of ``size``;
    0 (the model's default) for auto."""
    return 0 if size is None else round(math.sqrt(size[0] * size[1]))


def model_for(name: str) -> str | None:
    """Our model id for the ``model`` field: an OpenAI name (or none) means the default."""
    name = name.strip()
    if not name or name.lower().startswith(OPENAI_MODEL_PREFIXES):
        return None
    return name


def _check_names(fields: dict[str, str], file_names: list[str]) -> None:
    known = (*OPENAI_FIELDS, *EXTRA_FIELDS)
    unknown = sorted({name for name in [*fields, *file_names] if name not in known})
    if unknown:
        hint = ""
        if any(name.startswith("adapters[") for name in unknown):
            hint = ' (send adapters as one JSON string: extra_body={"adapters": json.dumps([...])})'
        raise OpenAIError(
            f"unknown field(s) {', '.join(unknown)}{hint}: MaskServe takes OpenAI's image edit "
            f"fields and, through extra_body, {', '.join(EXTRA_FIELDS)}",
            param=unknown[0],
        )
    for name in UNSUPPORTED:
        if name in fields or name in file_names:
            raise OpenAIError(f"{name} is not supported by MaskServe: leave it out", param=name)
    for name, allowed in NEUTRAL_VALUES.items():
        if name in fields and fields[name].strip().lower() not in allowed:
            raise OpenAIError(
                f"{name}={fields[name][:40]!r} is not supported by MaskServe: use "
                f"{' or '.join(allowed)} (or leave it out)",
                param=name,
            )


def _single(pairs: list[tuple[str, str]]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for name, value in pairs:
        if name in fields:
            raise OpenAIError(f"{name} is given more than once: send it once", param=name)
        fields[name] = value
    return fields


def _images(files: list[tuple[str, bytes]]) -> tuple[bytes, tuple[str, ...]]:
    images = [data for name, data in files if name in IMAGE_FIELDS]
    if not images:
        raise OpenAIError("image is required: send the image to edit as a file", param="image")
    if len(images) == 1:
        return images[0], ()
    return images[0], (
        f"{len(images)} images were sent: MaskServe edits the first one only (the others are "
        "ignored); send one image per call",
    )


def _n(fields: dict[str, str]) -> int:
    n = _whole("n", fields.get("n") or "1")
    if not 1 <= n <= MAX_N:
        raise OpenAIError(f"n is {n}: use 1 to {MAX_N} edits per call", param="n")
    return n


def _response_format(fields: dict[str, str], model: str) -> str:
    default = "url" if model.lower().startswith(URL_DEFAULT_PREFIX) else "b64_json"
    value = fields.get("response_format") or default
    if value not in RESPONSE_FORMATS:
        raise OpenAIError(
            f"response_format {value[:40]!r} is not supported: use url or b64_json",
            param="response_format",
        )
    return value


def parse_edit(pairs: list[tuple[str, str]], files: list[tuple[str, bytes]]) -> EditCall:
    """The call a multipart form asks for: ``pairs`` its text fields, ``files`` its file parts
    (name, bytes), in the order sent. Decodes no image."""
    fields = _single(pairs)
    file_names = [name for name, _ in files]
    _check_names(fields, file_names)
    for name in ("mask", "prompt"):
        if file_names.count(name) + (name in fields) > 1:
            raise OpenAIError(f"{name} is given more than once: send it once", param=name)
    if "mask" in fields:
        raise OpenAIError("mask must be a file (a PNG with transparency)", param="mask")
    image, warnings = _images(files)
    prompt = fields.get("prompt", "")
    if not prompt.strip():
        raise OpenAIError("prompt is required: say what to paint where the mask is", param="prompt")
    model_field = fields.get("model", "")
    extras = {
        name: parse(name, fields[name]) for name, parse in EXTRA_FIELDS.items() if name in fields
    }
    return EditCall(
        image=image,
        prompt=prompt,
        mask=next((data for name, data in files if name == "mask"), None),
        n=_n(fields),
        size=parse_size(fields.get("size") or "auto"),
        response_format=_response_format(fields, model_field),
        model=model_for(model_field),
        user=fields.get("safety_identifier") or fields.get("user", ""),
        extras=extras,
        warnings=warnings,
    )


def first_seed(base: int | None, n: int) -> int:
    """The first of ``n`` consecutive seeds (random when ``base`` is None), the last within
    MAX_SEED."""
    if base is None:
        return secrets.randbelow(MAX_SEED - n + 2)
    if not 0 <= base <= MAX_SEED - n + 1:
        raise OpenAIError(
            f"seed {base} is out of range for n={n}: the edits use seed..seed+n-1, so use 0.."
            f"{MAX_SEED - n + 1}",
            param="seed",
        )
    return base


# ----- images and masks ---------------------------------------------------------------------------
@dataclass(frozen=True)
class EditImages:
    """What the jobs get: ``image`` the bytes to upload (None: a gallery template is edited),
    ``mask`` a MaskServe mask PNG (white = edit), ``size`` (width, height) of the results,
    ``resolution`` the model resolution bucket (0: the model's default)."""

    image: bytes | None
    mask: bytes
    size: tuple[int, int]
    resolution: int


def _decode(data: bytes, what: str, max_pixels: int) -> Image.Image:
    try:  # the file's own mode: its alpha is what is read
        image = decode_image(data, max_pixels, what=what, keep_mode=True)
        require_edit_size(image.size, what)
        return image
    except UploadError as exc:
        raise OpenAIError(str(exc), param=what) from None


def _alpha(image: Image.Image) -> np.ndarray | None:
    """The alpha channel, or None when the image has none."""
    if image.mode not in ("RGBA", "LA", "PA", "RGBa", "La"):
        return None
    return np.asarray(image.getchannel(image.getbands()[-1]))


def edit_area(image: Image.Image, mask: Image.Image | None) -> np.ndarray:
    """Bool (H, W): True where to edit, by OpenAI's convention (alpha 0 of the mask, or of the
    image without a mask); OpenAIError when there is no such pixel."""
    source, param = (image, "image") if mask is None else (mask, "mask")
    if mask is not None and mask.size != image.size:
        raise OpenAIError(
            f"mask is {mask.width}x{mask.height}, the image {image.width}x{image.height}: the "
            "mask must have the image's size",
            param="mask",
        )
    alpha = _alpha(source)
    if alpha is None:
        what = "the mask" if mask is not None else "the image (and no mask was sent)"
        raise OpenAIError(
            f"{what} has no transparency: mark where to edit with fully transparent pixels "
            "(alpha 0) in a PNG mask of the image's size, or in the image itself",
            param=param,
        )
    area: np.ndarray = alpha == 0
    if not area.any():
        raise OpenAIError(
            f"the {param} has no fully transparent pixel (alpha 0), so there is nothing to edit: "
            "make the area to edit fully transparent",
            param=param,
        )
    return area


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def edit_images(
    call: EditCall, max_pixels: int, template_size: tuple[int, int] | None = None
) -> EditImages:
    """The image and mask the jobs of ``call`` get. ``template_size``: (width, height) of the
    gallery template edited instead of the upload, whose pixels then only carry the edit area
    (its alpha, when no mask is sent) and must have the template's size."""
    image = _decode(call.image, "image", max_pixels)
    mask = None if call.mask is None else _decode(call.mask, "mask", max_pixels)
    area = Image.fromarray(edit_area(image, mask).astype(np.uint8) * 255, mode="L")
    if template_size is not None:
        if call.size is not None and call.size != template_size:
            raise OpenAIError(
                "size must be auto with template_id: a gallery template is edited at its own "
                f"size ({template_size[0]}x{template_size[1]})",
                param="size",
            )
        if area.size != template_size:
            raise OpenAIError(
                f"the image is {area.width}x{area.height}, the template "
                f"{template_size[0]}x{template_size[1]}: with template_id, send an image (or "
                "mask) of the template's size whose transparent pixels mark where to edit",
                param="image",
            )
        return EditImages(None, _png(area), template_size, 0)
    if call.size is None or call.size == image.size:
        size = image.size
        return EditImages(call.image, _png(area), size, resolution_for(call.size))
    target_hw = (call.size[1], call.size[0])
    # the pixels as a job sees them (transparency over white), then the same box as the mask
    fitted = fit_to_bucket(decode_image(call.image, max_pixels), target_hw)
    fitted_area = fit_to_bucket(area, target_hw).point(lambda v: 255 if v > 127 else 0)
    if not np.asarray(fitted_area).any():
        raise OpenAIError(
            f"the area to edit is lost when the image is resized to {call.size[0]}x"
            f"{call.size[1]}: make it larger, or use size auto",
            param="size",
        )
    return EditImages(_png(fitted), _png(fitted_area), call.size, resolution_for(call.size))
