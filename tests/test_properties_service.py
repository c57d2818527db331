"""Properties of request and settings validation: the job request's numbers are accepted exactly
inside their documented ranges (outside: ServiceError ``invalid``), settings from any environment
mapping either load or raise SettingsError naming the variable, and a submission refused for its
mask stores nothing although its image was fine."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from backend.api.app import create_app
from backend.api.checks import (
    MAX_GUIDANCE,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_STEPS,
    RESOLUTION_RANGE,
    ServiceError,
    check_numbers,
    whole,
)
from backend.api.service import JobRequest
from backend.config import Settings, SettingsError, env_variable_names, load_settings
from tests.api_factory import IMAGE, KEY, mask_png, png
from tests.property_settings import examples
from tests.test_api_fuzz import stored

numbers = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**40), 2**40)


@examples(400)
@given(
    steps=st.integers(-10, MAX_STEPS + 10),
    guidance=numbers,
    strength=numbers,
    seed=st.integers(-10, MAX_SEED + 10) | st.integers(-(2**70), 2**70),
    resolution=st.integers(-10, RESOLUTION_RANGE[1] + 10),
    prompt_chars=st.integers(0, MAX_PROMPT_CHARS + 5),
)
def test_numbers_are_accepted_exactly_inside_their_ranges(
    steps, guidance, strength, seed, resolution, prompt_chars
):
    request = JobRequest(
        mask=b"", prompt="p" * prompt_chars, strength=strength, resolution=resolution
    )
    expected = (
        1 <= steps <= MAX_STEPS
        and 0 <= guidance <= MAX_GUIDANCE  # NaN compares false: refused
        and 0 < strength <= 1
        and 0 <= seed <= MAX_SEED
        and (resolution == 0 or RESOLUTION_RANGE[0] <= resolution <= RESOLUTION_RANGE[1])
        and prompt_chars <= MAX_PROMPT_CHARS
    )
    try:
        check_numbers(request, steps, guidance, seed)
    except ServiceError as exc:
        assert not expected and exc.code == "invalid", exc
        return
    assert expected


@examples(200)
@given(value=numbers | st.booleans() | st.text(max_size=4))
def test_whole_numbers_are_exactly_the_integral_non_bool_numbers(value):
    integral = (type(value) is int) or (isinstance(value, float) and value.is_integer())
    try:
        number = whole("steps", value)
    except ServiceError as exc:
        assert not integral and "whole number" in str(exc)
        return
    assert integral and number == value


env_values = st.one_of(
    st.text(max_size=12),
    st.integers().map(str),
    st.floats().map(str),
    st.sampled_from(["0", "1", "-1", "true", "no", "cpu", "cuda:0", "kv", "lru", "a:b", "1e400"]),
)


@examples(400)
@given(name=st.sampled_from(sorted(env_variable_names())), value=env_values)
def test_one_bad_variable_is_named_by_the_settings_error(name, value):
    try:
        settings = load_settings({name: value})
    except SettingsError as exc:
        assert name in str(exc), exc
        return
    assert isinstance(settings, Settings)


@examples(150)
@given(env=st.dictionaries(st.sampled_from(sorted(env_variable_names())), env_values))
def test_any_environment_loads_or_raises_settings_error(env):
    try:
        load_settings(env)
    except SettingsError as exc:
        assert any(name in str(exc) for name in env), exc


# ----- a refused submission stores nothing -------------------------------------------------------
@pytest.fixture
def api(redis_url, redis_client, tmp_path):
    settings = load_settings(
        {
            "MASKSERVE_REDIS_URL": redis_url,
            "MASKSERVE_DATA_DIR": str(tmp_path / "data"),
            "MASKSERVE_API_KEYS": KEY,
            "MASKSERVE_STUDIO": "0",
        },
        api={"read_rate_per_minute": 0, "write_rate_per_minute": 0},
    )
    with TestClient(
        create_app(settings, redis_client=redis_client), headers={"X-API-Key": KEY}
    ) as client:
        yield client, settings


def _submit(client, mask: bytes, **form):
    files = {"image": ("image.png", IMAGE, "image/png"), "mask": ("mask.png", mask, "image/png")}
    return client.post("/v1/jobs", data={"prompt": "a chair", "steps": "4"} | form, files=files)


@pytest.mark.parametrize(
    "mask, form, status",
    [
        (mask_png(box=(0, 0, 0, 0)), {}, 422),  # nothing painted
        (mask_png(size=(10, 10)), {}, 422),  # another size than the image
        (b"GIF89a not really", {}, 415),
        (mask_png()[:60], {}, 422),  # truncated in its pixel data
        (mask_png(), {"invert": "true", "grow_px": "-512"}, 422),  # empty after its operations
        (png(Image.new("RGBA", (64, 48), (0, 0, 0, 0))), {}, 422),  # transparent: unpainted
    ],
    ids=["empty", "wrong-size", "gif", "truncated", "empty-after-ops", "transparent"],
)
def test_a_submission_refused_for_its_mask_stores_nothing(api, redis_client, mask, form, status):
    client, settings = api
    before = stored(settings, redis_client)
    refused = _submit(client, mask, **form)
    assert refused.status_code == status and refused.json()["error"], refused.text
    assert stored(settings, redis_client) == before
    accepted = _submit(client, mask_png())  # the same image with a good mask is taken
    assert accepted.status_code == 202 and stored(settings, redis_client) != before


@pytest.mark.parametrize("resolution", ["-5", "63", "2049", "100000"])
def test_a_prepare_with_a_resolution_out_of_range_is_refused_and_stores_nothing(
    api, redis_client, resolution
):
    client, settings = api
    uploaded = client.post("/v1/templates", files={"file": ("t.png", IMAGE, "image/png")})
    before = stored(settings, redis_client)
    refused = client.post(
        f"/v1/templates/{uploaded.json()['id']}/prepare", data={"resolution": resolution}
    )
    assert refused.status_code == 422 and "resolution" in refused.json()["error"]
    assert stored(settings, redis_client) == before
