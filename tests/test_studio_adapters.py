"""The studio's LoRA adapters over the real service layer (a real Redis, the real JobService,
TemplateStore and AdapterStore, a Celery app that only writes to the broker): the picker lists the
studio's adapters of the selected model, Generate passes the chosen ones with their scales, the
service's refusals reach the user as warnings (never raised), the Adapters tab registers through
the REST upload's own path (a CPU-worker thread ingests; without one the 503's message) and
deletes, and the job and history views say which adapters ran and the step each joined at."""

from __future__ import annotations

import time
import uuid

import gradio as gr
import pytest

from backend.adapters.ingest import ingest
from backend.adapters.store import AdapterFacts, AdapterRecord
from backend.api.adapter_requests import AdapterChoice
from backend.api.app import create_app
from backend.api.middleware import human_bytes
from backend.api.security import STUDIO_OWNER
from backend.imaging.uploads import encode_image
from backend.protocol import AdapterUse, JobEvent
from backend.protocol.adapters import IngestAdapter
from studio.actions import EditForm, StudioActions, StudioError
from studio.app import StudioPage
from studio.components import FORM_FIELDS, HISTORY_HEADERS
from templates_store.samples import sample_template
from tests.adapter_factory import make_adapter_file
from tests.api_factory import make_settings, pre_queue_jobs
from tests.test_adapters_api import CpuWorkerThread
from tests.test_studio_actions import H, W, stroke, upload_file

pytestmark = [pytest.mark.model, pytest.mark.redis]
MODEL, FLUX = "tiny-sd2-inpaint", "tiny-flux-fill"
USER = "local"  # the user the page's handlers see without a Gradio request


def studio_settings(redis_url, tmp_path, ingest_timeout_s: float = 20.0):
    settings = make_settings(redis_url, tmp_path, models=(MODEL, FLUX))
    return settings.model_copy(
        update={
            "engine": settings.engine.model_copy(update={"model_id": MODEL}),
            "adapters": settings.adapters.model_copy(
                update={"ingest_timeout_s": ingest_timeout_s, "max_rank": 8}
            ),
        }
    )


def studio_actions(app) -> StudioActions:
    """The studio's actions as ``studio.mount`` builds them (the REST upload path included)."""
    return StudioActions(
        app.state.service,
        app.state.templates,
        STUDIO_OWNER,
        adapter_uploads=app.state.adapter_service,
    )


@pytest.fixture
def settings(redis_url, tmp_path):
    return studio_settings(redis_url, tmp_path)


@pytest.fixture
def app(settings, redis_client):
    return create_app(settings, redis_client=redis_client)


@pytest.fixture
def actions(app) -> StudioActions:
    return studio_actions(app)


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    """The warning toasts the page shows (their messages)."""
    shown: list[str] = []
    monkeypatch.setattr(gr, "Warning", lambda message, *args, **kwargs: shown.append(message))
    return shown


def registered(app, model: str, name: str, owner: str = STUDIO_OWNER, seed: int = 0):
    """An adapter in the registry as the upload path leaves it (read and normalized by the CPU
    worker's ``ingest``, stored by the API), without a worker."""
    blobs = app.state.service.blobs
    request_id = uuid.uuid4().hex
    with blobs.writing("uploads", f"{request_id}.safetensors") as (upload_ref, staged):
        make_adapter_file(model, staged, seed=seed)
    normalized_ref = blobs.ref("uploads", f"{request_id}.normalized.safetensors")
    reply = ingest(
        IngestAdapter(request_id, upload_ref, normalized_ref, model, 8, time.time() + 60), blobs
    )
    assert reply is not None and reply.ok, reply
    facts = AdapterFacts(reply.family, model, reply.source_layout, reply.ranks, reply.nbytes)
    with blobs.reading(normalized_ref) as normalized:
        return app.state.adapters.add(normalized, facts, name, owner)


