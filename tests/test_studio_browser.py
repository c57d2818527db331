"""The studio in a real browser: Playwright drives Debian's chromium (``/usr/bin/chromium``, which
``make test`` installs when missing; no browser is ever downloaded) against the real stack (Redis,
Celery CPU worker, dispatcher, an engine worker, the API with the studio mounted), the way a person
uses it: sign in, fill the empty gallery with the sample scenes, upload a template into it, pick
it, paint a stroke with the mouse, write a prompt, submit, wait for the result. The result must
differ inside the stroke and equal the template outside it. Later the same edit runs again with a
LoRA adapter registered in the Adapters tab (ingested by the stack's CPU worker), chosen in the
editor's picker with a scale. The other tests serve the API app alone (a real Redis, no worker:
the test records an edit done the way post-processing does) and check what the page shows: the
canvas's layers pixel by pixel, the DOM's text. Screenshots go to ``test-output/studio/`` (and
the test's tmp dir)."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

from backend.api.app import create_app
from backend.api.security import STUDIO_OWNER
from backend.client import MaskServeClient, MaskServeError
from backend.jobstate import JobStateStore
from backend.protocol.keys import job_key
from studio.actions import EditForm, StudioActions
from studio.batch_actions import BatchForm, StudioBatches
from studio.components import HISTORY_HEADERS
from studio.masks import LAYER_RGB
from templates_store.samples import sample_template
from tests.adapter_factory import make_adapter_file
from tests.api_factory import make_settings
from tests.served_app import serve
from tests.stack_factory import running_stack
from tests.test_studio_actions import finish, stroke

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
# the flags a sandboxed root session on a closed network needs (no background fetches, no sandbox)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
USER, PASSWORD, API_KEY = "tess", "paint-it-red", "browser-key"
W, H = 192, 128
OUTPUT = Path(__file__).resolve().parent.parent / "test-output" / "studio"


@pytest.fixture
def studio_stack(redis_url, models_dir, tmp_path, monkeypatch):
    env = {"MASKSERVE_API_KEYS": API_KEY, "MASKSERVE_USERS": f"{USER}:{PASSWORD}"}
    with running_stack(monkeypatch, tmp_path, redis_url, models_dir, ["w-browser"], env) as (
        running,
        base,
    ):
        yield base, running


@pytest.fixture
def studio_app(redis_url, redis_client, tmp_path):
    """The API app with the studio mounted, served over HTTP, on a real Redis and with no worker:
    an edit stays queued until the test records it done (``finish``, as post-processing does).
    Yields the base URL and the studio's actions over the same services."""
    settings = make_settings(redis_url, tmp_path, users=(f"{USER}:{PASSWORD}",))
    app = create_app(settings, redis_client=redis_client)
    with serve(app) as base:
        yield base, StudioActions(app.state.service, app.state.templates, STUDIO_OWNER)


@pytest.fixture
def browser_page(tmp_path):

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        try:
            yield page
        finally:
            browser.close()


def screenshot(page, tmp_path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    OUTPUT.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, OUTPUT / path.name)


def sign_in(page, base: str) -> None:
    page.goto(f"{base}/studio/")
    page.get_by_label("username").fill(USER)
    page.get_by_label("password").fill(PASSWORD)
    page.get_by_role("button", name="Login").click()
    page.get_by_role("tab", name="Gallery").wait_for(timeout=30_000)


def upload_template(page, path: Path, name: str) -> None:
    page.get_by_role("tab", name="Gallery").click()
    page.locator("#ms-upload input[type=file]").set_input_files(str(path))
    page.locator("#ms-name textarea").fill(name)
    page.locator("#ms-add").click()
    page.locator("#ms-gallery").get_by_text(name).wait_for(timeout=30_000)


def add_sample_scenes(page) -> None:
    """The empty gallery points to the samples button; one click fills the gallery."""
    page.get_by_role("tab", name="Gallery").click()
    page.locator("#ms-details").get_by_text("The gallery is empty").wait_for(timeout=30_000)
    page.locator("#ms-samples").click()
    page.locator("#ms-details").get_by_text("Added 8 sample scenes").wait_for(timeout=60_000)
    for number in (1, 8):
        page.locator("#ms-gallery").get_by_text(f"sample scene {number}:").wait_for(timeout=30_000)


