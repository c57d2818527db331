"""The studio and service levels (issue 20): how the status line words a job's forecast, lateness
and deadline (pure), admission control's refusal shown as the API's reason and "retry in N s"
(never raised past the page), and, over the real service layer (a real Redis, the real JobService),
that the studio submits interactive edits with the editor's priority and deadline, follows the
worker's forecast and parked/resumed rows, and says on time or how late when done."""

from __future__ import annotations

import time

import gradio as gr
import pytest

from backend.api.admission_control import NewJob, Policy, Row, WorkerLoad, decide
from backend.api.app import create_app
from backend.api.checks import Overloaded
from backend.api.security import STUDIO_OWNER
from backend.protocol import JobEvent
from studio import actions as studio_actions
from studio.actions import EditForm, Progress, StudioActions, StudioError
from studio.app import StudioPage
from studio.components import HISTORY_HEADERS, progress_html
from studio.deadlines import (
    LATE,
    forecast_parts,
    job_outcome,
    outcome,
    relative,
    requested_deadline_s,
    service_line,
)
from studio.errors import busy_message, service_call
from templates_store.samples import sample_template
from tests.api_factory import make_settings, pre_queue_jobs
from tests.test_studio_actions import H, W, finish, stroke, upload_file
from tests.test_studio_adapters import form_values

NOW = 10_000.0
MODEL = "tiny-sd2-inpaint"
USER = "local"  # the user the page's handlers see without a Gradio request
PARKED = "parked at step 8: jobs with tighter deadlines run first"


# ----- wording (pure) -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ahead", "text"),
    [
        (4.2, "in ~4 s"),
        (0.7, "in ~1 s"),
        (99.4, "in ~99 s"),
        (150.0, "in ~2 min"),
        (0.3, "due now"),
        (-3.0, "due now"),
    ],
)
def test_a_forecast_is_shown_relative_to_now(ahead, text):
    assert relative(NOW + ahead, NOW) == text


def test_a_waiting_job_shows_its_position_predicted_start_and_finish_and_late_mark():
    waiting = Progress(
        "j", "waiting", queue_position=2, predicted_start=NOW + 3.2, predicted_finish=NOW + 9
    )
    assert waiting.describe(NOW) == (
        "Waiting for a worker · position 2 in the worker's queue · start in ~3 s · finish in ~9 s"
    )
    late = Progress("j", "queued", predicted_start=NOW + 40, predicted_finish=NOW + 70, late=True)
    assert late.describe(NOW) == f"Queued · start in ~40 s · finish in ~70 s · {LATE}"
    # no forecast yet: the stage alone
    assert Progress("j", "preprocessing").describe(NOW) == "Pre-processing"


def test_a_running_job_shows_its_predicted_finish_and_parked_or_resumed_rows_say_so():
    running = Progress(
        "j", "running", step=3, num_steps=24, predicted_start=NOW - 2, predicted_finish=NOW + 4
    )
    assert running.describe(NOW) == "Denoising · step 3/24 · finish in ~4 s"
    parked = Progress(
        "j", "running", step=8, num_steps=24, message=PARKED, predicted_finish=NOW + 12
    )
    assert parked.describe(NOW) == f"Denoising · step 8/24 · {PARKED} · finish in ~12 s"
    resumed = Progress("j", "running", step=9, num_steps=24, message="resumed at step 8")
    assert resumed.describe(NOW) == "Denoising · step 9/24 · resumed at step 8"
    # denoised: its predicted finish is behind it
    post = Progress("j", "postprocessing", predicted_finish=NOW - 1)
    assert post.describe(NOW) == "Post-processing"
    # a forecast that has passed says nothing until the next one comes
    assert forecast_parts("waiting", NOW - 1, NOW + 0.2, False, NOW) == []
    assert forecast_parts("running", 0.0, NOW + 0.6, False, NOW) == ["finish in ~1 s"]


def test_a_done_job_says_on_time_or_how_late():
    deadline = NOW + 30
    on_time = Progress("j", "done", deadline=deadline, met_deadline=True, done_at=NOW + 5)
    assert on_time.describe(NOW) == "Done · on time"
    late = Progress(
        "j", "done", deadline=deadline, met_deadline=False, done_at=deadline + 2.44, late=True
    )
    assert late.describe(NOW) == "Done · 2.4 s late"
    assert outcome(False, deadline, deadline + 75.2) == "75 s late"
    assert outcome(None, deadline, NOW) == "" and outcome(False) == "late"
    # a done job's own message (a preparation's "already prepared") is not the status line's
    assert Progress("j", "done", message="already prepared").describe(NOW) == "Done"
    failed = Progress("j", "failed", message="could not start: boom", late=True)
    assert failed.describe(NOW) == "Failed · could not start: boom"


