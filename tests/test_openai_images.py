"""The pure side of the OpenAI-compatible edits route: fields, sizes, models, seeds and OpenAI's
mask convention (alpha 0 = edit) turned into MaskServe's (white = edit); the OpenAI error shape and
its middleware (on a bare in-process app). No server, no Redis."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from backend.api.checks import MAX_SEED
from backend.api.openai_errors import OpenAIError, OpenAIErrorMiddleware, reshape
from backend.api.openai_images import (
    SIZES,
    EditCall,
    edit_area,
    edit_images,
    first_seed,
    model_for,
    parse_edit,
    parse_size,
    resolution_for,
)
from tests.test_api import png

MAX_PIXELS = 4096 * 4096


def rgba(size=(64, 48), hole=(16, 12, 40, 30)) -> Image.Image:
    """An opaque RGBA picture with a fully transparent box (the area to edit)."""
    image = Image.new("RGBA", size, (200, 40, 40, 255))
    if hole:
        image.paste((0, 0, 0, 0), hole)
    return image


def call(fields=(), files=None) -> EditCall:
    parts = [("image", png(rgba()))] if files is None else files
    return parse_edit([("prompt", "a red chair"), *fields], parts)


def refused(fields=(), files=None) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        call(fields, files)
    assert info.value.status == 400
    return info.value


# ----- fields -------------------------------------------------------------------------------------
def test_a_minimal_call_takes_the_defaults():
    edit = call()
    assert (edit.n, edit.size, edit.model, edit.mask, edit.extras) == (1, None, None, None, {})
    assert edit.response_format == "b64_json" and edit.warnings == ()


@pytest.mark.parametrize(
    ("model", "ours", "response_format"),
    [
        ("dall-e-2", None, "url"),
        ("gpt-image-1", None, "b64_json"),
        ("chatgpt-image-latest", None, "b64_json"),
        ("tiny-sd2-inpaint", "tiny-sd2-inpaint", "b64_json"),
    ],
)
def test_openai_model_names_mean_the_default_and_pick_openais_default_format(
    model, ours, response_format
):
    edit = call([("model", model)])
    assert edit.model == ours and model_for(model) == ours
    assert edit.response_format == response_format


def test_sizes_accepted_and_a_refused_one_lists_them():
    assert parse_size("auto") is None and parse_size("1536x1024") == (1536, 1024)
    assert resolution_for(None) == 0 and resolution_for((256, 256)) == 256
    assert resolution_for((1536, 1024)) == 1254
    error = refused([("size", "300x300")])
    assert error.param == "size" and all(size in str(error) for size in SIZES)


@pytest.mark.parametrize("n", ["0", "11", "2.5", "many"])
def test_n_outside_1_to_10_is_refused(n):
    assert refused([("n", n)]).param == "n"


def test_extra_fields_are_parsed_by_type():
    edit = call(
        [
            ("steps", "4"),
            ("seed", "7"),
            ("guidance", "5.5"),
            ("use_cache", "false"),
            ("service_class", "interactive"),
            ("deadline_s", "30"),
            ("priority", "3"),
            ("negative_prompt", "blur"),
            ("adapters", '[{"id": "a", "scale": 0.5}]'),
            ("template_id", "t1"),
        ]
    )
    assert edit.extras == {
        "steps": 4,
        "seed": 7,
        "guidance": 5.5,
        "use_cache": False,
        "service_class": "interactive",
        "deadline_s": 30.0,
        "priority": 3,
        "negative_prompt": "blur",
        "adapters": '[{"id": "a", "scale": 0.5}]',
        "template_id": "t1",
    }
    assert refused([("steps", "four")]).param == "steps"
    assert refused([("use_cache", "maybe")]).param == "use_cache"
    assert refused([("guidance", "nan")]).param == "guidance"


def test_unknown_fields_are_refused_by_name():
    error = refused([("stepz", "4"), ("colour", "red")])
    assert "colour, stepz" in str(error) and "steps" in str(error) and error.param == "colour"
    nested = refused([("adapters[][id]", "a")])
    assert "json.dumps" in str(nested)


def test_openai_fields_without_an_equivalent_are_refused_unless_neutral():
    assert refused([("input_fidelity", "high")]).param == "input_fidelity"
    assert refused([("output_format", "webp")]).param == "output_format"
    assert refused([("stream", "true")]).param == "stream"
    assert call([("quality", "auto"), ("background", "opaque"), ("stream", "false")]).n == 1
    assert call([("user", "u-1")]).user == "u-1"
    assert call([("user", "u-1"), ("safety_identifier", "s-1")]).user == "s-1"


def test_image_prompt_and_format_problems_name_their_field():
    assert refused(files=[]).param == "image"
    with pytest.raises(OpenAIError) as info:
        parse_edit([("prompt", "  ")], [("image", b"x")])
    assert info.value.param == "prompt"
    assert refused([("response_format", "jpeg")]).param == "response_format"
    assert refused([("mask", "not a file")]).param == "mask"
    assert refused([("n", "1"), ("n", "2")]).param == "n"


def test_several_images_edit_the_first_and_say_so():
    first, second = png(rgba()), png(rgba(hole=(0, 0, 8, 8)))
    edit = call(files=[("image[]", first), ("image[]", second)])
    assert edit.image == first and "2 images were sent" in edit.warnings[0]


# ----- seeds --------------------------------------------------------------------------------------
def test_the_first_seed_leaves_room_for_n_consecutive_ones():
    assert first_seed(7, 3) == 7 and first_seed(MAX_SEED - 1, 2) == MAX_SEED - 1
    with pytest.raises(OpenAIError) as info:
        first_seed(MAX_SEED, 2)
    assert info.value.param == "seed"
    assert all(0 <= first_seed(None, 10) <= MAX_SEED - 9 for _ in range(100))


# ----- masks --------------------------------------------------------------------------------------
def test_the_mask_alpha_zero_is_the_edit_area_and_the_image_alpha_without_a_mask():
    image = rgba(hole=(0, 0, 4, 4))
    mask = rgba(hole=(10, 10, 20, 30))
    area = edit_area(image, mask)
    assert area.sum() == 10 * 20 and area[10:30, 10:20].all()
    own = edit_area(image, None)
    assert own.sum() == 16 and own[:4, :4].all()


def test_no_transparency_is_refused_saying_how_to_mark_the_area():
    opaque = Image.new("RGB", (64, 48), "white")
    with pytest.raises(OpenAIError) as info:
        edit_area(opaque, None)
    assert info.value.param == "image" and "alpha 0" in str(info.value)
    with pytest.raises(OpenAIError) as info:
        edit_area(opaque, rgba(hole=None))  # alpha, but no pixel fully transparent
    assert info.value.param == "mask" and "no fully transparent pixel" in str(info.value)
    with pytest.raises(OpenAIError) as info:
        edit_area(opaque, rgba(size=(32, 32)))
    assert info.value.param == "mask" and "32x32" in str(info.value)


def test_auto_keeps_the_upload_and_its_size_and_the_mask_is_white_where_to_edit():
    edit = call()
    images = edit_images(edit, MAX_PIXELS)
    assert images.image == edit.image and images.size == (64, 48) and images.resolution == 0
    mask = np.asarray(Image.open(io.BytesIO(images.mask)))
    assert mask.shape == (48, 64) and set(np.unique(mask)) == {0, 255}
    assert (mask == 255).sum() == 24 * 18 and mask[12:30, 16:40].all()


def test_a_size_resizes_image_and_mask_together_and_sets_the_resolution():
    edit = call(
        [("size", "256x256")], files=[("image", png(rgba(size=(96, 96), hole=(0, 0, 48, 96))))]
    )
    images = edit_images(edit, MAX_PIXELS)
    assert images.size == (256, 256) and images.resolution == 256
    assert Image.open(io.BytesIO(images.image)).size == (256, 256)
    mask = np.asarray(Image.open(io.BytesIO(images.mask))) == 255
    assert mask[:, :120].all() and not mask[:, 136:].any()  # the left half, resized


def test_a_gallery_template_takes_the_edit_area_from_an_image_of_its_size():
    images = edit_images(call(), MAX_PIXELS, template_size=(64, 48))
    assert images.image is None and images.size == (64, 48) and images.resolution == 0
    with pytest.raises(OpenAIError) as info:
        edit_images(call(), MAX_PIXELS, template_size=(128, 96))
    assert info.value.param == "image" and "128x96" in str(info.value)
    with pytest.raises(OpenAIError) as info:
        edit_images(call([("size", "256x256")]), MAX_PIXELS, template_size=(64, 48))
    assert info.value.param == "size"


def test_an_upload_that_is_not_an_image_is_refused_naming_it():
    with pytest.raises(OpenAIError) as info:
        edit_images(call(files=[("image", b"not an image")]), MAX_PIXELS)
    assert info.value.param == "image" and "not an image file" in str(info.value)


# ----- the error shape ----------------------------------------------------------------------------
def test_our_errors_are_reshaped_into_openais_with_their_status_mapped():
    status, body = reshape(403, b'{"error": "the API key is not valid"}')
    assert status == 401 and body == {
        "error": {
            "message": "the API key is not valid",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    status, body = reshape(429, b'{"error": "queue full", "reason": "queue", "retry_after_s": 3}')
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert body["error"]["reason"] == "queue" and body["error"]["retry_after_s"] == 3
    assert reshape(422, b'{"error": "steps out of range"}')[0] == 400
    assert reshape(500, b"Internal Server Error")[1]["error"]["type"] == "server_error"
    shaped = OpenAIError("bad", param="n").body()
    assert reshape(400, json.dumps(shaped).encode()) == (400, None)


def test_the_middleware_answers_a_bug_under_its_prefix_as_a_500_and_leaves_other_paths_alone():
    async def broken(_request):
        raise RuntimeError("a bug")

    async def ours(_request):
        return JSONResponse({"error": "no such job"}, status_code=404)

    app = Starlette(
        routes=[
            Route("/v1/images/edits", broken, methods=["POST"]),
            Route("/v1/images/other", ours),
            Route("/v1/jobs", ours),
        ]
    )
    app.add_middleware(OpenAIErrorMiddleware)
    with TestClient(app, raise_server_exceptions=False) as client:
        bug = client.post("/v1/images/edits")
        assert bug.status_code == 500 and bug.json()["error"]["type"] == "server_error"
        shaped = client.get("/v1/images/other").json()["error"]
        assert shaped == {
            "message": "no such job",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        assert client.get("/v1/jobs").json() == {"error": "no such job"}