def images_loaded(page, selector: str) -> None:
    """Wait until every image ``selector`` matches is loaded (a new result's take a moment)."""
    page.wait_for_function(
        "(selector) => Array.from(document.querySelectorAll(selector))"
        ".every((image) => image.complete && image.naturalWidth > 0)",
        arg=selector,
        timeout=30_000,
    )


def paint_stroke(page, attempts: int = 3) -> None:
    """A horizontal stroke through the middle of the canvas (the template is centred in it). The
    editor takes strokes only once its canvas has loaded the template, which takes longer on a busy
    machine: the same stroke is drawn again (harmless) until the studio reports a painted area."""
    page.locator("#ms-canvas canvas").first.wait_for()
    box = page.locator("#ms-canvas canvas").first.bounding_box()
    cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    painted = page.locator("#ms-ratio").get_by_text("will be repainted")
    for attempt in range(1, attempts + 1):
        page.mouse.move(cx - 50, cy)
        page.mouse.down()
        for i in range(1, 21):
            page.mouse.move(cx - 50 + i * 5, cy, steps=2)
        page.mouse.up()
        try:
            painted.wait_for(timeout=15_000)
            return
        except PlaywrightTimeout:
            if attempt == attempts:
                raise


def test_paint_a_stroke_submit_and_get_the_edit_back(
    studio_stack, browser_page, tmp_path, redis_client
):
    base, running = studio_stack
    page = browser_page
    template_path = tmp_path / "courtyard.png"
    template = sample_template(W, H, seed=4)
    template.save(template_path)

    sign_in(page, base)
    add_sample_scenes(page)
    upload_template(page, template_path, "courtyard")
    page.reload()  # a fresh page lists the gallery from storage (the login is kept)
    page.get_by_role("tab", name="Gallery").click()
    # select it, then record its cache
    page.locator("#ms-gallery").get_by_text(name := "courtyard").click()
    page.locator("#ms-details").get_by_text(f"{W}x{H}").wait_for(timeout=30_000)
    page.locator("#ms-prepare").click()
    page.wait_for_function(
        "() => /in RAM|on disk|recorded|already prepared/i.test("
        "document.querySelector('#ms-cache textarea').value)",
        timeout=120_000,
    )
    screenshot(page, tmp_path, "1-gallery")
    page.get_by_role("tab", name="Editor").click()
    # the empty editor says what to do first (not "select the draw tool" or a blank page)
    page.locator("#ms-picked").get_by_text("Pick a template on the left").wait_for()
    page.locator("#ms-pick").get_by_text(name).click()
    page.locator("#ms-canvas canvas").first.wait_for(timeout=30_000)
    page.wait_for_timeout(500)  # the canvas loads the template before the brush is ready
    try:
        paint_stroke(page)
    finally:
        screenshot(page, tmp_path, "2-painted")
    page.locator("#ms-prompt textarea").fill("a red lantern")
    page.locator("#ms-steps input[type=number]").fill("6")
    page.locator("#ms-steps input[type=number]").press("Enter")
    clicked = time.time()
    page.locator("#ms-submit").click()
    try:
        page.locator("#ms-info").get_by_text("Done.").wait_for(timeout=180_000)
        seen = time.time()
    finally:
        screenshot(page, tmp_path, "3-result")
    info = page.locator("#ms-info").inner_text()
    job_id = re.search(r"job ([0-9a-f]{32})", info).group(1)
    assert re.search(r"Seed used: \d+", info) and "6 steps" in info, info
    # the result lands on the first screen, beside the canvas: at least its upper half shows
    shown = page.locator("#ms-compare").bounding_box()
    assert shown["y"] + shown["height"] / 2 < page.viewport_size["height"], shown

    # the studio is its own tenant: an API key does not see its jobs ...
    with MaskServeClient(base, API_KEY) as client, pytest.raises(MaskServeError) as hidden:
        client.get(job_id)
    assert hidden.value.status == 404
    # ... the job state does, owned by the studio
    job = JobStateStore(redis_client).get(job_id)
    result = Image.open(tmp_path / "data" / "blobs" / job["result_ref"]).convert("RGB")
    assert job["status"] == "done" and job["template_id"] and job["owner"] == STUDIO_OWNER, job
    # submitted as an interactive edit; the summary says whether it met its deadline
    assert job["service_class"] == "interactive" and "met_deadline" in job, job
    assert re.search(r"interactive · (on time|[\d.]+ s late)", info), info
    # where the wait between Generate and "Done." goes (a record for reading, not a bound)
    latency = {
        "click_to_job_created_s": job["created_at"] - clicked,
        "job_total_s": job["done_at"] - job["created_at"],
        "job_done_to_shown_s": seen - job["done_at"],
        "click_to_shown_s": seen - clicked,
    }
    (OUTPUT / "latency.json").write_text(json.dumps(latency, indent=2))
    assert result.size == template.size
    # the mask the studio sent: the painted layer's alpha, grayscale, 255 = repaint, at the
    # template's size
    with Image.open(tmp_path / "data" / "blobs" / job["mask_ref"]) as stored:
        painted = np.asarray(stored.convert("L")) > 127
    assert painted.shape == (H, W) and painted[H // 2, W // 2], (
        "the stroke through the centre is not in the mask"
    )
    assert 0.02 < painted.mean() < 0.5 and not painted[:, :8].any() and not painted[:, -8:].any()
    changed = np.any(np.asarray(result).astype(int) != np.asarray(template).astype(int), axis=-1)
    assert not changed[~painted].any(), "pixels outside the stroke differ from the template"
    assert changed[painted].mean() > 0.9, "the result is not edited inside the stroke"

    # the result saved as a template shows in the open Gallery at once
    page.locator("#ms-info").get_by_text("Done.").wait_for()
    page.locator("#ms-save").click()
    page.get_by_role("tab", name="Gallery").click()
    page.locator("#ms-gallery").get_by_text("courtyard (edited)").wait_for(timeout=30_000)
    page.get_by_role("tab", name="Editor").click()

    # the history lists the job; selecting it recalls its mask and parameters into the editor
    page.locator("#ms-prompt textarea").fill("something else")
    page.get_by_role("tab", name="History").click()
    page.locator("#ms-history").get_by_text(job_id).first.wait_for(state="attached", timeout=30_000)
    history = page.locator("#ms-history").inner_text()
    assert "a red lantern" in history and "done" in history
    screenshot(page, tmp_path, "4-history")
    page.locator("#ms-history [data-testid=cell-0-2]").click()  # the newest job's prompt cell
    page.locator("#ms-canvas canvas").first.wait_for(timeout=30_000)
    page.wait_for_function(
        "() => document.querySelector('#ms-prompt textarea').value === 'a red lantern'",
        timeout=30_000,
    )
    assert page.locator("#ms-steps input[type=number]").input_value() == "6"
    assert re.search(r"recalled from job", page.locator("#ms-picked").inner_text())
    share = f"{painted.mean():.1%}"
    page.locator("#ms-ratio").get_by_text(share).wait_for(timeout=30_000)

    # ... and Generate runs it again, as two variations in one batch, with the recalled mask
    page.locator("#ms-variations input[type=number]").fill("2")
    page.locator("#ms-variations input[type=number]").press("Enter")
    page.locator("#ms-steps input[type=number]").fill("24")  # long enough to watch previews
    page.locator("#ms-steps input[type=number]").press("Enter")
    page.locator("#ms-submit").click()
    # live previews come with the progress while the variations denoise
    page.locator("#ms-status img.ms-preview").first.wait_for(state="attached", timeout=120_000)
    screenshot(page, tmp_path, "5-denoising")
    page.locator("#ms-info").get_by_text("Done.").wait_for(timeout=180_000)
    page.locator("#ms-variants img").nth(1).wait_for(timeout=30_000)
    images_loaded(page, "#ms-compare img, #ms-variants img")
    screenshot(page, tmp_path, "6-variations")
    again = JobStateStore(redis_client)
    jobs = (again.get(other) for other in _job_ids(redis_client) if other != job_id)
    newest = [other for other in jobs if other["kind"] == "edit"]
    assert len({j["seed"] for j in newest}) == 2 and all(j["status"] == "done" for j in newest)
    # submitted in one request, as one batch (the dispatcher routes its items together); when
    # each waited, ran and ended, and its last forecast: a record for reading, not a bound
    (batch_id,) = {j.get("batch_id") for j in newest}
    assert batch_id, newest
    fields = "waiting_at running_at done_at queue_position predicted_finish timings".split()
    timeline = {j["job_id"]: {name: j.get(name) for name in fields} for j in newest}
    (OUTPUT / "variations.json").write_text(json.dumps(timeline, indent=2))
    for recalled in newest:
        with Image.open(tmp_path / "data" / "blobs" / recalled["mask_ref"]) as stored:
            assert np.array_equal(np.asarray(stored.convert("L")) > 127, painted)

    generate_with_an_adapter(page, tmp_path, redis_client)

    # a mask image dropped on the studio becomes the painted area
    mask_path = tmp_path / "mask.png"
    uploaded = Image.new("L", (W, H), 0)
    uploaded.paste(255, (0, 0, W // 4, H // 2))  # 12.5% of the image
    uploaded.save(mask_path)
    page.locator("#ms-mask-upload input[type=file]").set_input_files(str(mask_path))
    page.locator("#ms-ratio").get_by_text("12.5%").wait_for(timeout=30_000)

    # the editor's own "Clear canvas" leaves the template on the canvas, unpainted (clicked once
    # the editor has drawn the uploaded mask: on a busy machine it is still redrawing when the
    # ratio line already says 12.5%, and a click then may not reach the button)
    assert _canvas_settles(page), "the canvas kept changing after the mask upload"
    page.locator("#ms-canvas").get_by_role("button", name="Clear canvas").click()
    page.locator("#ms-ratio").get_by_text("nothing painted").wait_for(timeout=30_000)
    try:
        assert _canvas_shows_a_picture(page), "the canvas is blank after Clear canvas"
    finally:
        screenshot(page, tmp_path, "7-cleared")


def generate_with_an_adapter(page, tmp_path, redis_client) -> None:
    """Register an adapter in the Adapters tab, choose it in the editor's picker at scale 0.5 and
    Generate again (the recalled mask is still painted): the job runs with it, and the result and
    the history say the step it joined at."""
    path = make_adapter_file("tiny-sd2-inpaint", tmp_path / "pixel-art.safetensors", seed=1)
    page.get_by_role("tab", name="Adapters").click()
    page.locator("#ms-adapter-file input[type=file]").set_input_files(str(path))
    page.locator("#ms-adapter-file").get_by_text(path.name).wait_for(timeout=30_000)
    page.locator("#ms-adapter-add").click()
    page.locator("#ms-adapters").get_by_text("pixel-art").first.wait_for(
        state="attached", timeout=90_000
    )
    page.get_by_role("tab", name="Editor").click()
    page.locator("#ms-adapter-picker").get_by_text("Adapters (LoRA)").click()
    page.locator("#ms-adapter-hint").get_by_text("1 adapter for").wait_for(timeout=30_000)
    page.locator("#ms-adapter-0 input").click()
    page.get_by_role("option", name=re.compile("pixel-art · rank 4")).click()
    page.locator("#ms-adapter-scale-0 input[type=number]").fill("0.5")
    page.locator("#ms-adapter-scale-0 input[type=number]").press("Enter")
    for field, value in (("#ms-variations", "1"), ("#ms-steps", "6")):
        page.locator(f"{field} input[type=number]").fill(value)
        page.locator(f"{field} input[type=number]").press("Enter")
    screenshot(page, tmp_path, "8-adapter-picked")
    page.locator("#ms-submit").click()
    try:
        shown = page.locator("#ms-info").get_by_text(re.compile(r"pixel-art ×0\.5 from step \d"))
        shown.wait_for(timeout=180_000)
    finally:
        screenshot(page, tmp_path, "9-adapter-result")
    job_id = re.search(r"job ([0-9a-f]{32})", page.locator("#ms-info").inner_text()).group(1)
    job = JobStateStore(redis_client).get(job_id)
    ((adapter_id, joined),) = job["adapter_steps"].items()
    assert job["status"] == "done" and job["adapters"] == [{"id": adapter_id, "scale": 0.5}], job
    assert 0 <= joined <= 1, job  # by 20% of its 6 steps at the latest
    page.get_by_role("tab", name="History").click()
    page.locator("#ms-history").get_by_text(f"pixel-art ×0.5 from step {joined}").first.wait_for(
        state="attached", timeout=30_000
    )
    page.get_by_role("tab", name="Editor").click()


def _canvas_shows_a_picture(page, timeout_s: float = 60.0) -> bool:
    """Whether the editor's canvas shows an image (not a blank page) within ``timeout_s``: the
    template is loaded again asynchronously, later on a busy machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        shot = Image.open(io.BytesIO(page.locator("#ms-canvas canvas").first.screenshot()))
        if np.asarray(shot.convert("RGB")).std() > 20:
            return True
        if time.monotonic() > deadline:
            return False
        page.wait_for_timeout(500)


def _canvas_settles(page, timeout_s: float = 30.0) -> bool:
    """Whether two screenshots of the editor's canvas 300 ms apart come out the same within
    ``timeout_s``: the editor has finished drawing what it was given."""
    deadline = time.monotonic() + timeout_s
    before = page.locator("#ms-canvas canvas").first.screenshot()
    while time.monotonic() < deadline:
        page.wait_for_timeout(300)
        now = page.locator("#ms-canvas canvas").first.screenshot()
        if now == before:
            return True
        before = now
    return False


def _job_ids(redis_client) -> list[str]:
    """Every job id with a record in Redis."""
    record = re.compile(rf"^{re.escape(job_key(''))}([0-9a-f]{{32}})$")
    keys = (key.decode() for key in redis_client.scan_iter(f"{job_key('')}*"))
    return [match.group(1) for key in keys if (match := record.match(key))]


# ----- the studio over the API app alone (no worker: edits are recorded done by the test) --------
# Gradio's ImageEditor publishes its canvas object as window.editor; get_blobs() renders each of
# its layers at the image's size, as PNGs: the picture (background), each painted layer and what
# the painter sees of them together (composite), the images Generate sends
EDITOR_LAYERS = """async () => {
  const blobs = await window.editor.get_blobs();
  const read = (blob) => blob && new Promise((done) => {
    const reader = new FileReader();
    reader.onload = () => done(reader.result);
    reader.readAsDataURL(blob);
  });
  return {background: await read(blobs.background), composite: await read(blobs.composite),
          layers: await Promise.all(blobs.layers.map(read))};
}"""

# each History header's text -> the lines it is laid out on (distinct tops of its line boxes)
HEADER_LINES = """() => Object.fromEntries(
  Array.from(document.querySelectorAll('#ms-history thead th .text')).map((text) => {
    const range = document.createRange();
    range.selectNodeContents(text);
    const tops = new Set(Array.from(range.getClientRects()).map((box) => Math.round(box.top)));
    return [text.innerText.trim(), tops.size];
  }))"""


def test_the_studio_loads_without_a_missing_file_or_a_console_error(
    studio_app, browser_page, tmp_path
):
    """A browser asks the site's root for its icon on every page: it is there (the studio's), and
    signing in and opening every tab logs no error in the browser's console."""
    base, _actions = studio_app
    page = browser_page
    missing, errors = [], []
    page.on("response", lambda r: r.status >= 400 and missing.append(f"{r.status} {r.url}"))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    sign_in(page, base)
    for tab, shown in (
        ("Editor", "#ms-canvas"),
        ("Gallery", "#ms-gallery"),
        ("History", "#ms-history"),
        ("Batches", "#ms-batches"),
        ("Adapters", "#ms-adapters"),
    ):
        page.get_by_role("tab", name=tab).click()
        page.locator(shown).wait_for(timeout=30_000)
        screenshot(page, tmp_path, f"tab-{tab.lower()}")
    # the browser's own request for the icon is not a page request: asked the same way here
    icon = page.request.get(f"{base}/favicon.ico")
    assert icon.ok and icon.headers["content-type"].startswith("image/"), icon
    assert not missing and not errors, (missing, errors)


def test_a_recalled_or_dropped_mask_is_drawn_once_where_it_belongs(
    studio_app, browser_page, tmp_path
):
    """Recalling a job from the History, then dropping a mask file on the editor: the canvas shows
    the template with the mask painted once, as its one layer, exactly where the mask is (never a
    second copy in the picture under it, nor one shifted by the canvas's size), and Generate sends
    that very mask."""
    base, actions = studio_app
    page = browser_page
    template, job = _edited_template(actions, tmp_path, (20, 10, 60, 50))
    sign_in(page, base)
    page.get_by_role("tab", name="History").click()
    page.locator("#ms-history").get_by_text(job.job_id).first.wait_for(
        state="attached", timeout=30_000
    )
    page.locator("#ms-history [data-testid=cell-0-2]").click()
    page.locator("#ms-picked").get_by_text(f"recalled from job {job.job_id[:8]}").wait_for()
    try:
        _assert_drawn_once(page, template, _box_mask((20, 10, 60, 50)))
    finally:
        screenshot(page, tmp_path, "mask-recalled")

    dropped, dropped_box = Image.new("L", (W, H), 0), (0, 0, W // 4, H // 2)
    dropped.paste(255, dropped_box)
    dropped.save(mask_path := tmp_path / "mask.png")
    page.locator("#ms-mask-upload input[type=file]").set_input_files(str(mask_path))
    page.locator("#ms-ratio").get_by_text("12.5%").wait_for(timeout=30_000)
    try:
        _assert_drawn_once(page, template, _box_mask(dropped_box))
    finally:
        screenshot(page, tmp_path, "mask-dropped")
    page.locator("#ms-prompt textarea").fill("a red lantern")
    page.locator("#ms-submit").click()
    page.locator("#ms-status").get_by_text("Queued").wait_for(timeout=30_000)
    sent = actions.history(USER)[0]
    with Image.open(io.BytesIO(actions.service.blobs.get(sent["mask_ref"]))) as stored:
        assert np.array_equal(np.asarray(stored.convert("L")) > 127, _box_mask(dropped_box))


def test_keep_editing_puts_the_result_on_the_canvas_ready_to_paint_and_generate(
    studio_app, browser_page, tmp_path
):
    """After an edit the painter has painted for, Keep editing shows the result on the canvas at
    once (no "processing" cover), says it is job X's result, and takes a stroke and a Generate
    that edits the result, not the original."""
    base, actions = studio_app
    page = browser_page
    sample_template(W, H, seed=4).save(path := tmp_path / "courtyard.png")
    (record,), _ = actions.upload([path])
    sign_in(page, base)
    page.get_by_role("tab", name="Editor").click()
    page.locator("#ms-pick").get_by_text("courtyard").click()
    paint_stroke(page)
    page.locator("#ms-prompt textarea").fill("a red lantern")
    result = sample_template(W, H, seed=11)
    job_id = _generate_and_finish(page, actions, result)
    page.locator("#ms-keep-editing").click()
    page.locator("#ms-picked").get_by_text(f"Result of job {job_id[:8]}").wait_for()
    try:
        # Gradio's progress cover over the canvas is hidden by its "hide" class (opacity 0)
        cover = page.locator("#ms-canvas [data-testid=status-tracker]")
        assert "hide" in cover.get_attribute("class").split(), cover.inner_text()
        assert _canvas_shows_a_picture(page, timeout_s=30), "the canvas is blank"
        shown = editor_layers(page)["background"][..., :3]
        assert np.abs(shown - np.asarray(result).astype(int)).max() <= 2, "not the result"
    finally:
        screenshot(page, tmp_path, "kept-editing")
    paint_stroke(page)
    again = _generate_and_finish(page, actions, sample_template(W, H, seed=12))
    edited = actions.job(again)
    assert edited["template_id"] not in ("", record.id), edited
    assert actions.template(edited["template_id"]).name == "courtyard (edited)"
    with Image.open(io.BytesIO(actions.service.blobs.get(edited["mask_ref"]))) as stored:
        painted = np.asarray(stored.convert("L")) > 127
    assert painted[H // 2, W // 2] and 0.02 < painted.mean() < 0.5
    screenshot(page, tmp_path, "kept-editing-done")


def test_the_before_after_slider_starts_with_the_whole_result_shown(
    studio_app, browser_page, tmp_path
):
    """A finished edit shows in the before/after slider as the result across its whole width (the
    edit is visible wherever the mask is), the original only where the handle is dragged."""
    base, actions = studio_app
    page = browser_page
    original, job = _edited_template(actions, tmp_path, (4, 4, 40, 40))
    sign_in(page, base)
    page.get_by_role("tab", name="History").click()
    page.locator("#ms-history").get_by_text(job.job_id).first.wait_for(state="attached")
    page.locator("#ms-history [data-testid=cell-0-2]").click()
    page.locator("#ms-picked").get_by_text(f"recalled from job {job.job_id[:8]}").wait_for()
    result = sample_template(W, H, seed=11)
    _generate_and_finish(page, actions, result)
    shown = page.locator("#ms-compare img").first
    shown.wait_for()
    images_loaded(page, "#ms-compare img")
    try:
        seen = np.asarray(Image.open(io.BytesIO(page.screenshot(clip=shown.bounding_box()))))
    finally:
        screenshot(page, tmp_path, "before-after")
    seen = seen[..., :3].astype(int)
    size = (seen.shape[1], seen.shape[0])

    def off_by_column(picture: Image.Image) -> np.ndarray:
        scaled = np.asarray(picture.convert("RGB").resize(size)).astype(int)
        return np.abs(seen - scaled).mean(axis=(0, 2))

    to_result, to_original = off_by_column(result), off_by_column(original)
    for columns in np.array_split(np.arange(size[0]), 2):  # the left half, the right half
        assert to_result[columns].mean() < to_original[columns].mean() / 3, (
            f"columns {columns[0]}-{columns[-1]} show the original, not the result"
        )


def test_history_headers_break_between_words_and_an_erase_shows_no_model_settings(
    studio_app, browser_page, tmp_path
):
    """In a narrow window the History's headers wrap between words only; an erase's row says
    it was an erase and shows no seed, steps or model (it runs none), an edit's row shows its."""
    base, actions = studio_app
    page = browser_page
    sample_template(W, H, seed=4).save(path := tmp_path / "courtyard.png")
    (record,), _ = actions.upload([path])
    painted = stroke((20, 10, 60, 50), (W, H))
    edit = actions.submit(USER, record.id, painted, EditForm(prompt="a red lantern", steps=7))
    # an erase from a form that still holds the last prompt
    erase = actions.submit(USER, record.id, painted, EditForm(prompt="a red lantern", mode="erase"))
    page.set_viewport_size({"width": 1000, "height": 900})  # the columns squeeze
    sign_in(page, base)
    page.get_by_role("tab", name="History").click()
    page.locator("#ms-history").get_by_text(erase.job_id).first.wait_for(state="attached")
    try:
        lines = page.evaluate(HEADER_LINES)
    finally:
        screenshot(page, tmp_path, "history")
    assert set(lines) == set(HISTORY_HEADERS), lines
    split = {header: n for header, n in lines.items() if n > len(header.split())}
    assert not split, f"headers broken inside a word (header: lines): {split}"

    def row(index: int) -> list[str]:  # the prompt, seed, steps and model cells
        cells = (f"#ms-history [data-testid=cell-{index}-{column}]" for column in range(2, 6))
        return [page.locator(cell).inner_text().strip() for cell in cells]

    assert row(0) == ["(erase: filled from the surroundings)", "—", "—", "—"]
    model = actions.job(edit.job_id)["model_id"]
    assert row(1) == ["a red lantern", str(edit.seed), "7", model]


def test_the_batches_tab_lists_batches_when_opened_and_after_a_submit_with_random_seeds(
    studio_app, browser_page, tmp_path
):
    """Opening Batches lists the user's batches, no Refresh needed; the seed box is empty (random
    seeds); a submitted batch is listed at once, its items with seeds of their own."""
    base, actions = studio_app
    page = browser_page
    batches = StudioBatches(actions)
    sample_template(W, H, seed=4).save(path := tmp_path / "courtyard.png")
    (record,), _ = actions.upload([path])
    masks = [tmp_path / f"mask-{index}.png" for index in range(2)]
    for index, mask_path in enumerate(masks):
        mask = Image.new("L", (W, H), 0)
        mask.paste(255, (40 * index, 10, 40 * index + 30, 50))
        mask.save(mask_path)
    earlier = batches.submit(USER, BatchForm(record.id, tuple(masks), prompt="a star"))
    sign_in(page, base)
    page.get_by_role("tab", name="Batches").click()
    page.locator("#ms-batches").get_by_text(earlier.batch_id).first.wait_for(state="attached")
    assert page.locator("#ms-batch-seed textarea").input_value() == ""
    screenshot(page, tmp_path, "batches")
    page.locator("#ms-batch-template input").click()
    page.get_by_role("option", name="courtyard").click()
    page.locator("#ms-batch-masks input[type=file]").set_input_files([str(m) for m in masks])
    page.locator("#ms-batch-masks").get_by_text("mask-1").wait_for(timeout=60_000)
    page.locator("#ms-batch-prompt textarea").fill("a moon")
    page.locator("#ms-batch-submit").click()
    page.locator("#ms-batch-summary").get_by_text("Batch").wait_for(timeout=30_000)
    submitted = batches.list(USER)[0]
    try:
        assert submitted["batch_id"] != earlier.batch_id
        listed = page.locator("#ms-batches").get_by_text(submitted["batch_id"]).first
        listed.wait_for(state="attached")
        seeds = [item["seed"] for item in submitted["items"]]
        assert len(seeds) == 2 and seeds != [0, 1], seeds
    finally:
        screenshot(page, tmp_path, "batches-submitted")
        batches.cancel(submitted["batch_id"])  # ends the page's following of it


def _generate_and_finish(page, actions: StudioActions, result: Image.Image) -> str:
    """Generate (the form as it is), record the queued edit done with ``result`` the way
    post-processing does, wait until the page says so; the job's id."""
    page.locator("#ms-submit").click()
    page.locator("#ms-status").get_by_text("Queued").wait_for(timeout=30_000)
    job_id = actions.history(USER)[0]["job_id"]
    finish(actions.service, job_id, result)
    page.locator("#ms-info").get_by_text(f"job {job_id}").wait_for(timeout=30_000)
    return job_id


def _box_mask(box: tuple[int, int, int, int]) -> np.ndarray:
    mask = np.zeros((H, W), dtype=bool)
    x0, y0, x1, y1 = box
    mask[y0:y1, x0:x1] = True
    return mask


def _bbox(mask: np.ndarray) -> tuple[int, ...] | None:
    ys, xs = np.nonzero(mask)
    return (
        tuple(int(v) for v in (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)) if len(xs) else None
    )


def editor_layers(page) -> dict:
    """What the editor's canvas shows now, as RGBA arrays: "background", "composite", "layers"."""
    shown = page.evaluate(EDITOR_LAYERS)

    def pixels(url: str) -> np.ndarray:
        with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as image:
            return np.asarray(image.convert("RGBA")).astype(int)

    return {
        "background": pixels(shown["background"]),
        "composite": pixels(shown["composite"]),
        "layers": [pixels(url) for url in shown["layers"] if url],
    }


def _painted(shown: dict) -> np.ndarray:
    painted = np.zeros(shown["background"].shape[:2], dtype=bool)
    for layer in shown["layers"]:
        painted |= layer[..., 3] > 0
    return painted


def _assert_drawn_once(page, template: Image.Image, mask: np.ndarray, timeout_s=60.0) -> None:
    """The editor's canvas shows one layer painted exactly over ``mask`` and the template under
    it. The editor loads a new value asynchronously (later on a busy machine): its layers are read
    again until they hold ``mask`` or ``timeout_s`` has passed, then checked."""
    deadline = time.monotonic() + timeout_s
    shown = editor_layers(page)
    while not np.array_equal(_painted(shown), mask) and time.monotonic() < deadline:
        page.wait_for_timeout(300)
        shown = editor_layers(page)
    painted = _painted(shown)
    assert np.array_equal(painted, mask), (
        f"the painted layer covers {painted.sum()} px in {_bbox(painted)}, "
        f"the mask {mask.sum()} px in {_bbox(mask)}"
    )
    picture = np.asarray(template.convert("RGB")).astype(int)
    off = np.abs(shown["background"][..., :3] - picture).max(axis=-1) > 2
    assert not off.any(), f"the picture under the layer differs from the template in {_bbox(off)}"
    seen = shown["composite"][..., :3]
    assert (np.abs(seen[mask] - LAYER_RGB) <= 2).all(), "the mask is not painted where it is"
    assert (np.abs(seen[~mask] - picture[~mask]) <= 2).all(), "paint shows outside the mask"


def _edited_template(actions, tmp_path, box):
    """A sample template uploaded to the gallery and an edit of it submitted over ``box``."""
    template = sample_template(W, H, seed=4)
    template.save(path := tmp_path / "courtyard.png")
    (record,), _ = actions.upload([path])
    return template, actions.submit(USER, record.id, stroke(box, (W, H)), EditForm(prompt="a"))