def test_a_jobs_service_level_in_its_summary_and_the_history():
    done = {
        "status": "done",
        "service_class": "interactive",
        "deadline": NOW + 30,
        "met_deadline": False,
        "done_at": NOW + 33,
        "priority": 5,
    }
    assert service_line(done) == "interactive · priority 5 · 3 s late"
    assert service_line(done | {"met_deadline": True, "priority": 0}) == "interactive · on time"
    assert job_outcome({"status": "running", "late": True}) == "late"
    assert job_outcome({"status": "cancelled", "late": True}) == ""
    # a recalled deadline: the one asked for, none when it was the class's target
    asked = {"created_at": NOW, "deadline": NOW + 12.04}
    assert requested_deadline_s(asked, 30.0) == 12.0
    assert requested_deadline_s({"created_at": NOW, "deadline": NOW + 30.02}, 30.0) == 0
    assert requested_deadline_s({"created_at": NOW}, 30.0) == 0


# ----- admission control's refusal --------------------------------------------------------------
def refusal(reason: str) -> Overloaded:
    """Admission control's own refusal of an interactive job configured to shed, the way the API's
    gate raises it."""
    policy = Policy(2.0, 100 if reason == "deadline" else 3, ("interactive", "batch"), "slack")
    rows = tuple(Row(10, NOW + 5, running=index < 2) for index in range(8))
    workers = [WorkerLoad("w1", 2, 1.0, rows)]
    verdict = decide(NewJob("interactive", NOW + 10, 0, 30), NOW, workers, [], 3, policy)
    assert not verdict.accept and verdict.reason == reason, verdict
    detail = {"reason": verdict.reason, "retry_after_s": verdict.retry_after_s}
    return Overloaded(verdict.message, verdict.retry_after_s, detail)


def test_a_refusal_shows_the_apis_reason_and_when_to_retry_in_the_editors_words():
    deadline = refusal("deadline")
    text = busy_message(deadline)
    assert text.startswith("The service is too busy to take this edit now: it is predicted to")
    assert f"Retry in {deadline.retry_after_s} s." in text and deadline.retry_after_s > 0
    # the API's field names become the editor's
    assert "set Deadline (s) under More settings to at least" in text and "deadline_s" not in text
    queue = refusal("queue")
    assert busy_message(queue) == (
        "The service is too busy to take this edit now: 3 jobs are accepted and not running yet, "
        f"the bound is 3. Retry in {queue.retry_after_s} s."
    )

    def refused():
        raise deadline

    with pytest.raises(StudioError) as raised:
        service_call(refused)
    assert raised.value.retry_after_s == deadline.retry_after_s and str(raised.value) == text


# ----- over the real service layer ----------------------------------------------------------------
def studio_settings(redis_url, tmp_path, **deadlines):
    settings = make_settings(redis_url, tmp_path, models=("demo-sd2-inpaint", MODEL))
    return settings.model_copy(
        update={"deadlines": settings.deadlines.model_copy(update=deadlines)}
    )


def make_actions(settings, redis_client) -> StudioActions:
    app = create_app(settings, redis_client=redis_client)
    return StudioActions(app.state.service, app.state.templates, STUDIO_OWNER)


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    shown: list[str] = []
    monkeypatch.setattr(gr, "Warning", lambda message, *args, **kwargs: shown.append(message))
    return shown


def test_studio_edits_are_interactive_with_the_editors_priority_and_deadline(
    redis_url, tmp_path, redis_client
):
    settings = studio_settings(redis_url, tmp_path)
    actions = make_actions(settings, redis_client)
    (record,), _ = actions.upload([upload_file(tmp_path)])
    # the editor's fields as the page submits them: priority 5, a 12 s deadline
    form = StudioPage._form(*form_values(EditForm(prompt="p", model=MODEL, steps=2)))
    assert (form.priority, form.deadline_s) == (0, None)  # the defaults: the class's target
    # the deadline field's 0 (what an emptied number field sends too) is the class's target
    for empty in (0, 0.0, None, ""):
        values = [*form_values(EditForm(prompt="p", steps=2))[:-1], empty]
        assert StudioPage._form(*values).deadline_s is None
    values = form_values(EditForm(prompt="p", model=MODEL, steps=2, priority=5, deadline_s=12.0))
    before = time.time()
    submitted = actions.submit(USER, record.id, stroke(), StudioPage._form(*values))
    (job,) = pre_queue_jobs(redis_client, settings)
    assert job.service.service_class == "interactive" and job.service.priority == 5
    assert before + 12 <= job.service.deadline <= time.time() + 12
    stored = actions.job(submitted.job_id)
    assert (stored["service_class"], stored["priority"]) == ("interactive", 5)
    # an empty deadline takes the interactive target
    default = actions.submit(USER, record.id, stroke(), EditForm(prompt="p", model=MODEL))
    target = settings.deadlines.interactive_target_s
    shown = actions.job(default.job_id)
    assert shown["deadline"] - shown["created_at"] == pytest.approx(target, abs=1.0)
    with pytest.raises(StudioError, match="deadline_s"):
        actions.submit(USER, record.id, stroke(), EditForm(prompt="p", deadline_s=-1.0))


