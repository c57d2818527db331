"""The studio's LoRA adapters: the editor's picker and the Adapters tab.

* **Picker** (in the editor, under the model): ``adapters.max_per_request`` slots, each a dropdown
  of the tenant's adapters registered for the selected model (name, rank, size; "none" first) and
  a scale slider over ``[adapters.scale_min, adapters.scale_max]`` (1.0 by default). Choosing a
  model, or **Refresh adapters**, lists that model's adapters again; a slot keeps its adapter while
  the new list has it, else goes back to none. All slots none: the base model.
* **Adapters tab**: register a ``.safetensors`` file (the REST upload's own path: a CPU worker
  reads and validates it; with none answering the user sees the 503's message), list the tenant's
  adapters of every model, delete one with a confirmation. Both refresh the editor's picker.

A mixin of ``StudioPage``: it uses the page's ``actions`` and the editor's components it is given.
Every handler turns a ``StudioError`` into a warning toast (``components.handler``).
"""

from __future__ import annotations

import html

import gradio as gr

from studio.actions import StudioActions
from studio.adapter_actions import ADAPTER_HEADERS, NO_ADAPTER
from studio.components import handler
from studio.errors import StudioError

NONE_CHOICE = ("none", NO_ADAPTER)
SELECT_ADAPTER_HINT = "Select an adapter in the list to delete it."
SCALE_STEP = 0.05


