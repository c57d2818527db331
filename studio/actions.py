"""What the studio's buttons do, over the same service layer as REST (``JobService``,
``TemplateStore``); no Gradio here, so every action is unit-tested without a browser.

The studio never touches a model: an edit is a ``JobRequest`` like a REST submission, progress is
the job's own event stream, the result is the job's result file. LoRA adapters: ``actions.adapters``
(``studio.adapter_actions``). Problems a user must fix are raised
as ``StudioError`` with a message saying how (the UI shows it as a warning, never a stack trace).

New users start from ``add_samples``: held-out scenes of the demo model's scene generator
(``backend.training.scenes``, numpy and PIL only), which that model never saw while training.

The studio is one tenant (``owner``: ``security.STUDIO_OWNER``, or the local one with auth
disabled): its users share its gallery and see none of an API key's templates or jobs, nor an API
key theirs. Each signed-in user's History is their own (listed for ``security.studio_user``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

from PIL import Image

from backend.adapters.service import AdapterService
from backend.api.adapter_requests import AdapterChoice
from backend.api.batches import BatchItem, BatchRequest, BatchService
from backend.api.security import studio_user
from backend.api.service import MAX_SEED, JobRequest, JobService, ServiceError, SubmittedJob
from backend.blobs import BlobError
from backend.imaging.masks import load_mask
from backend.imaging.uploads import encode_image
from backend.jobstate import TERMINAL
from backend.models import resolve_model
from backend.protocol import MaskOps
from backend.training.scenes import make_scene
from studio import masks as studio_masks
from studio.adapter_actions import StudioAdapters
from studio.deadlines import STUDIO_CLASS, forecast_parts, outcome
from studio.errors import StudioError, service_call
from templates_store.store import (
    MAX_NAME_CHARS,
    TemplateError,
    TemplateNotFound,
    TemplateRecord,
    TemplateStore,
    split_tags,
)

log = logging.getLogger(__name__)

FOLLOW_SLICE_MS = 1000  # longest single wait for a job's next event
MAX_VARIATIONS = 4  # seeds per Generate, submitted as one batch: one cache read for them all
SAMPLE_TAG = "sample"
SAMPLE_SPLIT = "heldout"  # scenes the demo model never trained on
SAMPLE_SIZE = 128  # the demo model's resolution
MAX_SAMPLES = 32  # enough to try the model on; each is generated on the request thread
STAGES = {
    "queued": "Queued",
    "preprocessing": "Pre-processing",
    "waiting": "Waiting for a worker",
    "running": "Denoising",
    "postprocessing": "Post-processing",
    "done": "Done",
    "failed": "Failed",
    "cancelled": "Cancelled",
}


@dataclass(frozen=True)
class EditForm:
    """The editor's fields. ``seed`` None = a random seed (the one used is reported back)."""

    prompt: str
    negative_prompt: str = ""
    model: str = ""
    steps: int | None = None
    guidance: float | None = None
    strength: float = 1.0
    seed: int | None = None
    invert: bool = False
    grow_px: int = 0
    feather_px: float = 0.0
    use_cache: bool = True
    fill_holes: bool = False  # a closed painted outline repaints what it encloses (lasso)
    min_area_px: int = 0  # painted specks smaller than this are dropped
    mode: str = "generate"  # or "erase": filled from the surroundings, no model and no prompt
    inpaint_area: str = "whole"  # or "masked": a padded crop around the mask (design/crop.md)
    crop_padding_px: int = 32
    # LoRA adapters with their scales (none: the base model); an erase runs no model and drops them
    adapters: tuple[AdapterChoice, ...] = ()
    # its service level (every studio edit is ``interactive``): 0..9, higher goes first; seconds
    # from submission to its result (None: the interactive class's target)
    priority: int = 0
    deadline_s: float | None = None

    @property
    def mask_ops(self) -> MaskOps:
        return MaskOps(
            invert=bool(self.invert),
            grow_px=int(self.grow_px),
            feather_px=float(self.feather_px),
            fill_holes=bool(self.fill_holes),
            min_area_px=int(self.min_area_px),
        )