def test_a_busy_service_refuses_with_its_reason_as_a_warning_never_a_traceback(
    redis_url, tmp_path, redis_client, warnings
):
    # interactive configured to shed, a queue bound of 2 accepted jobs not running yet
    settings = studio_settings(redis_url, tmp_path, shed_classes=("interactive",), max_queue=2)
    actions = make_actions(settings, redis_client)
    (record,), _ = actions.upload([upload_file(tmp_path)])
    form = EditForm(prompt="p", model=MODEL, steps=2)
    page = StudioPage(actions)
    for _ in range(2):
        actions.submit(USER, record.id, stroke(), form)
    # three variations, one batch: refused whole, nothing more queued, the page as it was and
    # the warning saying why
    (update,) = list(page._submit(None, record.id, stroke(), 3, "generate", *form_values(form)))
    assert all(u == gr.skip() for u in update)
    (warning,) = warnings
    assert warning.startswith("The service is too busy") and "the bound is 2" in warning
    assert "Retry in" in warning and "Traceback" not in warning
    assert len(pre_queue_jobs(redis_client, settings)) == 2
    # a single edit: refused the same way
    warnings.clear()
    with pytest.raises(StudioError, match=r"Retry in \d+ s") as raised:
        actions.submit(USER, record.id, stroke(), form)
    assert raised.value.retry_after_s > 0
    (update,) = list(page._submit(None, record.id, stroke(), 1, "generate", *form_values(form)))
    assert all(u == gr.skip() for u in update)
    assert len(warnings) == 1 and "too busy" in warnings[0] and "Traceback" not in warnings[0]
    assert len(pre_queue_jobs(redis_client, settings)) == 2


def event(service, job_id: str, status: str, **fields) -> None:
    service.jobstate.record_event(JobEvent(job_id=job_id, status=status, at=time.time(), **fields))


def test_the_status_line_follows_the_workers_forecast_parks_and_resumes_then_on_time(
    redis_url, tmp_path, redis_client
):
    settings = studio_settings(redis_url, tmp_path)
    actions = make_actions(settings, redis_client)
    service = actions.service
    (record,), _ = actions.upload([upload_file(tmp_path)])
    job_id = actions.submit(USER, record.id, stroke(), EditForm(prompt="p", model=MODEL)).job_id
    follower = actions.follow(job_id)
    assert next(follower).status == "queued"
    now = time.time()
    forecast = {"predicted_start": now + 20.4, "predicted_finish": now + 40.4}
    event(service, job_id, "waiting", worker_id="w", queue_position=3, **forecast)
    waiting = next(follower)
    assert waiting.queue_position == 3, waiting
    line = waiting.describe(now)
    assert "Waiting for a worker · position 3 in the worker's queue" in line
    assert "start in ~20 s · finish in ~40 s" in line
    steps = {"worker_id": "w", "num_steps": 24}
    event(service, job_id, "running", step=8, message=PARKED, **steps)
    parked = next(follower)
    assert PARKED in parked.describe(now) and "finish in ~40 s" in parked.describe(now)
    event(service, job_id, "running", step=8, message="resumed at step 8", **steps)
    assert "resumed at step 8" in next(follower).describe(now)
    finish(service, job_id, sample_template(W, H, seed=2))
    done = list(follower)[-1]
    assert done.describe() == "Done · on time" and done.met_deadline is True
    page = StudioPage(actions)
    assert "interactive · on time" in page._shown(job_id)[1]
    rows, _thumbs, _jobs = page._history_rows(None)
    cells = {name: rows[0][HISTORY_HEADERS.index(name)] for name in ("class", "deadline")}
    assert cells == {"class": "interactive", "deadline": "on time"}


def test_a_job_done_past_its_deadline_says_how_late(redis_url, tmp_path, redis_client):
    settings = studio_settings(redis_url, tmp_path)
    actions = make_actions(settings, redis_client)
    (record,), _ = actions.upload([upload_file(tmp_path)])
    form = EditForm(prompt="p", model=MODEL, deadline_s=5.0)
    ref = actions.service.blobs.put_content("results", b"png", ".png")
    late_id = actions.submit(USER, record.id, stroke(), form).job_id
    late_deadline = actions.job(late_id)["deadline"]
    actions.service.jobstate.record_event(
        JobEvent(job_id=late_id, status="done", at=late_deadline + 9.0, result_ref=ref)
    )
    assert actions.progress(late_id).describe() == "Done · 9 s late"
    assert progress_html(actions.progress(late_id)).count("9 s late") == 1


def test_following_with_every_slice_repeats_an_unchanged_progress_so_forecasts_count_down(
    redis_url, tmp_path, redis_client, monkeypatch
):
    monkeypatch.setattr(studio_actions, "FOLLOW_SLICE_MS", 20)
    actions = make_actions(studio_settings(redis_url, tmp_path), redis_client)
    (record,), _ = actions.upload([upload_file(tmp_path)])
    job_id = actions.submit(USER, record.id, stroke(), EditForm(prompt="p", model=MODEL)).job_id
    follower = actions.follow_all([job_id], every_slice=True)
    assert next(follower) == next(follower)  # nothing happened in between: shown again
