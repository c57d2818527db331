"""The studio's History tab: the signed-in user's jobs; selecting one recalls it into the editor.

A mixin of ``StudioPage``: it uses the page's ``actions`` and the editor's components it is given.
"""

from __future__ import annotations

import datetime as dt
import html

import gradio as gr

from studio.actions import StudioActions, StudioError
from studio.components import HISTORY_HEADERS, handler, user_of


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