@dataclass(frozen=True)
class Progress:
    """One moment of a job as the studio shows it. ``message``: what is happening now (the job
    record's: a running row "parked at step k: ..." then "resumed at step k", a waiting job's
    note, a failure); the forecast and deadline fields are the record's (``studio.deadlines``)."""

    job_id: str
    status: str
    step: int = 0
    num_steps: int = 0
    queue_position: int | None = None
    message: str = ""
    preview: str = ""  # the latest live preview while denoising (a PNG data URL), else ""
    predicted_start: float = 0.0  # epoch seconds (0: no forecast yet)
    predicted_finish: float = 0.0
    late: bool = False  # accepted though predicted to finish past its deadline
    deadline: float = 0.0
    met_deadline: bool | None = None  # once done
    done_at: float = 0.0

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def describe(self, now: float | None = None) -> str:
        """One line: the stage, the step, the queue position, what is happening, the forecast
        relative to ``now`` (default: the current time), late or on time."""
        now = time.time() if now is None else now
        parts = [STAGES.get(self.status, self.status)]
        if self.status == "running" and self.num_steps:
            parts.append(f"step {self.step}/{self.num_steps}")
        if self.queue_position:
            parts.append(f"position {self.queue_position} in the worker's queue")
        if self.message and self.status != "done":
            parts.append(self.message)
        if self.status == "done":
            parts.append(outcome(self.met_deadline, self.deadline, self.done_at))
        elif not self.finished:
            parts += forecast_parts(
                self.status, self.predicted_start, self.predicted_finish, self.late, now
            )
        return " · ".join(part for part in parts if part)


def _sample_name(number: int, caption: str) -> str:
    """``sample scene <number>: <caption>``, at most the store's name limit: a longer one (some
    three-object captions) is cut at a word and ends with "…". For the MAX_SAMPLES seeds offered
    only words of the background are cut: every object's caption stays whole."""
    name = f"sample scene {number}: {caption}"
    if len(name) <= MAX_NAME_CHARS:
        return name
    return name[: MAX_NAME_CHARS - 1].rsplit(" ", 1)[0] + "…"


def _seconds(value: float) -> str:
    """Two significant figures under ten seconds (a CPU edit of a tiny model takes 0.04 s)."""
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


