"""The studio's Batches tab: one gallery template edited with several uploaded masks in one go
(one item per mask, run together on one worker), and the signed-in user's batches with their
progress, overall and per item, followed live until every item finished; cancel a batch.

A mixin of ``StudioPage``: it uses the page's ``batches`` (``studio.batch_actions``) and
``actions``.
"""

from __future__ import annotations

import html

import gradio as gr

from studio.actions import StudioActions
from studio.batch_actions import (
    BATCH_HEADERS,
    ITEM_HEADERS,
    BatchForm,
    StudioBatches,
    batch_rows,
    item_rows,
    seed_of,
    summary_line,
)
from studio.components import handler, unchanged, user_of
from studio.errors import StudioError

VIEW_OUTPUTS = 5  # batch id, summary, progress bar, item table, results


def progress_bar(batch: dict) -> str:
    return (
        f'<div id="ms-batch-progress"><progress value="{batch["progress"]:.4f}" max="1">'
        f"</progress><div>{html.escape(batch['status'])}</div></div>"
    )


class BatchesTab:
    actions: StudioActions
    batches: StudioBatches

    def _batches_tab(self, tab) -> None:
        batch_id, listed = gr.State(""), gr.State([])
        gr.Markdown(
            "Edit one template with many masks at once: one item per mask, run together.",
            elem_classes="ms-muted",
        )
        with gr.Row(equal_height=False):
            template = gr.Dropdown(label="Template", choices=[], elem_id="ms-batch-template")
            masks = gr.File(
                label="Masks (one item per file; white = repaint)",
                file_count="multiple",
                file_types=["image"],
                elem_id="ms-batch-masks",
            )
            with gr.Column():
                prompt = gr.Textbox(label="Prompt", lines=2, elem_id="ms-batch-prompt")
                with gr.Row():
                    steps = gr.Number(label="Steps (0: the model's)", value=0, precision=0)
                    # a text box: a number box shows (and sends) 0 when empty, and 0 is a seed
                    seed = gr.Textbox(
                        label="Seed (empty: random seeds)",
                        placeholder="random",
                        elem_id="ms-batch-seed",
                    )
                submit = gr.Button("Submit batch", variant="primary", elem_id="ms-batch-submit")
        summary = gr.Markdown("", elem_id="ms-batch-summary")
        bar = gr.HTML("")
        items = gr.Dataframe(headers=ITEM_HEADERS, interactive=False, elem_id="ms-batch-items")
        results = gr.Gallery(label="Results", columns=8, height=200, elem_id="ms-batch-results")
        with gr.Row():
            refresh = gr.Button("Refresh")
            cancel = gr.Button("Cancel batch", variant="stop", elem_id="ms-batch-cancel")
        table = gr.Dataframe(headers=BATCH_HEADERS, interactive=False, elem_id="ms-batches")
        view = [batch_id, summary, bar, items, results]
        for trigger in (tab.select, refresh.click):
            trigger(self._batch_list, None, [table, listed, template])
        # following a batch lasts until it finishes: it must not hold one of the queue's workers;
        # the list shows the new batch as soon as it is submitted
        inputs = [template, masks, prompt, steps, seed]
        submit.click(self._submit_batch, inputs, [*view, table, listed], concurrency_limit=None)
        table.select(self._follow_selected, [listed], view, concurrency_limit=None)
        cancel.click(self._cancel_batch, [batch_id], [summary], concurrency_limit=None)

    @handler(3)
    def _batch_list(self, request: gr.Request):
        """The user's batches (table rows and their ids) and the templates to pick from."""
        choices = [(record.name, record.id) for record in self.actions.gallery()]
        return *self._listing(user_of(request)), gr.update(choices=choices)

    def _listing(self, user: str) -> tuple[list, list]:
        """The user's batches: table rows and their ids."""
        batches = self.batches.list(user)
        return batch_rows(batches), [b["batch_id"] for b in batches]

    def _submit_batch(self, template_id, masks, prompt, steps, seed, request: gr.Request):
        """The view of the submitted batch at every change (``_follow``), the first time with the
        list of batches that now holds it."""
        try:
            form = BatchForm(
                template_id=template_id or "",
                masks=tuple(masks or ()),
                prompt=prompt or "",
                steps=int(steps) if steps else None,
                seed=seed_of(seed),
            )
            submitted = self.batches.submit(user_of(request), form)
        except StudioError as exc:
            gr.Warning(str(exc))
            yield unchanged(VIEW_OUTPUTS + 2)
            return
        listing = self._listing(user_of(request))
        for view in self._follow(submitted.batch_id):
            yield (*view, *listing)
            listing = (gr.skip(), gr.skip())

    def _follow_selected(self, listed: list, evt: gr.SelectData):
        row = evt.index[0] if evt is not None and isinstance(evt.index, (list, tuple)) else None
        if row is None or row >= len(listed):
            gr.Warning("that batch is no longer listed: refresh the list")
            yield unchanged(VIEW_OUTPUTS)
            return
        yield from self._follow(listed[row])

    def _follow(self, batch_id: str):
        """The batch's view, again at every change until every item finished."""
        try:
            for batch in self.batches.follow(batch_id):
                yield (
                    batch_id,
                    summary_line(batch),
                    progress_bar(batch),
                    item_rows(batch),
                    self.batches.thumbnails(batch),
                )
        except StudioError as exc:
            gr.Warning(str(exc))
            yield unchanged(VIEW_OUTPUTS)

    @handler(1)
    def _cancel_batch(self, batch_id: str):
        if not batch_id:
            raise StudioError("no batch shown: submit one or pick one from the list")
        return self.batches.cancel(batch_id)
