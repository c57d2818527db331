"""The studio's Gallery tab: upload templates, add sample scenes, search, cache status and prepare,
delete, edit.

A mixin of ``StudioPage``: it uses the page's ``actions`` and the editor's components it is given.
"""

from __future__ import annotations

import datetime as dt
import html

import gradio as gr

from studio.actions import SAMPLE_TAG, StudioActions, StudioError
from studio.components import NOTHING_PAINTED, handler
from templates_store.store import TemplateNotFound

SELECT_HINT = "Select a template to see its details."
EMPTY_HINT = (
    "The gallery is empty: upload images, or click **Add sample scenes** to start from generated "
    "scenes."
)


def idle_hint(has_templates: bool) -> str:
    """What the details area says with no template selected."""
    return SELECT_HINT if has_templates else EMPTY_HINT


TRY_PROMPT = "held-out generated scenes: try a prompt like 'a small green star'"


class GalleryTab:
    actions: StudioActions

    # ----- data for components --------------------------------------------------------------------
    def _gallery(self, query: str = "", tag: str = ""):
        items, ids = [], []
        for record in self.actions.gallery(query, tag):
            try:
                items.append((str(self.actions.thumbnail_path(record.id)), record.name))
            except TemplateNotFound:  # deleted while we listed
                continue
            ids.append(record.id)
        return items, ids

    def _idle_details(self, selected: str = ""):
        """What the details area says with no template selected (says so when the gallery is empty
        and points to the samples button); a selected template's details stay (``gr.skip``)."""
        if selected:
            return gr.skip()
        return idle_hint(bool(self.actions.gallery()))

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
                ui["samples"] = gr.Button("Add sample scenes", elem_id="ms-samples")
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
                # filled by the page's load (``_refresh_all``), with the galleries
                ui["details"] = gr.Markdown("Loading the gallery…", elem_id="ms-details")
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
            [ui["files"], ui["name"], ui["tags"], ui["query"], ui["tag"], ui["selected"]],
            [*listing, ui["files"], ui["details"]],
        )
        # Gradio's default concurrency (one run at a time per event) keeps two clicks from adding
        # the same scene twice
        ui["samples"].click(self._add_samples, [ui["query"], ui["tag"]], [*listing, ui["details"]])
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
            show_progress_on=[editor["picked"]],  # off the canvas (see StudioPage._canvas_column)
        )

    @handler(6)
    def _upload(self, files, name, tags, query, tag, selected):
        added, problems = self.actions.upload(files or [], name, tags)
        for problem in problems:
            gr.Warning(problem)
        if added:
            gr.Info(f"Added {len(added)} template{'s' if len(added) > 1 else ''}")
        items, ids = self._gallery(query, tag)
        all_items, all_ids = self._gallery()
        return items, ids, all_items, all_ids, None, self._idle_details(selected)

    @handler(5)
    def _add_samples(self, query, tag):
        before = {record.id for record in self.actions.gallery(tag=SAMPLE_TAG)}
        records = self.actions.add_samples()
        added = sum(record.id not in before for record in records)
        if added:
            report = f"Added {added} sample scene{'s' if added > 1 else ''} ({TRY_PROMPT})"
        else:
            report = f"The {len(records)} sample scenes are already in the gallery ({TRY_PROMPT})"
        items, ids = self._gallery(query, tag)
        all_items, all_ids = self._gallery()
        return items, ids, all_items, all_ids, report

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
            self._idle_details(),
            gr.update(visible=False),
        )

    @handler(6)
    def _edit(self, template_id, model):
        record, canvas = self._on_canvas(template_id)
        return (
            record.id,
            canvas,
            self._picked_line(record),
            None,
            NOTHING_PAINTED,
            gr.Tabs(selected="editor"),
        )
