"""The studio's page: a Gradio ``Blocks`` over ``StudioActions`` (layout and wiring only).

Five tabs: **Editor** (pick a template, paint the mask, prompt and parameters, LoRA adapters with a
scale each, an interactive edit's priority and deadline under More settings, submit, watch the
steps and the forecast, cancel, before/after, download, save as template: the part after Generate
is ``studio.results_view``), **Gallery** (upload several templates, name and tags,
search, cache status per model and prepare, delete with a confirmation), **History** (the signed-in
user's jobs; selecting one recalls its parameters into the editor), **Batches** (one template with
many masks; each batch's progress overall and per item: ``studio.batches_tab``) and **Adapters**
(register, list and delete LoRA adapters: ``studio.adapters_tab``, with the editor's picker).

Every handler turns a ``StudioError`` into a ``gr.Warning`` toast (what to fix) and leaves the page
as it was: a bad input never shows a stack trace.
"""

from __future__ import annotations

import html

import gradio as gr

from backend.config_deadlines import MAX_PRIORITY
from studio.actions import MAX_VARIATIONS, EditForm, StudioActions, StudioError
from studio.adapters_tab import AdaptersTab
from studio.batch_actions import StudioBatches
from studio.batches_tab import BatchesTab
from studio.components import (
    BRUSH,
    CANVAS_PLACEHOLDER,
    FORM_FIELDS,
    GALLERY_COLUMNS,
    NOTHING_PAINTED,
    handler,
)
from studio.gallery_tab import GalleryTab, idle_hint
from studio.history_tab import HistoryTab
from studio.results_view import ResultsView