class AdaptersTab:
    actions: StudioActions

    # ----- the editor's picker --------------------------------------------------------------------
    @property
    def _slots(self) -> int:
        return self.actions.adapters.limits.max_per_request

    def _adapter_picker(self, ui: dict) -> None:
        """The picker's components into ``ui``: ``adapter_slots`` (dropdowns), ``adapter_scales``
        (sliders), ``adapter_hint``, ``adapter_refresh``. Hidden when adapters are off
        (``max_per_request`` 0)."""
        limits = self.actions.adapters.limits
        ui["adapter_slots"], ui["adapter_scales"] = [], []
        with gr.Accordion(
            "Adapters (LoRA)", open=False, visible=self._slots > 0, elem_id="ms-adapter-picker"
        ):
            ui["adapter_hint"] = gr.Markdown("", elem_id="ms-adapter-hint")
            for slot in range(self._slots):
                with gr.Row(equal_height=True):
                    ui["adapter_slots"].append(
                        gr.Dropdown(
                            label=f"Adapter {slot + 1}",
                            choices=[NONE_CHOICE],
                            value=NO_ADAPTER,
                            scale=3,
                            elem_id=f"ms-adapter-{slot}",
                        )
                    )
                    ui["adapter_scales"].append(
                        gr.Slider(
                            limits.scale_min,
                            limits.scale_max,
                            value=1.0,
                            step=SCALE_STEP,
                            label="Scale",
                            scale=2,
                            elem_id=f"ms-adapter-scale-{slot}",
                        )
                    )
            ui["adapter_refresh"] = gr.Button(
                "Refresh adapters", size="sm", elem_id="ms-adapter-refresh"
            )

    @staticmethod
    def _picker_inputs(ui: dict) -> list:
        """The picker's values as ``_picked_adapters`` takes them: every slot, then every scale."""
        return [*ui["adapter_slots"], *ui["adapter_scales"]]

    def _picked_adapters(self, picks) -> tuple:
        """The ``AdapterChoice``s of ``_picker_inputs``' values."""
        slots = len(picks) // 2
        return self.actions.adapters.picked(picks[:slots], picks[slots:])

    def _wire_picker(self, ui: dict) -> None:
        for trigger in (ui["model"].change, ui["adapter_refresh"].click):
            trigger(
                self._adapter_options,
                [ui["model"], *ui["adapter_slots"]],
                [*ui["adapter_slots"], ui["adapter_hint"]],
                show_progress="hidden",
            )

    def _adapter_options(self, model, *chosen):
        """Every slot listing ``model``'s adapters (keeping its adapter while listed), and the
        picker's hint."""
        options = self.actions.adapters.choices(model or "")
        listed = {adapter_id for _label, adapter_id in options}
        slots = [
            gr.update(
                choices=[NONE_CHOICE, *options], value=value if value in listed else NO_ADAPTER
            )
            for value in chosen
        ]
        return (*slots, self._picker_hint(model, len(options)))

    def _picker_hint(self, model: str, count: int) -> str:
        if not model:
            return "Pick a model to see its adapters."
        if not count:
            return (
                f"No adapters for `{html.escape(model)}` yet: register one in the **Adapters** "
                "tab. Without one the base model paints."
            )
        limits = self.actions.adapters.limits
        return (
            f"{count} adapter{'s' if count > 1 else ''} for `{html.escape(model)}`: pick up to "
            f"{self._slots}, each with a scale ({limits.scale_min:g} to {limits.scale_max:g}); "
            "none is the base model."
        )

    def _recalled_adapters(self, job: dict) -> list:
        """The picker's slots and scales set to a recalled job's adapters (those that still
        exist; a warning names each that does not)."""
        ids, scales, gone = self.actions.adapters.recalled(job)
        for message in gone:
            gr.Warning(message)
        options = [NONE_CHOICE, *self.actions.adapters.choices(job.get("model_id", ""))]
        return [gr.update(choices=options, value=adapter_id) for adapter_id in ids] + scales

    # ----- the Adapters tab -----------------------------------------------------------------------
    def _adapters_tab(self, adapters_tab, editor: dict) -> dict:
        ui: dict = {"ids": gr.State([]), "selected": gr.State("")}
        limits = self.actions.adapters.limits
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=260):
                gr.Markdown("### Register an adapter")
                ui["file"] = gr.File(
                    label="LoRA .safetensors (diffusers/PEFT or kohya layout)",
                    file_count="single",
                    file_types=[".safetensors"],
                    elem_id="ms-adapter-file",
                )
                ui["name"] = gr.Textbox(
                    label="Name",
                    placeholder="(default: the file's name)",
                    elem_id="ms-adapter-name",
                )
                ui["model"] = gr.Dropdown(
                    label="Model it was trained for", choices=[], elem_id="ms-adapter-model"
                )
                ui["add"] = gr.Button(
                    "Register adapter", variant="primary", elem_id="ms-adapter-add"
                )
                gr.Markdown(
                    f"A CPU worker reads the file and checks it against the model's layers (up "
                    f"to {limits.ingest_timeout_s:g} s); files over {limits.max_mb:g} MB or above "
                    f"rank {limits.max_rank} are refused.",
                    elem_classes="ms-muted",
                )
            with gr.Column(scale=3):
                ui["refresh"] = gr.Button("Refresh", size="sm")
                ui["table"] = gr.Dataframe(
                    headers=ADAPTER_HEADERS, interactive=False, wrap=True, elem_id="ms-adapters"
                )
                ui["details"] = gr.Markdown(SELECT_ADAPTER_HINT, elem_id="ms-adapter-details")
                ui["delete"] = gr.Button("Delete…", variant="stop", elem_id="ms-adapter-delete")
                with gr.Row(visible=False) as ui["confirm_row"]:
                    ui["confirm_text"] = gr.Markdown("")
                    ui["confirm"] = gr.Button(
                        "Yes, delete it", variant="stop", elem_id="ms-adapter-confirm"
                    )
                    ui["keep"] = gr.Button("Keep it")
        self._wire_adapters_tab(ui, adapters_tab, editor)
        return ui

    def _wire_adapters_tab(self, ui: dict, adapters_tab, editor: dict) -> None:
        listing = [ui["table"], ui["ids"]]
        picker = {
            "fn": self._adapter_options,
            "inputs": [editor["model"], *editor["adapter_slots"]],
            "outputs": [*editor["adapter_slots"], editor["adapter_hint"]],
            "show_progress": "hidden",
        }
        for trigger in (adapters_tab.select, ui["refresh"].click):
            trigger(self._adapter_rows, None, listing)
        # a registration waits on a CPU worker: other events go on meanwhile
        ui["add"].click(
            self._register,
            [ui["file"], ui["name"], ui["model"]],
            [*listing, ui["file"], ui["name"]],
            concurrency_limit=None,
        ).then(**picker)
        ui["table"].select(self._select_adapter, [ui["ids"]], [ui["selected"], ui["details"]])
        ui["delete"].click(
            self._ask_delete_adapter, [ui["selected"]], [ui["confirm_row"], ui["confirm_text"]]
        )
        ui["keep"].click(lambda: gr.update(visible=False), None, [ui["confirm_row"]])
        ui["confirm"].click(
            self._delete_adapter,
            [ui["selected"]],
            [*listing, ui["selected"], ui["details"], ui["confirm_row"]],
        ).then(**picker)

    def _adapter_rows(self):
        return self.actions.adapters.rows()

    @handler(4)
    def _register(self, file, name, model):
        record = self.actions.adapters.register(file, name, model)
        gr.Info(
            f"Registered '{record.name}' for {record.model_id} (rank {record.rank}, "
            f"{record.num_pairs} layers): pick it in the editor"
        )
        return (*self._adapter_rows(), None, "")

    @handler(2)
    def _select_adapter(self, ids: list, evt: gr.SelectData):
        row = evt.index[0] if evt is not None and isinstance(evt.index, (list, tuple)) else None
        if row is None or row >= len(ids):
            raise StudioError("that adapter is no longer in the list: refresh it")
        record = self.actions.adapters.get(ids[row])
        kinds = ", ".join(f"{kind} ×{count}" for kind, count in record.targets.items())
        details = (
            f"**{html.escape(record.name)}** · {html.escape(record.model_id)} · rank "
            f"{record.rank} · {record.num_pairs} layers<br><span class='ms-muted'>"
            f"{html.escape(kinds)}</span>"
        )
        return record.adapter_id, details

    @handler(2)
    def _ask_delete_adapter(self, adapter_id):
        record = self.actions.adapters.get(adapter_id)
        return gr.update(visible=True), (
            f"Delete **{html.escape(record.name)}**? This cannot be undone."
        )

    @handler(5)
    def _delete_adapter(self, adapter_id):
        name = self.actions.adapters.delete(adapter_id)
        gr.Info(f"Deleted adapter '{name}'")
        return (*self._adapter_rows(), "", SELECT_ADAPTER_HINT, gr.update(visible=False))
