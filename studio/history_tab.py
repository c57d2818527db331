"""The studio's History tab: the signed-in user's jobs (with their adapters and the step each
joined at, their service class and whether they met their deadline); selecting one recalls it into
the editor (its priority and a deadline it asked for too), its adapters into the picker.

A mixin of ``StudioPage``: it uses the page's ``actions`` and the editor's components it is given.
"""

from __future__ import annotations

import datetime as dt
import html

import gradio as gr

from studio.actions import EditForm, StudioActions, StudioError
from studio.components import FORM_FIELDS, HISTORY_HEADERS, unchanged, user_of
from studio.deadlines import job_outcome, requested_deadline_s

# what a recall sets besides the form's fields and the adapter picker (``_recall``'s values)
RECALL_EXTRAS = 7
ERASE_PROMPT = "(erase: filled from the surroundings)"
NOT_APPLICABLE = "—"


def _what_ran(job: dict) -> tuple:
    """(prompt, seed, steps, model) of a job's row; an erase runs no model, so it has none of
    them: its row says what it did in the prompt's place."""
    if job.get("mode") == "erase":
        return ERASE_PROMPT, NOT_APPLICABLE, NOT_APPLICABLE, NOT_APPLICABLE
    steps = job.get("num_steps") or job.get("steps", "")
    return job.get("prompt", ""), job.get("seed", ""), steps, job.get("model_id", "")


class HistoryTab:
    actions: StudioActions

    def _history_rows(self, request: gr.Request):
        """The signed-in user's jobs: table rows, result thumbnails, and the jobs (for recall)."""
        jobs = self.actions.history(user_of(request))
        rows = []
        for job in jobs:
            when = dt.datetime.fromtimestamp(job.get("created_at", 0)).strftime("%Y-%m-%d %H:%M:%S")
            total = job.get("timings", {}).get("total_s")
            rows.append(
                [
                    when,
                    job["status"],
                    *_what_ran(job),
                    self.actions.adapters.describe(job),
                    "" if total is None else f"{total:.1f}",
                    job.get("service_class", ""),
                    job_outcome(job),
                    job["job_id"],
                ]
            )
        thumbs = [
            (str(p), _what_ran(job)[0][:40])
            for job in jobs
            if (p := self.actions.thumbnail_of(job))
        ]
        return rows, thumbs, jobs

    # ----- history --------------------------------------------------------------------------------
    def _history_tab(self, history_tab, history_jobs, template_ids, current, tabs, editor) -> None:
        refresh = gr.Button("Refresh")
        table = gr.Dataframe(
            headers=HISTORY_HEADERS, interactive=False, wrap=True, elem_id="ms-history"
        )
        thumbs = gr.Gallery(
            label="Results", columns=8, height=200, allow_preview=True, elem_id="ms-results"
        )
        gr.Markdown(
            "Select a row to load its template, mask and parameters into the editor.",
            elem_classes="ms-muted",
        )
        for trigger in (history_tab.select, refresh.click):
            trigger(self._history_rows, None, [table, thumbs, history_jobs])
        recalled = [
            current,
            editor["canvas"],
            editor["picked"],
            *(editor[name] for name in FORM_FIELDS),
            editor["overlay"],
            editor["ratio"],
            editor["gallery"],
            tabs,
            *editor["adapter_slots"],
            *editor["adapter_scales"],
        ]
        # progress off the canvas (see StudioPage._canvas_column)
        table.select(
            self._recall,
            [history_jobs, template_ids],
            recalled,
            show_progress_on=[editor["picked"]],
        )

    def _recall(self, jobs: list, template_ids: list, evt: gr.SelectData):
        """``_recalled``'s values; on a StudioError a warning and every output as it was."""
        try:
            return self._recalled(jobs, template_ids, evt)
        except StudioError as exc:
            gr.Warning(str(exc))
            slots = self.actions.adapters.limits.max_per_request
            return unchanged(RECALL_EXTRAS + len(FORM_FIELDS) + 2 * slots)

    def _recalled(self, jobs: list, template_ids: list, evt: gr.SelectData):
        """The job's template with its mask painted, its parameters, the mask line and preview,
        its template highlighted among the editor's templates, and its adapters in the picker
        (when its model is recalled: they were registered for it)."""
        row = evt.index[0] if evt is not None and isinstance(evt.index, (list, tuple)) else None
        if row is None or row >= len(jobs):
            raise StudioError("that job is no longer in the history: refresh it")
        job = jobs[row]
        template_id = job.get("template_id", "")
        try:
            layer = self.actions.job_mask_layer(job)
        except StudioError as exc:  # expired: the parameters are still worth recalling
            gr.Warning(str(exc))
            layer = None
        # the template may have been deleted since: then nothing changes (a warning says why)
        record, canvas = self._on_canvas(template_id, layer)
        ops = job.get("mask_ops", {})
        form = EditForm(
            prompt="",
            invert=bool(ops.get("invert")),
            grow_px=int(ops.get("grow_px", 0)),
            feather_px=float(ops.get("feather_px", 0)),
            fill_holes=bool(ops.get("fill_holes")),
            min_area_px=int(ops.get("min_area_px", 0)),
        )
        models = self.actions.models()
        targets = self.actions.service.settings.deadlines
        model = job.get("model_id")
        adapters = self._recalled_adapters(job) if model in models else None
        if model not in models:
            gr.Warning(
                f"no worker serves {model} now: the model choice and adapters are left as they were"
            )
        overlay, ratio_line = self._preview(
            record.id,
            canvas,
            form.invert,
            form.grow_px,
            form.feather_px,
            form.fill_holes,
            form.min_area_px,
            model,
            job.get("steps"),
            job.get("guidance"),
        )
        return (
            record.id,
            canvas,
            f"**{html.escape(record.name)}** · recalled from job {job['job_id'][:8]}",
            job.get("prompt", ""),
            job.get("negative_prompt", ""),
            model if model in models else gr.skip(),
            job.get("steps"),
            job.get("guidance"),
            job.get("strength"),
            False,
            job.get("seed"),
            form.invert,
            form.grow_px,
            form.feather_px,
            job.get("use_cache", True),
            form.fill_holes,
            form.min_area_px,
            job.get("inpaint_area") == "masked",
            job.get("crop_padding_px", 32),
            job.get("priority", 0),
            requested_deadline_s(job, targets.target_s(job.get("service_class") or "batch")),
            overlay,
            ratio_line,
            gr.update(
                selected_index=template_ids.index(record.id) if record.id in template_ids else None
            ),
            gr.Tabs(selected="editor"),
            *(adapters or unchanged(2 * self.actions.adapters.limits.max_per_request)),
        )