class StudioActions:
    def __init__(
        self,
        service: JobService,
        templates: TemplateStore,
        owner: str,
        on_submitted=lambda model_id: None,
        adapter_uploads: AdapterService | None = None,
    ):
        """``owner``: the tenant the studio acts as. ``on_submitted(model_id)`` is called for every
        accepted edit (the API's metrics count it). ``adapter_uploads``: the API's adapter upload
        path (None: adapters are listed and used, not registered, here)."""
        self.service, self.templates, self.on_submitted = service, templates, on_submitted
        self.owner = owner
        self.batches = BatchService(service)  # the REST batch submission's own code
        self.adapters = StudioAdapters(
            service.adapters, adapter_uploads, owner, service.settings.adapters
        )

    # ----- gallery --------------------------------------------------------------------------------
    def gallery(self, query: str = "", tag: str = "") -> list[TemplateRecord]:
        return self.templates.list(self.owner, query=query or "", tag=tag or "")

    def template(self, template_id: str) -> TemplateRecord:
        if not template_id:
            raise StudioError("no template selected: pick one in the gallery")
        return service_call(self.templates.get, template_id, self.owner)

    def image_path(self, template_id: str) -> Path:
        return service_call(self.templates.image_path, template_id, self.owner)

    def thumbnail_path(self, template_id: str) -> Path:
        return service_call(self.templates.thumbnail_path, template_id, self.owner)

    def template_image(self, template_id: str) -> Image.Image:
        with Image.open(self.image_path(template_id)) as image:
            return image.convert("RGB")

    def upload(
        self, files: list, name: str = "", tags: str = ""
    ) -> tuple[list[TemplateRecord], list[str]]:
        """Add every file; (records added, one message per file that was refused). ``name`` (when
        given) names them all, numbered when there are several; else each file's own name."""
        if not files:
            raise StudioError("no files chosen: pick one or more images to upload")
        added, problems = [], []
        tag_list = split_tags(tags)
        for index, file in enumerate(files, start=1):
            # a path, or a temp file
            path = Path(file) if isinstance(file, (str, PathLike)) else Path(file.name)
            display = (name or "").strip() or path.stem or "untitled"
            if (name or "").strip() and len(files) > 1:
                display = f"{display} {index}"
            try:
                added.append(self.templates.add(path.read_bytes(), display, self.owner, tag_list))
            except (TemplateError, OSError) as exc:
                problems.append(f"{path.name}: {exc}")
        return added, problems

    def add_samples(self, count: int = 8) -> list[TemplateRecord]:
        """The held-out scenes of seeds 0..count-1 (1 <= count <= MAX_SAMPLES) as the studio's
        templates, in seed order: named ``sample scene <seed + 1>: <caption>``, tagged ``sample``.

        Idempotent: a scene whose content is already a ``sample`` template of the studio's is
        returned as it is, never added again (the store itself would add a second record)."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SAMPLES:
            raise StudioError(f"ask for 1 to {MAX_SAMPLES} sample scenes, not {count!r}")
        present = {record.sha256: record for record in self.gallery(tag=SAMPLE_TAG)}
        # added last scene first: the gallery lists newest first, so scene 1 comes first there
        added = [self._add_sample(seed, present) for seed in reversed(range(count))]
        return added[::-1]

    def _add_sample(self, seed: int, present: dict[str, TemplateRecord]) -> TemplateRecord:
        """The scene of ``seed``: its record in ``present`` (by content sha256) or a new one."""
        scene = make_scene(seed, split=SAMPLE_SPLIT, size=SAMPLE_SIZE)
        # the store keeps the PNG it re-encodes from the upload; a scene is an RGB image, so these
        # are the very bytes it stores and their sha256 is the record's
        png = encode_image(scene.image, "png")
        existing = present.get(hashlib.sha256(png).hexdigest())
        if existing is not None:
            return existing
        name = _sample_name(seed + 1, scene.caption)
        return service_call(self.templates.add, png, name, self.owner, [SAMPLE_TAG])

    def delete(self, template_id: str) -> str:
        record = self.template(template_id)
        service_call(self.service.delete_template, template_id, self.owner)
        return record.name

    def cache_status(
        self,
        template_id: str,
        model: str = "",
        steps: int | None = None,
        strength: float = 1.0,
        guidance: float | None = None,
    ) -> str:
        """Where the template's cache for an edit with these settings is (None: the model's
        default), and on which workers."""
        status = service_call(
            self.service.cache_status,
            template_id,
            self.owner,
            model or None,
            steps=steps,
            strength=strength,
            guidance=guidance,
        )
        where = f" ({', '.join(status['workers'])})" if status["workers"] else ""
        return f"{status['status']}{where}"

    def prepare(self, template_id: str, model: str = "") -> SubmittedJob:
        return service_call(self.service.prepare_template, template_id, self.owner, model or None)

    # ----- models ---------------------------------------------------------------------------------
    def models(self) -> list[str]:
        """Model ids a job may name here: the ones live workers serve, then the deployment's default
        and its allowed list (a job for a model no worker serves waits until one joins)."""
        from backend.protocol.heartbeats import live_heartbeats

        served = sorted({beat.model_id for beat in live_heartbeats(self.service.client).values()})
        settings = self.service.settings
        extra = [settings.engine.model_id, *settings.api.models]
        return list(dict.fromkeys([*served, *extra]))

    @staticmethod
    def model_defaults(model: str) -> tuple[int, float]:
        """(steps, guidance) the model runs with by default."""
        try:
            spec = resolve_model(model)
        except ValueError as exc:
            raise StudioError(str(exc)) from None
        return spec.default_steps, spec.default_guidance

    def estimate(self, model: str, mask_ratio: float, steps: int, guidance: float) -> str:
        """The predicted denoising time of an edit alone on an idle worker of ``model``, with
        the template's cache and as the ordinary pipeline, from the fitted cost profile of the
        device a live worker of it runs on (else the deployment's); "" without a profile."""
        from backend.costmodel.predict import estimate_edit
        from backend.costmodel.profiles import load_profile
        from backend.protocol.heartbeats import live_heartbeats

        if not model or not 0 < mask_ratio <= 1 or steps < 1:
            return ""
        settings = self.service.settings
        devices = [
            b.device for b in live_heartbeats(self.service.client).values() if b.model_id == model
        ]
        device = devices[0] if devices else settings.engine.device
        try:
            profile = load_profile(
                settings.paths.profiles_dir, model, device, settings.engine.cache_mode
            )
        except (OSError, ValueError):
            return ""
        guess = estimate_edit(profile, mask_ratio, steps, guidance)
        return (
            f"denoising ~{_seconds(guess.cached_s)} s with the cache, "
            f"~{_seconds(guess.ordinary_s)} s without ({guess.speedup:.1f}x, {steps} steps on "
            f"{device})"
        )

    # ----- mask -----------------------------------------------------------------------------------
    def preview(self, template_id: str, editor_value, form: EditForm) -> tuple[Image.Image, float]:
        """(the template with the area to repaint tinted, the share of the image repainted)."""
        template = self.template_image(template_id)
        painted = service_call(studio_masks.painted_mask, editor_value, template.size)
        weights = service_call(studio_masks.effective_mask, painted, form.mask_ops)
        return studio_masks.overlay(template, weights), studio_masks.mask_ratio(weights)

    # ----- jobs -----------------------------------------------------------------------------------
    def submit(self, user: str, template_id: str, editor_value, form: EditForm) -> SubmittedJob:
        """Queue an edit of the studio's; ``user`` (the signed-in one) finds it in their History."""
        return self.submit_variations(user, template_id, editor_value, form, 1)[0]

    def submit_variations(
        self, user: str, template_id: str, editor_value, form: EditForm, count: int
    ) -> list[SubmittedJob]:
        """``count`` (1..MAX_VARIATIONS) edits of one mask and prompt with consecutive seeds: the
        form's seed (or a random one), then the next ones. More than one are submitted as one
        batch, in one request (``BatchService``, what ``POST /v1/batches`` runs): the dispatcher
        routes a batch's items to one worker together, where they share the template's cache read
        and join one running batch as its rows free up. All are queued or none (``StudioError``
        says why: the service busy, a seed too large for its successors)."""
        if isinstance(count, bool) or not isinstance(count, int):
            raise StudioError(f"variations must be a whole number from 1 to {MAX_VARIATIONS}")
        if not 1 <= count <= MAX_VARIATIONS:
            raise StudioError(f"ask for 1 to {MAX_VARIATIONS} variations, not {count}")
        started = time.perf_counter()
        request = self._edit_request(user, template_id, editor_value, form)
        if count == 1:
            submitted = [service_call(self.service.submit, request)]
        else:
            # item i runs with seed + i: a random first seed leaves room for the others
            first = secrets.randbelow(MAX_SEED + 2 - count) if form.seed is None else form.seed
            shared = dataclasses.replace(request, seed=first)
            batch = service_call(self.batches.submit, BatchRequest(shared, (BatchItem(),) * count))
            submitted = [
                SubmittedJob(job_id, seed, batch.model_id, batch.steps)
                for job_id, seed in zip(batch.job_ids, batch.seeds, strict=True)
            ]
        for job in submitted:
            self.on_submitted(job.model_id)
        # what the studio itself adds before the first job exists (mask, blobs, queueing)
        log.info(
            "studio queued %d %s job(s) in %.3f s: %s",
            len(submitted),
            form.mode,
            time.perf_counter() - started,
            ", ".join(job.job_id for job in submitted),
        )
        return submitted

    def _edit_request(self, user: str, template_id: str, editor_value, form: EditForm):
        """The ``JobRequest`` of the painted canvas and the form (its seed is set per variation)."""
        record = self.template(template_id)
        painted = service_call(
            studio_masks.painted_mask, editor_value, (record.width, record.height)
        )
        service_call(studio_masks.require_painted, painted)
        erase = form.mode == "erase"  # fills from the surroundings: no prompt, no model's adapters
        return JobRequest(
            mask=studio_masks.mask_png(painted),
            prompt="" if erase else form.prompt or "",
            template_id=template_id,
            negative_prompt=form.negative_prompt or "",
            model=form.model or None,
            steps=form.steps,
            guidance=form.guidance,
            strength=form.strength,
            seed=form.seed,
            mask_ops=form.mask_ops,
            use_cache=bool(form.use_cache),
            mode=form.mode,
            inpaint_area=form.inpaint_area,
            crop_padding_px=int(form.crop_padding_px),
            adapters=() if erase else form.adapters,
            service_class=STUDIO_CLASS,
            deadline_s=form.deadline_s,
            priority=form.priority,
            owner=self.owner,
            listed_for=studio_user(user),
        )

    def job(self, job_id: str) -> dict:
        return service_call(self.service.get, job_id, self.owner)

    def progress(self, job_id: str) -> Progress:
        job = self.job(job_id)
        return Progress(
            job_id=job_id,
            status=job["status"],
            step=int(job.get("step", 0)),
            num_steps=int(job.get("num_steps", 0)),
            queue_position=job.get("queue_position"),
            message=job.get("message", ""),
            predicted_start=float(job.get("predicted_start", 0.0)),
            predicted_finish=float(job.get("predicted_finish", 0.0)),
            late=bool(job.get("late")),
            deadline=float(job.get("deadline", 0.0)),
            met_deadline=job.get("met_deadline"),
            done_at=float(job.get("done_at", 0.0)),
        )

    def follow(self, job_id: str, timeout_s: float = 3600.0) -> Iterator[Progress]:
        """The job's progress each time it changes, ending with its terminal state. Waits on the
        job's own event stream (never a global one), a slice at a time."""
        for progress in self.follow_all([job_id], timeout_s):
            yield progress[0]

    def follow_all(
        self, job_ids: Sequence[str], timeout_s: float = 3600.0, every_slice: bool = False
    ) -> Iterator[list]:
        """The progress of every job (in order) each time one changes, ending when all are
        finished. Waits on the event stream of the first unfinished job (FOLLOW_SLICE_MS at most)
        and reads the others' as they are then. ``every_slice``: also after each wait that brought
        no change (at most every FOLLOW_SLICE_MS), so a forecast shown relative to the current
        time ("finish in ~4 s") counts down."""
        deadline = time.monotonic() + timeout_s
        cursors = dict.fromkeys(job_ids, "0")
        previews = dict.fromkeys(job_ids, "")
        current = [self.progress(job_id) for job_id in job_ids]
        yield current
        while time.monotonic() < deadline:
            waiting = next((p.job_id for p in current if not p.finished), None)
            if waiting is None:
                return
            for job_id in job_ids:  # the first unfinished one waits; the others are read as is
                block = FOLLOW_SLICE_MS if job_id == waiting else None
                entries = service_call(
                    self.service.events, job_id, self.owner, cursors[job_id], block
                )
                if entries:
                    cursors[job_id] = entries[-1][0]
                    shown = [event["preview"] for _, event in entries if event.get("preview")]
                    previews[job_id] = shown[-1] if shown else previews[job_id]
            latest = [
                dataclasses.replace(self.progress(job_id), preview=previews[job_id])
                for job_id in job_ids
            ]
            if latest != current or every_slice:
                current = latest
                yield current

    def cancel(self, job_id: str) -> str:
        return self.cancel_all([job_id] if job_id else [])

    def cancel_all(self, job_ids: Sequence[str]) -> str:
        """Cancel every unfinished job of the last Generate; finished ones keep their results."""
        if not job_ids:
            raise StudioError("no job is running: nothing to cancel")
        running = [job_id for job_id in job_ids if not self.progress(job_id).finished]
        if not running:
            raise StudioError("no edit is running: nothing to cancel")
        for job_id in running:
            service_call(self.service.cancel, job_id, self.owner)
        if len(running) == 1:
            return "Cancelled: the edit stops before its next step"
        return f"Cancelled {len(running)} edits: they stop before their next step"

    def result_path(self, job_id: str) -> Path:
        return service_call(self.service.result_path, job_id, self.owner)

    def save_result(self, job_id: str, name: str = "", tags: str = "") -> TemplateRecord:
        """The job's result as a new gallery template (named after the original when no name is
        given)."""
        job = self.job(job_id)
        data = self.result_path(job_id).read_bytes()
        display = (name or "").strip()
        if not display:
            try:
                original = self.templates.get(job.get("template_id", ""), self.owner)
                display = f"{original.name} (edited)"
            except TemplateNotFound:
                display = f"edit {job_id[:8]}"
        return service_call(self.templates.add, data, display, self.owner, split_tags(tags))

    def keep_editing(self, job_id: str) -> TemplateRecord:
        """The job's result as a new template to edit next (``save_result``), with its cache
        recorded in the background for the job's model and steps. The recording only speeds the
        next edit up: when it cannot be queued the template is still returned (and the reason
        logged)."""
        job = self.job(job_id)
        record = self.save_result(job_id)
        try:
            self.service.prepare_template(
                record.id, self.owner, job.get("model_id") or None, job.get("steps") or None
            )
        except ServiceError as exc:
            log.warning("no background cache recording for template %s: %s", record.id, exc)
        return record

    def job_mask_layer(self, job: dict) -> Image.Image:
        """The mask a job was submitted with, as a painted canvas layer (the mask operations
        are recalled separately, so the layer is the mask as painted). StudioError when its
        file has expired."""
        try:  # an empty ref (a job without one) is a BlobError too
            data = self.service.blobs.get(job.get("mask_ref") or "")
        except BlobError:
            raise StudioError(
                "the job's mask has expired (its parameters are recalled): paint the mask again"
            ) from None
        with Image.open(io.BytesIO(data)) as stored:
            return studio_masks.mask_layer(load_mask(stored))

    def uploaded_mask_layer(self, template_id: str, image: Image.Image) -> Image.Image:
        """An uploaded mask image (white or any bright colour, or alpha = repaint) as a canvas
        layer at the template's size; a mask of another size but the same shape is scaled."""
        record = self.template(template_id)
        mask = service_call(load_mask, image)
        scaled = service_call(studio_masks.to_size, mask, (record.width, record.height))
        if not scaled.any():
            raise StudioError(
                "the uploaded mask is empty: white (or any bright or opaque) pixels mark the "
                "area to repaint, black or transparent ones the area to keep"
            )
        return studio_masks.mask_layer(scaled)

    def history(self, user: str, limit: int = 50) -> list[dict]:
        """The signed-in ``user``'s edits, newest first."""
        jobs = self.service.history(self.owner, limit, listed_for=studio_user(user))
        return [job for job in jobs if job.get("kind") != "prepare"]

    def thumbnail_of(self, job: dict) -> Path | None:
        """The result thumbnail of a job as ``history`` lists it (None until it is done, or
        expired)."""
        try:
            return self.service.blobs.local_path(job.get("thumbnail_ref") or "")
        except BlobError:
            return None