def form_values(form: EditForm) -> list:
    """The editor's field values (``FORM_FIELDS``' order) that make ``form``."""
    values = {
        "prompt": form.prompt,
        "negative": form.negative_prompt,
        "model": form.model,
        "steps": form.steps,
        "guidance": 7.5 if form.guidance is None else form.guidance,
        "strength": form.strength,
        "random_seed": form.seed is None,
        "seed": form.seed,
        "invert": form.invert,
        "grow": form.grow_px,
        "feather": form.feather_px,
        "use_cache": form.use_cache,
        "fill_holes": form.fill_holes,
        "min_area": form.min_area_px,
        "masked_only": form.inpaint_area == "masked",
        "crop_padding": form.crop_padding_px,
        "priority": form.priority,
        "deadline": form.deadline_s or 0,
    }
    return [values[name] for name in FORM_FIELDS]


def generate(page: StudioPage, template_id: str, picks: list, mode: str = "generate") -> tuple:
    """The first update the page's Generate yields for a 2-step edit with the picker at ``picks``
    (slots, then scales): the job id first once it is queued."""
    form = EditForm(prompt="pixel art", model=MODEL, steps=2, seed=5)
    return next(page._submit(None, template_id, stroke(), 1, mode, *form_values(form), *picks))


# ----- the picker ---------------------------------------------------------------------------------
def test_the_picker_lists_only_the_studios_adapters_of_the_selected_model(app, actions):
    mine = registered(app, MODEL, "pixel art", seed=1)
    flux = registered(app, FLUX, "flux style", seed=2)
    registered(app, MODEL, "an api key's", owner="key:someone", seed=3)
    ((label, adapter_id),) = actions.adapters.choices(MODEL)
    assert adapter_id == mine.adapter_id
    assert label == f"pixel art · rank 4 · {human_bytes(mine.nbytes)}"
    assert [value for _, value in actions.adapters.choices(FLUX)] == [flux.adapter_id]
    assert actions.adapters.choices("") == []
    rows, ids = actions.adapters.rows()
    assert ids == [flux.adapter_id, mine.adapter_id]  # newest first, every model, the studio's
    assert [row[:4] for row in rows] == [
        ["flux style", FLUX, "flux-fill", 4],
        ["pixel art", MODEL, "sd2-inpaint", 4],
    ]
    # choosing a model lists its adapters in every slot; a slot keeps its adapter while listed
    page = StudioPage(actions)
    *slots, hint = page._adapter_options(MODEL, mine.adapter_id, "", "")
    assert [slot["value"] for slot in slots] == [mine.adapter_id, "", ""]
    assert slots[0]["choices"] == [("none", ""), (label, mine.adapter_id)]
    assert "1 adapter for `tiny-sd2-inpaint`" in hint and "-2 to 2" in hint
    *slots, hint = page._adapter_options(FLUX, mine.adapter_id, "", "")
    assert [slot["value"] for slot in slots] == ["", "", ""]
    assert slots[0]["choices"][1][1] == flux.adapter_id
    *_, hint = page._adapter_options("demo-sd2-inpaint", "", "", "")
    assert "No adapters for `demo-sd2-inpaint`" in hint and "Adapters" in hint


# ----- Generate -----------------------------------------------------------------------------------
def test_generate_passes_the_chosen_adapters_and_the_views_show_them(
    app, actions, tmp_path, settings, redis_client
):
    one = registered(app, MODEL, "pixel art", seed=1)
    two = registered(app, MODEL, "ink", seed=2)
    (record,), _ = actions.upload([upload_file(tmp_path)])
    page = StudioPage(actions)
    # slot 1 empty: the others are passed in slot order with their scales
    picks = [one.adapter_id, "", two.adapter_id, 0.8, 1.0, -1.5]
    assert page._picked_adapters(picks) == (
        AdapterChoice(one.adapter_id, 0.8),
        AdapterChoice(two.adapter_id, -1.5),
    )
    job_id = generate(page, record.id, picks)[0]
    (queued,) = pre_queue_jobs(redis_client, settings)
    assert queued.adapters == [
        AdapterUse(one.adapter_id, one.sha256, 0.8, one.nbytes),
        AdapterUse(two.adapter_id, two.sha256, -1.5, two.nbytes),
    ]
    job = actions.job(job_id)
    assert job["adapters"] == [
        {"id": one.adapter_id, "scale": 0.8},
        {"id": two.adapter_id, "scale": -1.5},
    ]
    assert actions.adapters.describe(job) == "pixel art ×0.8, ink ×-1.5"
    # once denoised the record says the step each joined at: the result and the history show it
    finish_with_steps(actions, job_id, {one.adapter_id: 0, two.adapter_id: 1})
    described = "pixel art ×0.8 from step 0, ink ×-1.5 from step 1"
    assert actions.adapters.describe(actions.job(job_id)) == described
    info = page._shown(job_id)[1]
    assert f"adapters: {described}" in info
    rows, _thumbs, _jobs = page._history_rows(None)
    assert rows[0][HISTORY_HEADERS.index("adapters")] == described
    # a deleted adapter is still named (by its id) in the job's views
    actions.adapters.delete(two.adapter_id)
    assert f"{two.adapter_id[:8]} (deleted) ×-1.5 from step 1" in page._shown(job_id)[1]