class StudioPage(GalleryTab, HistoryTab, BatchesTab, ResultsView, AdaptersTab):
    """Builds the Blocks; ``actions`` (and, for batches, ``batches``) does the work."""

    def __init__(self, actions: StudioActions, title: str = "MaskServe Studio"):
        self.actions, self.title = actions, title
        self.batches = StudioBatches(actions)

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
                    self._history_tab(
                        history_tab, history_jobs, template_ids, current, tabs, editor
                    )
                with gr.Tab("Batches", id="batches") as batches_tab:
                    self._batches_tab(batches_tab)
                with gr.Tab("Adapters", id="adapters") as adapters_tab:
                    adapters = self._adapters_tab(adapters_tab, editor)
            self._wire_results(editor, gallery, template_ids, current, job_id)
            page.load(
                self._refresh_all,
                [editor["search"]],
                [
                    editor["gallery"],
                    template_ids,
                    gallery["gallery"],
                    gallery["ids"],
                    gallery["details"],
                ],
            )
            page.load(
                self._models,
                None,
                [
                    editor["model"],
                    gallery["model"],
                    adapters["model"],
                    editor["steps"],
                    editor["guidance"],
                ],
            )
            page.load(self._adapter_rows, None, [adapters["table"], adapters["ids"]])
        return page

    def _refresh_all(self, query: str = ""):
        """Both galleries (the editor's filtered by its search box), their index -> id lists and
        the Gallery tab's idle details, from one listing in one event: the details then never
        contradict the gallery, and a click that waits for them runs after the page's listing
        (a separate load could land after the click's own answer and overwrite it)."""
        all_items, all_ids = self._gallery()
        return (*self._gallery(query), all_items, all_ids, idle_hint(bool(all_ids)))

    def _models(self):
        """Model choices (the editor's, the gallery's, the adapter upload's), and the first model's
        default steps and guidance."""
        models = self.actions.models()
        first = models[0] if models else None
        steps, guidance = self.actions.model_defaults(first) if first else (gr.skip(), gr.skip())
        return (
            *(gr.update(choices=models, value=first) for _ in range(3)),
            steps,
            guidance,
        )

    # ----- editor ---------------------------------------------------------------------------------
    def _editor_tab(self, template_ids, current, job_id) -> dict:
        """Three columns within one screen: templates; the canvas and the mask's tools; the prompt,
        Generate and the result (the rarely changed settings fold away)."""
        ui: dict = {"job_ids": gr.State([]), "seed_used": gr.State(None)}
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
            with gr.Column(scale=3, min_width=420):
                self._canvas_column(ui)
            with gr.Column(scale=2, min_width=300):
                self._prompt_column(ui)
        self._wire_editor(ui, template_ids, current, job_id)
        return ui

    @staticmethod
    def _canvas_column(ui: dict) -> None:
        # above the canvas: what to do first, then which template it shows (an empty editor
        # is a blank page that takes strokes, so it must say a template comes first)
        ui["picked"] = gr.Markdown(CANVAS_PLACEHOLDER, elem_id="ms-picked")
        # Every event that loads a picture into the canvas shows its progress off the canvas:
        # once the painter has drawn on it, Gradio's editor (6.31) keeps such an event's
        # "processing" overlay over the canvas long after the picture has loaded underneath
        ui["canvas"] = gr.ImageEditor(
            label="Paint over the area to change",
            type="pil",
            format="png",
            image_mode="RGBA",
            sources=(),
            brush=BRUSH,
            eraser=gr.Eraser(default_size=24),
            transforms=(),
            layers=gr.LayerOptions(allow_additional_layers=False),
            height=520,
            elem_id="ms-canvas",
        )
        ui["ratio"] = gr.Markdown(NOTHING_PAINTED, elem_id="ms-ratio")
        with gr.Row():
            ui["invert"] = gr.Checkbox(label="Invert (repaint everything else)", value=False)
            ui["fill_holes"] = gr.Checkbox(
                label="Fill closed outlines (lasso)", value=False, elem_id="ms-fill-holes"
            )
        with gr.Row():
            ui["grow"] = gr.Slider(-64, 64, value=0, step=1, label="Grow / shrink (px)")
            ui["feather"] = gr.Slider(0, 64, value=0, step=1, label="Feather (px)")
            ui["min_area"] = gr.Slider(
                0, 400, value=0, step=1, label="Drop specks under (px²)", elem_id="ms-min-area"
            )
        with gr.Row(equal_height=False):
            ui["mask_upload"] = gr.Image(
                label="Or drop a mask image (white = repaint)",
                type="pil",
                image_mode=None,
                sources=["upload"],
                height=140,
                elem_id="ms-mask-upload",
            )
            with gr.Accordion("Mask preview", open=False):
                ui["overlay"] = gr.Image(
                    label="Area to repaint (outlined; the rest dimmed)",
                    interactive=False,
                    height=240,
                )

    def _prompt_column(self, ui: dict) -> None:
        ui["prompt"] = gr.Textbox(
            label="Prompt",
            lines=2,
            placeholder="what should appear in the painted area",
            elem_id="ms-prompt",
        )
        with gr.Row():
            ui["model"] = gr.Dropdown(label="Model", choices=[], allow_custom_value=False)
            ui["steps"] = gr.Slider(1, 150, value=20, step=1, label="Steps", elem_id="ms-steps")
        self._adapter_picker(ui)
        ui["variations"] = gr.Slider(
            1,
            MAX_VARIATIONS,
            value=1,
            step=1,
            label="Variations (consecutive seeds, submitted together as one batch)",
            elem_id="ms-variations",
        )
        with gr.Accordion("More settings", open=False):
            ui["negative"] = gr.Textbox(label="Negative prompt", lines=1)
            with gr.Row():
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
                ui["masked_only"] = gr.Checkbox(
                    label="Inpaint only the masked area (a padded crop at the model's "
                    "resolution: more detail for small masks in large images)",
                    value=False,
                )
                ui["crop_padding"] = gr.Slider(
                    0, 256, value=32, step=8, label="Padding around the mask (px)"
                )
            self._service_level_fields(ui)
        with gr.Row():
            ui["submit"] = gr.Button("Generate", variant="primary", elem_id="ms-submit")
            ui["erase"] = gr.Button("Erase (instant, no model)", elem_id="ms-erase", min_width=120)
            ui["cancel"] = gr.Button("Cancel", variant="stop", elem_id="ms-cancel")
        ui["generate_mode"], ui["erase_mode"] = gr.State("generate"), gr.State("erase")
        ui["status"] = gr.HTML("", elem_id="ms-status")
        # the handle starts at the left edge, the result shown whole: a painter looks at their
        # edit first, wherever the mask is, and drags the handle to uncover the original (a
        # split in the middle hid an edit in the left half; one at the mask's centre would
        # still hide half of every edit)
        ui["compare"] = gr.ImageSlider(
            label="Before / after",
            interactive=False,
            height=360,
            slider_position=0,
            elem_id="ms-compare",
        )
        ui["results"] = gr.Gallery(
            label="Variations: pick one",
            columns=MAX_VARIATIONS,
            height=180,
            allow_preview=False,
            object_fit="contain",
            visible=False,
            elem_id="ms-variants",
        )
        ui["info"] = gr.Markdown("", elem_id="ms-info")
        with gr.Row():
            ui["keep_editing"] = gr.Button(
                "Keep editing this result", visible=False, elem_id="ms-keep-editing"
            )
            ui["reuse_seed"] = gr.Button("Reuse this seed", visible=False)
            ui["download"] = gr.DownloadButton("Download PNG", visible=False, elem_id="ms-download")
        with gr.Row():
            ui["save_name"] = gr.Textbox(
                label="Save the result as a template named", placeholder="(optional)", scale=2
            )
            ui["save"] = gr.Button("Save as template", scale=1, elem_id="ms-save")

    def _service_level_fields(self, ui: dict) -> None:
        """Priority and deadline of the edit (an interactive one: someone is watching it)."""
        target = self.actions.service.settings.deadlines.interactive_target_s
        with gr.Row():
            ui["priority"] = gr.Slider(
                0,
                MAX_PRIORITY,
                value=0,
                step=1,
                label=f"Priority (0-{MAX_PRIORITY}, higher goes first)",
                elem_id="ms-priority",
            )
            # 0 (what an emptied number field sends too): the class's target
            ui["deadline"] = gr.Number(
                label=f"Deadline (s; 0: the interactive target, {target:g} s)",
                value=0,
                minimum=0,
                precision=1,
                elem_id="ms-deadline",
            )

    @staticmethod
    def _form_inputs(ui: dict) -> list:
        return [ui[name] for name in FORM_FIELDS]

    def _wire_editor(self, ui: dict, template_ids, current, job_id) -> None:
        ui["search"].change(
            lambda q: self._gallery(q),
            [ui["search"]],
            [ui["gallery"], template_ids],
            show_progress="hidden",
        )
        ui["gallery"].select(
            self._pick,
            [template_ids, ui["model"], ui["steps"], ui["strength"], ui["guidance"]],
            [current, ui["canvas"], ui["picked"], ui["overlay"], ui["ratio"]],
            show_progress_on=[ui["picked"]],
        )
        # the editor's own "Clear canvas" drops the picture too: put the template back, unpainted
        ui["canvas"].clear(
            self._unpainted,
            [current],
            [ui["canvas"], ui["overlay"], ui["ratio"]],
            show_progress_on=[ui["ratio"]],
        )
        ui["mask_upload"].upload(
            self._use_uploaded_mask,
            [current, ui["mask_upload"]],
            [ui["canvas"], ui["mask_upload"]],
            show_progress_on=[ui["mask_upload"]],
        )
        mask_inputs = [
            current,
            ui["canvas"],
            ui["invert"],
            ui["grow"],
            ui["feather"],
            ui["fill_holes"],
            ui["min_area"],
            ui["model"],
            ui["steps"],
            ui["guidance"],
        ]
        for trigger in (
            ui["canvas"].change,
            ui["invert"].change,
            ui["fill_holes"].change,
            ui["grow"].release,
            ui["feather"].release,
            ui["min_area"].release,
            ui["model"].change,
            ui["steps"].release,
            ui["guidance"].release,
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
        self._wire_picker(ui)
        fields = [*self._form_inputs(ui), *self._picker_inputs(ui)]
        for button, mode in ((ui["submit"], ui["generate_mode"]), (ui["erase"], ui["erase_mode"])):
            button.click(
                self._submit,
                [current, ui["canvas"], ui["variations"], mode, *fields],
                [job_id, ui["job_ids"], ui["status"], *self._result_outputs(ui), ui["results"]],
                concurrency_limit=None,
            )
        ui["results"].select(
            self._pick_variation, [ui["job_ids"]], [job_id, *self._result_outputs(ui)]
        )
        ui["cancel"].click(self._cancel, [ui["job_ids"]], [ui["status"]], concurrency_limit=None)
        ui["reuse_seed"].click(
            lambda seed: (False, seed), [ui["seed_used"]], [ui["random_seed"], ui["seed"]]
        )

    @handler(5)
    def _pick(self, template_ids, model, steps, strength, guidance, evt: gr.SelectData):
        """The picked template on the canvas, and its cache status for the editor's settings."""
        if evt is None or evt.index is None or evt.index >= len(template_ids):
            raise StudioError("that template is no longer in the gallery: refresh it")
        template_id = template_ids[evt.index]
        record, canvas = self._on_canvas(template_id)
        cache = "unknown"
        if model:
            settings = {"steps": int(steps), "strength": float(strength), "guidance": guidance}
            cache = self.actions.cache_status(template_id, model, **settings)
        return template_id, canvas, self._picked_line(record, cache), None, NOTHING_PAINTED

    @staticmethod
    def _picked_line(record, cache: str = "") -> str:
        tags = " · " + ", ".join(record.tags) if record.tags else ""
        status = f" · cache: {cache}" if cache else ""
        return f"**{html.escape(record.name)}** · {record.width}x{record.height}{tags}{status}"

    def _on_canvas(self, template_id: str, layer=None):
        """(record, the editor value showing the template with ``layer`` painted, or nothing).
        The composite is the template alone: the editor draws its picture from the composite
        (the background only without one), so a composite with the layer in it would show the
        mask twice, once as a picture the brush and eraser cannot touch and Generate never sends.
        """
        record = self.actions.template(template_id)
        path = str(self.actions.image_path(record.id))
        layers = [] if layer is None else [layer]
        return record, {"background": path, "layers": layers, "composite": path}

    @handler(3)
    def _unpainted(self, template_id: str):
        if not template_id:
            return gr.skip(), None, NOTHING_PAINTED
        return self._on_canvas(template_id)[1], None, NOTHING_PAINTED

    @handler(2)
    def _use_uploaded_mask(self, template_id: str, image):
        if image is None:
            return gr.skip(), gr.skip()
        if not template_id:
            raise StudioError("pick a template first, then drop its mask")
        layer = self.actions.uploaded_mask_layer(template_id, image)
        return self._on_canvas(template_id, layer)[1], None

    @handler(2)
    def _preview(
        self,
        template_id,
        canvas,
        invert,
        grow,
        feather,
        fill_holes=False,
        min_area=0,
        model="",
        steps=0,
        guidance=0.0,
    ):
        """(the mask preview, the line saying how much is repainted and the predicted time)."""
        if not template_id or not canvas or not canvas.get("layers"):
            return None, NOTHING_PAINTED
        form = EditForm(
            prompt="",
            invert=invert,
            grow_px=int(grow),
            feather_px=float(feather),
            fill_holes=bool(fill_holes),
            min_area_px=int(min_area or 0),
        )
        image, ratio = self.actions.preview(template_id, canvas, form)
        if ratio == 0:
            return None, NOTHING_PAINTED
        line = f"Mask: **{ratio:.1%}** of the image will be repainted"
        estimate = self.actions.estimate(model, ratio, int(steps or 0), float(guidance or 0))
        return image, f"{line} · predicted {estimate}" if estimate else line

    @handler(2)
    def _model_defaults(self, model: str):
        if not model:
            return gr.skip(), gr.skip()
        steps, guidance = self.actions.model_defaults(model)
        return steps, guidance


def build_studio(actions: StudioActions) -> gr.Blocks:
    return StudioPage(actions).build()
