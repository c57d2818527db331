"""The editor's Generate and what follows it: submit the form (with the adapter picker's choices),
follow the jobs' progress, show the finished edit (before/after, seed, model, adapters and the
step each joined at, stage timings), pick a variation, cancel, save the result, keep editing it.

A mixin of ``StudioPage``: it uses the page's ``actions``, the editor's components it is given,
and the other tabs' ``_gallery``, ``_on_canvas``, ``_picked_line`` and ``_picked_adapters``.
"""

from __future__ import annotations

import html

import gradio as gr

from studio.actions import EditForm, StudioActions, StudioError
from studio.components import FORM_FIELDS, NOTHING_PAINTED, handler, progress_html, user_of
from studio.deadlines import service_line


class ResultsView:
    actions: StudioActions

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
        fill_holes=False,
        min_area=0,
        masked_only=False,
        crop_padding=32,
        priority=0,
        deadline=0,
        mode="generate",
        adapters=(),
    ) -> EditForm:
        """The form of the editor's fields (``FORM_FIELDS``' values, in order). ``deadline``:
        seconds; 0 (or empty) for the interactive class's target."""
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
            fill_holes=bool(fill_holes),
            min_area_px=int(min_area or 0),
            mode=mode,
            inpaint_area="masked" if masked_only else "whole",
            crop_padding_px=int(crop_padding or 0),
            adapters=tuple(adapters),
            priority=int(priority or 0),
            deadline_s=float(deadline) if deadline else None,
        )

    @staticmethod
    def _result_outputs(ui: dict) -> list:
        """What shows one finished edit (``_shown``'s values, in order)."""
        names = ("compare", "info", "download", "reuse_seed", "keep_editing", "seed_used")
        return [ui[name] for name in names]

    def _wire_results(self, editor: dict, gallery: dict, template_ids, current, job_id) -> None:
        """Save and keep editing add a template: both galleries list it at once."""
        listings = [editor["gallery"], template_ids, gallery["gallery"], gallery["ids"]]
        editor["save"].click(
            self._save,
            [job_id, editor["save_name"], editor["search"]],
            [*listings, editor["save_name"]],
        )
        editor["keep_editing"].click(
            self._keep_editing,
            [job_id, editor["search"]],
            [
                *listings,
                current,
                editor["canvas"],
                editor["picked"],
                editor["overlay"],
                editor["ratio"],
            ],
            show_progress_on=[editor["picked"]],  # off the canvas (see StudioPage._canvas_column)
        )

    def _submit(self, request: gr.Request, template_id, canvas, variations, mode, *fields):
        """A generator: the job ids at once, then the progress each time it changes, then the
        results (the first variation shown, all of them to pick from). ``fields``: the form's
        (``FORM_FIELDS``), then the adapter picker's (``_picker_inputs``).
        (``request`` comes first: Gradio passes it only to a named positional parameter.)"""
        values, picks = fields[: len(FORM_FIELDS)], fields[len(FORM_FIELDS) :]
        form = self._form(*values, mode=mode, adapters=self._picked_adapters(picks))
        idle = (gr.skip(),) * 6
        # an erase has no seed to vary: one is enough
        count = 1 if mode == "erase" else int(variations or 1)
        try:
            jobs = self.actions.submit_variations(
                user_of(request), template_id, canvas, form, count
            )
        except StudioError as exc:
            gr.Warning(str(exc))
            yield (gr.skip(), gr.skip(), gr.skip(), *idle, gr.skip())
            return
        job_ids = [job.job_id for job in jobs]
        hidden = gr.update(visible=False)
        # the first update clears the last edit's result; later ones only move the progress
        cleared = (None, "", hidden, hidden, hidden, None, hidden)
        final: list = []
        shown = None
        # every slice: the forecast ("finish in ~4 s") counts down between the jobs' events
        for final in self.actions.follow_all(job_ids, every_slice=True):
            status = progress_html(final)
            if status == shown:
                continue
            shown = status
            yield (job_ids[0], job_ids, status, *cleared)
            cleared = (*idle, gr.skip())
        done = [p.job_id for p in final if p.status == "done"]
        if not done:
            return
        yield (
            done[0],
            gr.skip(),
            gr.skip(),
            *self._shown(done[0]),
            self._variants(done) if len(job_ids) > 1 else gr.update(visible=False),
        )

    def _variants(self, job_ids: list[str]):
        items = [
            (str(self.actions.result_path(job_id)), f"seed {self.actions.job(job_id)['seed']}")
            for job_id in job_ids
        ]
        return gr.update(value=items, visible=True, selected_index=0)

    def _shown(self, job_id: str) -> tuple:
        """A finished edit's before/after, its summary, and the buttons that act on it."""
        job = self.actions.job(job_id)
        result = str(self.actions.result_path(job_id))
        original = str(self.actions.image_path(job["template_id"]))
        timings = job.get("timings", {})
        stages = " · ".join(
            f"{stage} {timings[f'{stage}_s']:.2f} s"
            for stage in ("queue", "pre", "erase", "denoise", "post", "total")
            if f"{stage}_s" in timings
        )
        done = (
            "**Done.** Erased: filled from the surroundings (OpenCV Telea, no model)"
            if job.get("mode") == "erase"
            else f"**Done.** Seed used: `{job['seed']}` · model `{job['model_id']}` · "
            f"{job['steps']} steps"
        )
        adapters = self.actions.adapters.describe(job)
        if adapters:
            done += f" · adapters: {html.escape(adapters)}"
        level = html.escape(service_line(job))
        muted = " · ".join(part for part in (level, stages) if part)
        info = f"{done} · job `{job_id}`<br><span class='ms-muted'>{muted}</span>"
        shown = gr.update(visible=True)
        return (
            (original, result),
            info,
            gr.update(value=result, visible=True),
            shown,
            shown,
            job["seed"],
        )

    @handler(7)
    def _pick_variation(self, job_ids: list, evt: gr.SelectData):
        done = [job_id for job_id in job_ids if self.actions.job(job_id)["status"] == "done"]
        if evt is None or evt.index is None or evt.index >= len(done):
            raise StudioError("that variation is gone: generate again")
        return (done[evt.index], *self._shown(done[evt.index]))

    @handler()
    def _cancel(self, job_ids: list):
        return html.escape(self.actions.cancel_all(job_ids or []))

    @handler(5)
    def _save(self, job_id: str, name: str, query: str):
        if not job_id:
            raise StudioError("no result yet: generate an edit first")
        record = self.actions.save_result(job_id, name)
        gr.Info(f"Saved as template '{record.name}'")
        return (*self._gallery(query), *self._gallery(), "")

    @handler(9)
    def _keep_editing(self, job_id: str, query: str):
        if not job_id:
            raise StudioError("no result yet: generate an edit first")
        record = self.actions.keep_editing(job_id)
        _record, canvas = self._on_canvas(record.id)
        gr.Info(f"Editing the result of job {job_id[:8]}, saved as template '{record.name}'")
        # the canvas holds the job's result, ready to paint on at once; its cache comes later
        # (an edit submitted before it is recorded runs without it)
        picked = (
            f"**Result of job {job_id[:8]}** · saved as template {html.escape(record.name)} · "
            f"{record.width}x{record.height} · its cache is recorded in the background"
        )
        return (
            *self._gallery(query),
            *self._gallery(),
            record.id,
            canvas,
            picked,
            None,
            NOTHING_PAINTED,
        )