def finish_with_steps(actions, job_id: str, adapter_steps: dict[str, int]) -> None:
    """Post-processing's part (``test_studio_actions.finish``), its done event saying the step
    each adapter joined at."""
    service = actions.service
    ref = service.blobs.put_content("results", encode_image(sample_template(W, H), "png"), ".png")
    service.jobstate.record_event(
        JobEvent(
            job_id=job_id,
            status="done",
            at=time.time(),
            result_ref=ref,
            timings={"total_s": 1.5},
            adapter_steps=adapter_steps,
        )
    )


def test_no_adapter_chosen_is_the_base_model_and_an_erase_drops_them(
    app, actions, tmp_path, settings, redis_client
):
    one = registered(app, MODEL, "pixel art", seed=1)
    (record,), _ = actions.upload([upload_file(tmp_path)])
    page = StudioPage(actions)
    generate(page, record.id, ["", "", "", 1.0, 1.0, 1.0])
    generate(page, record.id, [one.adapter_id, "", "", 1.0, 1.0, 1.0], mode="erase")
    assert [job.adapters for job in pre_queue_jobs(redis_client, settings)] == [[], []]


def test_bad_adapter_choices_are_shown_as_warnings_with_what_to_fix_never_raised(
    app, actions, tmp_path, settings, redis_client, warnings
):
    sd2 = registered(app, MODEL, "pixel art", seed=1)
    flux = registered(app, FLUX, "flux style", seed=2)
    other = registered(app, MODEL, "not the studio's", owner="key:someone", seed=3)
    gone = registered(app, MODEL, "gone", seed=4)
    actions.adapters.delete(gone.adapter_id)
    (record,), _ = actions.upload([upload_file(tmp_path)])
    page = StudioPage(actions)
    values = form_values(EditForm(prompt="p", model=MODEL, steps=2))
    a = sd2.adapter_id
    cases = [
        ([a, a, "", 1.0, 0.5, 1.0], "named more than once"),
        ([a, "", "", 2.5, 1.0, 1.0], "use a value in [-2.0, 2.0]"),
        ([a, "", "", -2.05, 1.0, 1.0], "use a value in [-2.0, 2.0]"),
        ([flux.adapter_id, "", "", 1.0, 1.0, 1.0], "was registered for tiny-flux-fill"),
        ([other.adapter_id, "", "", 1.0, 1.0, 1.0], "does not exist"),
        ([gone.adapter_id, "", "", 1.0, 1.0, 1.0], "does not exist"),
    ]
    for picks, message in cases:
        warnings.clear()
        submitted = page._submit(None, record.id, stroke(), 1, "generate", *values, *picks)
        # one update that leaves the page as it was, and the service's message as a warning
        (update,) = list(submitted)
        assert all(u == gr.skip() for u in update), picks
        assert len(warnings) == 1 and message in warnings[0], (picks, warnings)
    # more than the deployment's limit (a client past the page's slots): refused the same way
    four = tuple(
        AdapterChoice(registered(app, MODEL, f"a{i}", seed=10 + i).adapter_id) for i in range(4)
    )
    with pytest.raises(StudioError, match="a request may use at most 3"):
        actions.submit(USER, record.id, stroke(), EditForm(prompt="p", model=MODEL, adapters=four))
    assert pre_queue_jobs(redis_client, settings) == []


