"""The studio's page: a Gradio ``Blocks`` over ``StudioActions`` (layout and wiring only).

Three tabs: **Editor** (pick a template, paint the mask, prompt and parameters, submit, watch the
steps, cancel, before/after, download, save as template), **Gallery** (upload several templates,
name and tags, search, cache status per model and prepare, delete with a confirmation) and
**History** (the signed-in user's jobs; selecting one recalls its parameters into the editor).

Every handler turns a ``StudioError`` into a ``gr.Warning`` toast (what to fix) and leaves the page
as it was: a bad input never shows a stack trace.
"""

from __future__ import annotations

import html

import gradio as gr

from studio.actions import EditForm, StudioActions, StudioError
from studio.components import BRUSH, GALLERY_COLUMNS, handler, progress_html, user_of
from studio.gallery_tab import GalleryTab
from studio.history_tab import HistoryTab


class StudioPage(GalleryTab, HistoryTab):
    """Builds the Blocks; ``actions`` does the work."""

    def __init__(self, actions: StudioActions, title: str = "MaskServe Studio"):
        self.actions, self.title = actions, title

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
        path = str(self.actions.image_path(record.id))
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
            submitted = self.actions.submit(user_of(request), template_id, canvas, form)
        except StudioError as exc:
            gr.Warning(str(exc))
            yield (gr.skip(), gr.skip(), *idle, gr.skip())
            return
        yield (
            submitted.job_id,
            progress_html(self.actions.progress(submitted.job_id)),
            None,
            "",
            gr.update(visible=False),
            gr.update(visible=False),
            submitted.seed,
        )
        final = None
        for progress in self.actions.follow(submitted.job_id):
            final = progress
            yield (gr.skip(), progress_html(progress), *idle, gr.skip())
        if final is None or final.status != "done":
            return
        result = str(self.actions.result_path(submitted.job_id))
        original = str(self.actions.image_path(template_id))
        job = self.actions.job(submitted.job_id)
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
            progress_html(final),
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


def build_studio(actions: StudioActions) -> gr.Blocks:
    return StudioPage(actions).build()
