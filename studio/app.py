"""The studio's page: a Gradio ``Blocks`` over ``StudioActions`` (layout and wiring only).

Three tabs: **Editor** (pick a template, paint the mask, prompt and parameters, submit, watch the
steps, cancel, before/after, download, save as template), **Gallery** (upload several templates,
name and tags, search, cache status per model and prepare, delete with a confirmation) and
**History** (the signed-in user's jobs; selecting one recalls its parameters into the editor).

Every handler turns a ``StudioError`` into a ``gr.Warning`` toast (what to fix) and leaves the page
as it was: a bad input never shows a stack trace.
"""

from __future__ import annotations

import datetime as dt
import functools
import html

import gradio as gr

from studio.actions import EditForm, StudioActions, StudioError
from templates_store.store import TemplateNotFound

BRUSH = gr.Brush(default_size=24, colors=["#ff3030", "#30a0ff", "#ffffff"], color_mode="defaults")
GALLERY_COLUMNS = 3
HISTORY_HEADERS = ["submitted", "status", "prompt", "seed", "steps", "model", "total s", "job"]
# Gradio narrows a gallery's grid to its item count (one template fills the whole width): keep the
# declared columns whatever the count
CSS = """
#ms-pick .grid-container { grid-template-columns: repeat(3, minmax(0, 1fr)) !important; }
#ms-gallery .grid-container { grid-template-columns: repeat(5, minmax(0, 1fr)) !important; }
#ms-results .grid-container { grid-template-columns: repeat(8, minmax(0, 1fr)) !important; }
#ms-progress progress { width: 100%; height: 14px; }
#ms-status { min-height: 2.5em; }
.ms-muted { color: var(--body-text-color-subdued); font-size: 0.9em; }
"""


def _user(request: gr.Request | None) -> str:
    """The signed-in user (``local`` when auth is disabled)."""
    return (getattr(request, "username", None) or "local") if request is not None else "local"


def handler(n_outputs: int = 1):
    """A handler feeding ``n_outputs`` components: a StudioError becomes a warning toast and every
    output keeps its value."""

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except StudioError as exc:
                gr.Warning(str(exc))
                return gr.skip() if n_outputs == 1 else tuple(gr.skip() for _ in range(n_outputs))

        return wrapper

    return decorate


def _progress_html(progress) -> str:
    bar = ""
    if progress.num_steps:
        bar = f'<progress value="{progress.step}" max="{progress.num_steps}"></progress>'
    return f'<div id="ms-progress">{bar}<div>{html.escape(progress.describe())}</div></div>'