def test_a_recalled_job_brings_its_adapters_back_into_the_picker(app, actions, tmp_path, warnings):
    one = registered(app, MODEL, "pixel art", seed=1)
    two = registered(app, MODEL, "ink", seed=2)
    (record,), _ = actions.upload([upload_file(tmp_path)])
    adapters = (AdapterChoice(one.adapter_id, 0.7), AdapterChoice(two.adapter_id, 1.25))
    form = EditForm(prompt="p", model=MODEL, steps=2, adapters=adapters)
    actions.submit(USER, record.id, stroke(), form)
    (job,) = actions.history(USER)
    assert actions.adapters.recalled(job) == (
        [one.adapter_id, two.adapter_id, ""],
        [0.7, 1.25, 1.0],
        [],
    )
    actions.adapters.delete(one.adapter_id)
    ids, scales, gone = actions.adapters.recalled(job)
    assert (ids, scales) == ([two.adapter_id, "", ""], [1.25, 1.0, 1.0])
    assert gone == [f"adapter {one.adapter_id[:8]} was deleted: the edit is recalled without it"]
    # the page sets every slot (listing the job model's adapters) and scale
    updates = StudioPage(actions)._recalled_adapters(job)
    assert [u["value"] for u in updates[:3]] == [two.adapter_id, "", ""]
    assert updates[3:] == [1.25, 1.0, 1.0] and len(warnings) == 1


# ----- the Adapters tab ---------------------------------------------------------------------------
def test_registering_goes_through_the_rest_upload_path_and_deleting_removes_it(
    app, actions, settings, redis_client, tmp_path
):
    worker = CpuWorkerThread(settings, redis_client)
    worker.thread.start()
    try:
        path = make_adapter_file(MODEL, tmp_path / "pixel-art.safetensors", seed=1, layout="kohya")
        record = actions.adapters.register(str(path), "", MODEL)
        named = actions.adapters.register(str(path), "  my style ", "")  # "": the default model
        bad = tmp_path / "notes.safetensors"
        bad.write_text("not an adapter")
        with pytest.raises(StudioError, match="safetensors"):
            actions.adapters.register(str(bad), "", MODEL)
        flux_file = make_adapter_file(FLUX, tmp_path / "flux.safetensors", seed=2)
        with pytest.raises(StudioError, match=r"this adapter is for Flux \(flux-fill\)"):
            actions.adapters.register(str(flux_file), "", MODEL)
    finally:
        worker.stop.set()
        worker.thread.join(timeout=5)
    assert isinstance(record, AdapterRecord) and record.owner == STUDIO_OWNER
    assert (record.name, record.model_id, record.source_layout) == ("pixel-art", MODEL, "kohya")
    assert (named.name, named.model_id) == ("my style", MODEL)
    assert [label for label, _ in actions.adapters.choices(MODEL)] == [
        f"my style · rank 4 · {human_bytes(record.nbytes)}",
        f"pixel-art · rank 4 · {human_bytes(record.nbytes)}",
    ]
    assert actions.adapters.delete(record.adapter_id) == "pixel-art"
    assert actions.adapters.rows()[1] == [named.adapter_id]
    with pytest.raises(StudioError, match="does not exist|no adapter with id"):
        actions.adapters.delete(record.adapter_id)
    with pytest.raises(StudioError, match="no adapter selected"):
        actions.adapters.delete("")
    with pytest.raises(StudioError, match="no file chosen"):
        actions.adapters.register(None)


def test_without_a_cpu_worker_the_user_sees_the_503_message(redis_url, tmp_path, redis_client):
    app = create_app(studio_settings(redis_url, tmp_path, 1.0), redis_client=redis_client)
    actions = studio_actions(app)
    path = make_adapter_file(MODEL, tmp_path / "a.safetensors", seed=1)
    with pytest.raises(StudioError, match="no CPU worker answered within 1 s"):
        actions.adapters.register(str(path), "", MODEL)
    assert actions.adapters.listed() == []
    # a studio built without the upload path lists and uses adapters, and says where to register
    bare = StudioActions(app.state.service, app.state.templates, STUDIO_OWNER)
    with pytest.raises(StudioError, match="POST /v1/adapters"):
        bare.adapters.register(str(path))