class StudioPage:
    """Builds the Blocks; ``actions`` does the work."""

    def __init__(self, actions: StudioActions, title: str = "MaskServe Studio"):
        self.actions, self.title = actions, title

    # ----- data for components --------------------------------------------------------------------
    def _gallery(self, query: str = "", tag: str = ""):
        items, ids = [], []
        for record in self.actions.gallery(query, tag):
            try:
                items.append((str(self.actions.templates.thumbnail_path(record.id)), record.name))
            except TemplateNotFound:  # deleted while we listed
                continue
            ids.append(record.id)
        return items, ids

    def _history_rows(self, request: gr.Request):
        """The signed-in user's jobs: table rows, result thumbnails, and the jobs (for recall)."""
        jobs = self.actions.history(_user(request))
        rows = []
        for job in jobs:
            when = dt.datetime.fromtimestamp(job.get("created_at", 0)).strftime("%Y-%m-%d %H:%M:%S")
            total = job.get("timings", {}).get("total_s")
            rows.append(
                [
                    when,
                    job["status"],
                    job.get("prompt", ""),
                    job.get("seed", ""),
                    job.get("num_steps") or job.get("steps", ""),
                    job.get("model_id", ""),
                    "" if total is None else f"{total:.1f}",
                    job["job_id"],
                ]
            )
        thumbs = [
            (str(p), job.get("prompt", "")[:40])
            for job in jobs
            if (p := self.actions.thumbnail_of(job))
        ]
        return rows, thumbs, jobs

    # ----- the page -------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        with gr.Blocks(title=self.title, fill_width=True) as page:
            gr.Markdown(
                f"## {self.title}\nPaint over what to change, describe it, and submit. "
                "Everything outside the painted area stays exactly as it was."
            )
            template_ids = gr.State([])  # gallery index -> template id
            current = gr.State("")  # the template in the editor
            job_id = gr.State("")  # the job this page follows
            history_jobs = gr.State([])
            with gr.Tabs() as tabs:
                with gr.Tab("Editor", id="editor"):
                    editor = self._editor_tab(template_ids, current, job_id)
                with gr.Tab("Gallery", id="gallery"):
                    gallery = self._gallery_tab(template_ids, current, tabs, editor)
                with gr.Tab("History", id="history") as history_tab:
                    self._history_tab(history_tab, history_jobs, current, tabs, editor)
            page.load(
                self._refresh_all,
                [editor["search"]],
                [editor["gallery"], template_ids, gallery["gallery"], gallery["ids"]],
            )
            page.load(
                self._models,
                None,
                [editor["model"], gallery["model"], editor["steps"], editor["guidance"]],
            )
        return page

    def _refresh_all(self, query: str = ""):
        """Both galleries (the editor's filtered by its search box) and their index -> id lists."""
        return (*self._gallery(query), *self._gallery())

    def _models(self):
        """Model choices, and the first model's default steps and guidance."""
        models = self.actions.models()
        first = models[0] if models else None
        steps, guidance = self.actions.model_defaults(first) if first else (gr.skip(), gr.skip())
        return (
            gr.update(choices=models, value=first),
            gr.update(choices=models, value=first),
            steps,
            guidance,
        )

    # ----- editor ---------------------------------------------------------------------------------
    def _editor_tab(self, template_ids, current, job_id) -> dict:
        ui: dict = {}
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=220):
                ui["search"] = gr.Textbox(label="Find a template", placeholder="name contains...")
                ui["gallery"] = gr.Gallery(
                    label="Templates",
                    columns=GALLERY_COLUMNS,
                    height=360,
                    allow_preview=False,
                    object_fit="contain",
                    elem_id="ms-pick",
                )
                ui["picked"] = gr.Markdown(
                    "No template selected.", elem_classes="ms-muted", elem_id="ms-picked"
                )
            with gr.Column(scale=3, min_width=420):
                ui["canvas"] = gr.ImageEditor(
                    label="Paint the area to change",
                    type="pil",
                    format="png",
                    image_mode="RGBA",
                    sources=(),
                    brush=BRUSH,
                    eraser=gr.Eraser(default_size=24),
                    transforms=(),
                    layers=gr.LayerOptions(allow_additional_layers=False),
                    height=560,
                    elem_id="ms-canvas",
                )
                with gr.Row():
                    ui["invert"] = gr.Checkbox(
                        label="Invert (repaint everything else)", value=False
                    )
                    ui["grow"] = gr.Slider(-64, 64, value=0, step=1, label="Grow / shrink (px)")
                    ui["feather"] = gr.Slider(0, 64, value=0, step=1, label="Feather (px)")
                ui["ratio"] = gr.Markdown("Mask: nothing painted yet", elem_id="ms-ratio")
                with gr.Accordion("Mask preview", open=False):
                    ui["overlay"] = gr.Image(
                        label="Area to repaint (tinted)", interactive=False, height=300
                    )
            with gr.Column(scale=2, min_width=280):
                ui["prompt"] = gr.Textbox(
                    label="Prompt",
                    lines=3,
                    placeholder="what should appear in the painted area",
                    elem_id="ms-prompt",
                )
                ui["negative"] = gr.Textbox(label="Negative prompt", lines=1)
                ui["model"] = gr.Dropdown(label="Model", choices=[], allow_custom_value=False)
                with gr.Row():
                    ui["steps"] = gr.Slider(
                        1, 150, value=20, step=1, label="Steps", elem_id="ms-steps"
                    )
                    ui["guidance"] = gr.Slider(0, 20, value=7.5, step=0.5, label="Guidance")
                ui["strength"] = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Strength")
                with gr.Row():
                    ui["random_seed"] = gr.Checkbox(label="Random seed", value=True)
                    ui["seed"] = gr.Number(
                        label="Seed", value=0, precision=0, minimum=0, maximum=2**32 - 1
                    )
                ui["use_cache"] = gr.Checkbox(
                    label="Reuse the template's cached activations (faster)", value=True
                )
                with gr.Row():
                    ui["submit"] = gr.Button("Generate", variant="primary", elem_id="ms-submit")
                    ui["cancel"] = gr.Button("Cancel", variant="stop", elem_id="ms-cancel")
                ui["status"] = gr.HTML("", elem_id="ms-status")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                ui["compare"] = gr.ImageSlider(
                    label="Before / after", interactive=False, height=520, elem_id="ms-compare"
                )
            with gr.Column(scale=2):
                ui["info"] = gr.Markdown("", elem_id="ms-info")
                ui["reuse_seed"] = gr.Button("Reuse this seed", visible=False)
                ui["download"] = gr.DownloadButton(
                    "Download PNG", visible=False, elem_id="ms-download"
                )
                ui["save_name"] = gr.Textbox(
                    label="Save the result as a template named", placeholder="(optional)"
                )
                ui["save"] = gr.Button("Save result as a new template")
                ui["seed_used"] = gr.State(None)
        self._wire_editor(ui, template_ids, current, job_id)
        return ui

    def _form_inputs(self, ui: dict) -> list:
        return [
            ui[name]
            for name in (
                "prompt",
                "negative",
                "model",
                "steps",
                "guidance",
                "strength",
                "random_seed",
                "seed",
                "invert",
                "grow",
                "feather",
                "use_cache",
            )
        ]

    @staticmethod
    def _form(
        prompt,
        negative,
        model,
        steps,
        guidance,
        strength,
        random_seed,
        seed,
        invert,
        grow,
        feather,
        use_cache,
    ) -> EditForm:
        return EditForm(
            prompt=prompt or "",
            negative_prompt=negative or "",
            model=model or "",
            steps=int(steps),
            guidance=float(guidance),
            strength=float(strength),
            seed=None if random_seed or seed is None else int(seed),
            invert=bool(invert),
            grow_px=int(grow),
            feather_px=float(feather),
            use_cache=bool(use_cache),
        )

    def _wire_editor(self, ui: dict, template_ids, current, job_id) -> None:
        ui["search"].change(
            lambda q: self._gallery(q),
            [ui["search"]],
            [ui["gallery"], template_ids],
            show_progress="hidden",
        )
        ui["gallery"].select(
            self._pick,
            [template_ids, ui["model"]],
            [current, ui["canvas"], ui["picked"], ui["overlay"], ui["ratio"]],
        )
        mask_inputs = [current, ui["canvas"], ui["invert"], ui["grow"], ui["feather"]]
        for trigger in (
            ui["canvas"].change,
            ui["invert"].change,
            ui["grow"].release,
            ui["feather"].release,
        ):
            trigger(
                self._preview,
                mask_inputs,
                [ui["overlay"], ui["ratio"]],
                show_progress="hidden",
                trigger_mode="always_last",
            )
        # .input, not .change: a model recalled from the history keeps the steps and guidance
        # recalled with it
        ui["model"].input(
            self._model_defaults,
            [ui["model"]],
            [ui["steps"], ui["guidance"]],
            show_progress="hidden",
        )
        ui["submit"].click(
            self._submit,
            [current, ui["canvas"], *self._form_inputs(ui)],
            [
                job_id,
                ui["status"],
                ui["compare"],
                ui["info"],
                ui["download"],
                ui["reuse_seed"],
                ui["seed_used"],
            ],
            concurrency_limit=None,
        )
        ui["cancel"].click(self._cancel, [job_id], [ui["status"]], concurrency_limit=None)
        ui["reuse_seed"].click(
            lambda seed: (False, seed), [ui["seed_used"]], [ui["random_seed"], ui["seed"]]
        )
        ui["save"].click(
            self._save,
            [job_id, ui["save_name"], ui["search"]],
            [ui["gallery"], template_ids, ui["save_name"]],
        )

    @handler(5)
    def _pick(self, template_ids: list, model: str, evt: gr.SelectData):
        if evt is None or evt.index is None or evt.index >= len(template_ids):
            raise StudioError("that template is no longer in the gallery: refresh it")
        template_id = template_ids[evt.index]
        record, canvas = self._on_canvas(template_id)
        cache = self.actions.cache_status(template_id, model) if model else "unknown"
        picked = (
            f"**{html.escape(record.name)}** · {record.width}x{record.height}"
            f"{' · ' + ', '.join(record.tags) if record.tags else ''} · cache: {cache}"
        )
        return template_id, canvas, picked, None, "Mask: nothing painted yet"

    def _on_canvas(self, template_id: str):
        """(record, the editor value showing the template with nothing painted)."""
        record = self.actions.template(template_id)
        path = str(self.actions.templates.image_path(record.id))
        return record, {"background": path, "layers": [], "composite": path}

    @handler(2)
    def _preview(self, template_id: str, canvas, invert: bool, grow: float, feather: float):
        if not template_id or not canvas or not canvas.get("layers"):
            return None, "Mask: nothing painted yet"
        form = EditForm(prompt="", invert=invert, grow_px=int(grow), feather_px=float(feather))
        image, ratio = self.actions.preview(template_id, canvas, form)
        if ratio == 0:
            return None, "Mask: nothing painted yet"
        return image, f"Mask: **{ratio:.1%}** of the image will be repainted"

    @handler(2)
    def _model_defaults(self, model: str):
        if not model:
            return gr.skip(), gr.skip()
        steps, guidance = self.actions.model_defaults(model)
        return steps, guidance

    def _submit(
        self,
        template_id,
        canvas,
        prompt,
        negative,
        model,
        steps,
        guidance,
        strength,
        random_seed,
        seed,
        invert,
        grow,
        feather,
        use_cache,
        request: gr.Request,
    ):
        """A generator: the job id at once, then the progress each time it changes, then the result.
        (Every input is a named positional parameter: Gradio passes ``request`` only to those.)"""
        idle = (gr.skip(),) * 4
        form = self._form(
            prompt,
            negative,
            model,
            steps,
            guidance,
            strength,
            random_seed,
            seed,
            invert,
            grow,
            feather,
            use_cache,
        )
        try:
            submitted = self.actions.submit(_user(request), template_id, canvas, form)
        except StudioError as exc:
            gr.Warning(str(exc))
            yield (gr.skip(), gr.skip(), *idle, gr.skip())
            return
        yield (
            submitted.job_id,
            _progress_html(self.actions.progress(submitted.job_id)),
            None,
            "",
            gr.update(visible=False),
            gr.update(visible=False),
            submitted.seed,
        )
        final = None
        for progress in self.actions.follow(submitted.job_id):
            final = progress
            yield (gr.skip(), _progress_html(progress), *idle, gr.skip())
        if final is None or final.status != "done":
            return
        result = str(self.actions.result_path(submitted.job_id))
        original = str(self.actions.templates.image_path(template_id))
        job = self.actions.service.get(submitted.job_id)
        timings = job.get("timings", {})
        info = (
            f"**Done.** Seed used: `{submitted.seed}` · model `{submitted.model_id}` · "
            f"{submitted.steps} steps · job `{submitted.job_id}`"
            f"<br><span class='ms-muted'>queue {timings.get('queue_s', 0):.1f} s · pre "
            f"{timings.get('pre_s', 0):.1f} s · denoise {timings.get('denoise_s', 0):.1f} s · post "
            f"{timings.get('post_s', 0):.1f} s · total {timings.get('total_s', 0):.1f} s</span>"
        )
        yield (
            gr.skip(),
            _progress_html(final),
            (original, result),
            info,
            gr.update(value=result, visible=True),
            gr.update(visible=True),
            submitted.seed,
        )

    @handler()
    def _cancel(self, job_id: str):
        return html.escape(self.actions.cancel(job_id))

    @handler(3)
    def _save(self, job_id: str, name: str, query: str):
        if not job_id:
            raise StudioError("no result yet: generate an edit first")
        record = self.actions.save_result(job_id, name)
        gr.Info(f"Saved as template '{record.name}'")
        items, ids = self._gallery(query)
        return items, ids, ""

    # ----- gallery --------------------------------------------------------------------------------
    def _gallery_tab(self, template_ids, current, tabs, editor) -> dict:
        ui: dict = {}
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=260):
                gr.Markdown("### Upload templates")
                ui["files"] = gr.File(
                    label="Images (PNG, JPEG, WebP, BMP)",
                    file_count="multiple",
                    file_types=["image"],
                    elem_id="ms-upload",
                )
                ui["name"] = gr.Textbox(
                    label="Name", placeholder="(default: the file's name)", elem_id="ms-name"
                )
                ui["tags"] = gr.Textbox(
                    label="Tags", placeholder="comma-separated, e.g. product, studio"
                )
                ui["upload"] = gr.Button("Add to gallery", variant="primary", elem_id="ms-add")
            with gr.Column(scale=3):
                with gr.Row():
                    ui["query"] = gr.Textbox(label="Search by name", scale=2)
                    ui["tag"] = gr.Textbox(label="Tag", scale=1)
                ui["gallery"] = gr.Gallery(
                    label="Gallery",
                    columns=5,
                    height=420,
                    allow_preview=False,
                    object_fit="contain",
                    elem_id="ms-gallery",
                )
                ui["ids"] = gr.State([])
                ui["selected"] = gr.State("")
                ui["details"] = gr.Markdown(
                    "Select a template to see its details.", elem_id="ms-details"
                )
                with gr.Row():
                    ui["model"] = gr.Dropdown(label="Model", choices=[], scale=2)
                    ui["cache"] = gr.Textbox(
                        label="Cache status", interactive=False, scale=2, elem_id="ms-cache"
                    )
                    ui["prepare"] = gr.Button("Prepare cache", scale=1, elem_id="ms-prepare")
                with gr.Row():
                    ui["edit"] = gr.Button("Edit this template", variant="primary")
                    ui["delete"] = gr.Button("Delete…", variant="stop")
                with gr.Row(visible=False) as ui["confirm_row"]:
                    ui["confirm_text"] = gr.Markdown("")
                    ui["confirm"] = gr.Button("Yes, delete it", variant="stop")
                    ui["keep"] = gr.Button("Keep it")
        self._wire_gallery(ui, template_ids, current, tabs, editor)
        return ui

    def _wire_gallery(self, ui: dict, template_ids, current, tabs, editor) -> None:
        listing = [ui["gallery"], ui["ids"], editor["gallery"], template_ids]
        ui["upload"].click(
            self._upload,
            [ui["files"], ui["name"], ui["tags"], ui["query"], ui["tag"]],
            [*listing, ui["files"]],
        )
        for box in (ui["query"], ui["tag"]):
            box.change(
                self._gallery,
                [ui["query"], ui["tag"]],
                [ui["gallery"], ui["ids"]],
                show_progress="hidden",
            )
        ui["gallery"].select(
            self._select, [ui["ids"], ui["model"]], [ui["selected"], ui["details"], ui["cache"]]
        )
        ui["model"].change(
            self._cache_text, [ui["selected"], ui["model"]], [ui["cache"]], show_progress="hidden"
        )
        ui["prepare"].click(
            self._prepare, [ui["selected"], ui["model"]], [ui["cache"]], concurrency_limit=None
        )
        ui["delete"].click(
            self._ask_delete, [ui["selected"]], [ui["confirm_row"], ui["confirm_text"]]
        )
        ui["keep"].click(lambda: gr.update(visible=False), None, [ui["confirm_row"]])
        ui["confirm"].click(
            self._delete,
            [ui["selected"], ui["query"], ui["tag"]],
            [*listing, ui["selected"], ui["details"], ui["confirm_row"]],
        )
        ui["edit"].click(
            self._edit,
            [ui["selected"], ui["model"]],
            [current, editor["canvas"], editor["picked"], editor["overlay"], editor["ratio"], tabs],
        )

    @handler(5)
    def _upload(self, files, name, tags, query, tag):
        added, problems = self.actions.upload(files or [], name, tags)
        for problem in problems:
            gr.Warning(problem)
        if added:
            gr.Info(f"Added {len(added)} template{'s' if len(added) > 1 else ''}")
        items, ids = self._gallery(query, tag)
        all_items, all_ids = self._gallery()
        return items, ids, all_items, all_ids, None

    @handler(3)
    def _select(self, ids: list, model: str, evt: gr.SelectData):
        if evt is None or evt.index is None or evt.index >= len(ids):
            raise StudioError("that template is no longer in the gallery: refresh it")
        record = self.actions.template(ids[evt.index])
        created = dt.datetime.fromtimestamp(record.created_at).strftime("%Y-%m-%d %H:%M")
        details = (
            f"**{html.escape(record.name)}** · {record.width}x{record.height} · "
            f"{record.bytes / 1024:.0f} KiB · tags: {', '.join(record.tags) or '(none)'} · "
            f"added {created}"
        )
        return record.id, details, self.actions.cache_status(record.id, model) if model else ""

    @handler()
    def _cache_text(self, template_id, model):
        return self.actions.cache_status(template_id, model) if template_id and model else ""

    def _prepare(self, template_id, model):
        """A generator: "preparing" while the recording runs, then where the cache is (or why
        not)."""
        try:
            submitted = self.actions.prepare(self.actions.template(template_id).id, model)
            yield f"preparing (job {submitted.job_id[:8]})"
            final = None
            for final in self.actions.follow(submitted.job_id):
                yield f"{final.describe().lower()} (job {submitted.job_id[:8]})"
            if final is not None and final.status == "done":
                status = self.actions.cache_status(template_id, model)
                # a worker lists a new cache at its next heartbeat: until then say what the job said
                yield status if status != "not prepared" else (final.message or "recorded")
        except StudioError as exc:
            gr.Warning(str(exc))
            yield gr.skip()

    @handler(2)
    def _ask_delete(self, template_id):
        record = self.actions.template(template_id)
        return gr.update(
            visible=True
        ), f"Delete **{html.escape(record.name)}**? This cannot be undone."

    @handler(7)
    def _delete(self, template_id, query, tag):
        name = self.actions.delete(template_id)
        gr.Info(f"Deleted '{name}'")
        items, ids = self._gallery(query, tag)
        all_items, all_ids = self._gallery()
        return (
            items,
            ids,
            all_items,
            all_ids,
            "",
            "Select a template to see its details.",
            gr.update(visible=False),
        )

    @handler(6)
    def _edit(self, template_id, model):
        record, canvas = self._on_canvas(template_id)
        picked = f"**{html.escape(record.name)}** · {record.width}x{record.height}"
        return (
            record.id,
            canvas,
            picked,
            None,
            "Mask: nothing painted yet",
            gr.Tabs(selected="editor"),
        )

    # ----- history --------------------------------------------------------------------------------
    def _history_tab(self, history_tab, history_jobs, current, tabs, editor) -> None:
        refresh = gr.Button("Refresh")
        table = gr.Dataframe(
            headers=HISTORY_HEADERS, interactive=False, wrap=True, elem_id="ms-history"
        )
        thumbs = gr.Gallery(
            label="Results", columns=8, height=200, allow_preview=True, elem_id="ms-results"
        )
        gr.Markdown("Select a row to load its parameters into the editor.", elem_classes="ms-muted")
        for trigger in (history_tab.select, refresh.click):
            trigger(self._history_rows, None, [table, thumbs, history_jobs])
        recalled = [
            current,
            editor["canvas"],
            editor["picked"],
            editor["prompt"],
            editor["negative"],
            editor["model"],
            editor["steps"],
            editor["guidance"],
            editor["strength"],
            editor["random_seed"],
            editor["seed"],
            editor["invert"],
            editor["grow"],
            editor["feather"],
            editor["use_cache"],
            tabs,
        ]
        table.select(self._recall, [history_jobs], recalled)

    @handler(16)
    def _recall(self, jobs: list, evt: gr.SelectData):
        row = evt.index[0] if evt is not None and isinstance(evt.index, (list, tuple)) else None
        if row is None or row >= len(jobs):
            raise StudioError("that job is no longer in the history: refresh it")
        job = jobs[row]
        # it may have been deleted since
        record, canvas = self._on_canvas(job.get("template_id", ""))
        ops = job.get("mask_ops", {})
        return (
            record.id,
            canvas,
            f"**{html.escape(record.name)}** · recalled from job {job['job_id'][:8]}: "
            "paint the mask again",
            job.get("prompt", ""),
            job.get("negative_prompt", ""),
            job.get("model_id"),
            job.get("steps"),
            job.get("guidance"),
            job.get("strength"),
            False,
            job.get("seed"),
            bool(ops.get("invert")),
            ops.get("grow_px", 0),
            ops.get("feather_px", 0),
            job.get("use_cache", True),
            gr.Tabs(selected="editor"),
        )


def build_studio(actions: StudioActions) -> gr.Blocks:
    return StudioPage(actions).build()
