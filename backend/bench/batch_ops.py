"""`maskserve bench batch-ops`: what one denoising step costs as its batch grows, in the two forms
of one engine setting side by side (``--compare``):

* ``attention``: the rows' attention grouped per request or padded into one call per layer
  (``EngineSettings.attention``);
* ``lora``: each request carrying its own LoRA adapters (``--adapters`` each, ranks drawn as the
  adapters bench's catalogue, on every attention projection), their deltas grouped per adapter or
  stacked into three operators per layer (``EngineSettings.lora_batching``).

For 1, 2, 4, 8 ... requests (each its own template, mask and seed, every row reading its
template's cache from host RAM, as a worker serves hot templates) and each form, in one process:
the aten operators one step dispatches (counted with ``torch.profiler``; a device bound by
launching operators, as a GPU running these models is, spends its step launching them) and the
step's median seconds (synchronised on CUDA; the two forms' steps interleaved, so that the
machine's drift falls on both alike). Masks are blobs with ratios drawn from Beta(2, 16) (mean
0.11, as the serving benchmarks' traces), so the requests' token counts differ and padding has
work to add.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from backend.bench.adapter_catalog import (
    DEFAULT_RANK_SHARES,
    DEFAULT_RANKS,
    attention_layers,
    random_adapter,
)
from backend.bench.engine_bench import cache_params, device_name, hot_cache
from backend.bench.route_deadlines import save_beside
from backend.engine.attention import pads_attention
from backend.engine.editor import EditParams, EditState, MaskAwareEngine
from backend.imaging.masks import synthetic_mask
from backend.models import load_pipeline, resolve_model
from templates_store.samples import sample_template

# the engine setting each comparison varies, and its two forms
COMPARED = {
    "attention": ("attention", ("grouped", "padded")),
    "lora": ("lora_batching", ("grouped", "stacked")),
}
PROMPT = "a red leather armchair"


@dataclass(frozen=True)
class BatchOpsRecord:
    model: str
    resolution: int
    mode: str
    attention: str
    requests: int
    rows: int  # the requests' CFG halves
    operators: int  # aten operators dispatched by one step
    step_s: float  # median over the repeats
    device: str
    device_name: str
    dtype: str
    compare: str = "attention"  # the setting whose form this record ran (``COMPARED``)
    lora_batching: str = "grouped"
    adapters: int = 0  # per request

    @property
    def form(self) -> str:
        return getattr(self, COMPARED[self.compare][0])


def _count_operators(engine: MaskAwareEngine, states: list[EditState], mode: str) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.step(states, mode)
    return sum(1 for event in profile.events() if event.name.startswith("aten::"))


def _step_seconds(engine, setting: str, states_by_form: dict, mode: str, repeats: int, device: str):
    """Median seconds of a step in each form, the forms' steps interleaved (ABBA...) so that the
    machine's drift falls on both alike."""
    seconds: dict[str, list[float]] = {form: [] for form in states_by_form}
    forms = list(states_by_form)
    for repeat in range(repeats):
        for form in forms if repeat % 2 == 0 else forms[::-1]:
            setattr(engine, setting, form)
            started = time.perf_counter()
            engine.step(states_by_form[form], mode)
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            seconds[form].append(time.perf_counter() - started)
    return {form: statistics.median(values) for form, values in seconds.items()}


def _request_adapters(engine: MaskAwareEngine, model_id: str, requests: int, per_request: int):
    """Each request's own ``per_request`` adapters (resident on the engine), (id, scale) pairs."""
    if per_request == 0:
        return [()] * requests
    layers = attention_layers(model_id)
    rng = np.random.default_rng(0)
    shares = np.asarray(DEFAULT_RANK_SHARES) / sum(DEFAULT_RANK_SHARES)
    chosen = []
    for request in range(requests):
        pairs = []
        for k in range(per_request):
            adapter_id, rank = f"r{request}-{k}", int(rng.choice(DEFAULT_RANKS, p=shares))
            seed = request * per_request + k  # each adapter its own weights
            engine.adapters.put(random_adapter(layers, adapter_id, rank, seed=seed))
            pairs.append((adapter_id, float(rng.uniform(0.6, 1.0))))
        chosen.append(tuple(pairs))
    return chosen


def hot_batch(
    model_id: str,
    count: int,
    models_dir: Path,
    cache_dir: Path,
    size: int | None,
    mode: str,
    steps: int,
    device: str,
    dtype: torch.dtype,
) -> tuple[MaskAwareEngine, EditParams, list, list, list]:
    """The engine, the edits' parameters and ``count`` requests' templates, masks (blobs, ratios
    from Beta(2, 16): mean 0.11) and template caches resident in host RAM (recorded when
    missing), as a worker serves hot templates."""
    spec = resolve_model(model_id)
    size = size or spec.default_resolution
    engine = MaskAwareEngine(load_pipeline(model_id, models_dir, device, dtype), spec, cache_dir)
    params = cache_params(spec, size, steps, mode)
    templates = [sample_template(size, size, seed=7 + i) for i in range(count)]
    ratios = np.random.default_rng(0).beta(2, 16, count).clip(0.03, 0.6)
    masks = [
        Image.fromarray(
            synthetic_mask(size, size, float(r), seed=11 + i, kind="blob").astype(np.uint8) * 255
        )
        for i, r in enumerate(ratios)
    ]
    caches = [
        hot_cache(engine, template, params, device)
        for template in tqdm(templates, desc="template caches", unit="template")
    ]
    return engine, params, templates, masks, caches


def run_batch_ops(
    model_id: str,
    requests: list[int],
    models_dir: Path,
    cache_dir: Path,
    size: int | None = None,
    mode: str = "kv",
    steps: int = 20,
    repeats: int = 5,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    compare: str = "attention",
    adapters: int | None = None,
) -> list[BatchOpsRecord]:
    """``adapters`` per request: default 2 when comparing the LoRA forms, else 0."""
    if steps < repeats + 2:  # a warm-up step, the counted one, then the timed ones
        raise ValueError(f"--steps {steps} is too few to time {repeats} steps: use {repeats + 2}+")
    if compare not in COMPARED:
        raise ValueError(f"--compare must be one of {', '.join(COMPARED)}, got {compare!r}")
    per_request = (2 if compare == "lora" else 0) if adapters is None else adapters
    if compare == "lora" and per_request < 1:
        raise ValueError("--compare lora needs --adapters 1 or more per request")
    setting, forms = COMPARED[compare]
    engine, params, templates, masks, caches = hot_batch(
        model_id, max(requests), models_dir, cache_dir, size, mode, steps, device, dtype
    )
    most = len(templates)
    chosen = _request_adapters(engine, model_id, most, per_request)
    records = []
    for count in tqdm(requests, desc=f"bench batch-ops {model_id}", unit="batch"):
        states_by_form, operators = {}, {}
        for form in forms:
            setattr(engine, setting, form)
            states_by_form[form] = [
                engine.start(
                    templates[i], masks[i], PROMPT, i, params, cache=caches[i], adapters=chosen[i]
                )
                for i in range(count)
            ]
            engine.step(states_by_form[form], mode)  # warm-up (layouts, allocator, stacks)
            operators[form] = _count_operators(engine, states_by_form[form], mode)
        step_s = _step_seconds(engine, setting, states_by_form, mode, repeats, device)
        for form in forms:
            setattr(engine, setting, form)
            records.append(
                BatchOpsRecord(
                    model=model_id,
                    resolution=params.size[0],
                    mode=mode,
                    attention=attention_form(engine.attention, device),
                    requests=count,
                    rows=sum(s.req.halves for s in states_by_form[form]),
                    operators=operators[form],
                    step_s=step_s[form],
                    device=device,
                    device_name=device_name(device),
                    dtype=str(dtype).removeprefix("torch."),
                    compare=compare,
                    lora_batching=engine.lora_batching,
                    adapters=per_request,
                )
            )
    return records


def attention_form(choice: str, device: str) -> str:
    """The attention form an engine set to ``choice`` runs on ``device`` (``auto``: padded on
    CUDA)."""
    return "padded" if pads_attention(choice, torch.device(device)) else "grouped"


def write_batch_ops(records: list[BatchOpsRecord], json_path: Path) -> Path:
    """The records as JSON and a PNG beside them: operators and step time against requests."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps([asdict(r) for r in records], indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = records[0]
    setting, forms = COMPARED[first.compare]
    fig, (ops_ax, time_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
    for form in forms:
        mine = sorted((r for r in records if r.form == form), key=lambda r: r.requests)
        counts = [r.requests for r in mine]
        ops_ax.plot(counts, [r.operators for r in mine], marker="o", label=form)
        time_ax.plot(counts, [1e3 * r.step_s for r in mine], marker="o", label=form)
    ops_ax.set_ylabel("aten operators per step")
    time_ax.set_ylabel("step ms (median)")
    for ax in (ops_ax, time_ax):
        ax.set_xlabel("requests in the batch")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    adapters = f", {first.adapters} adapters a request" if first.adapters else ""
    fig.suptitle(
        f"{first.model} {first.resolution} px, {first.mode} cache{adapters}: one step as the "
        f"batch grows, {setting} forms ({first.device_name} {first.dtype})",
        fontsize=9,
    )
    return save_beside(fig, json_path)


def summary_lines(records: list[BatchOpsRecord]) -> list[str]:
    """One line per batch size: both forms side by side, the second against grouped."""
    other = COMPARED[records[0].compare][1][1]
    by_key = {(r.requests, r.form): r for r in records}
    lines = []
    for count in sorted({r.requests for r in records}):
        grouped, second = by_key[(count, "grouped")], by_key[(count, other)]
        lines.append(
            f"{count:3d} requests ({grouped.rows} rows): operators grouped {grouped.operators} "
            f"{other} {second.operators} (x{grouped.operators / second.operators:.2f} fewer); "
            f"step grouped {1e3 * grouped.step_s:.1f} ms {other} {1e3 * second.step_s:.1f} ms "
            f"(x{grouped.step_s / second.step_s:.2f})"
        )
    return lines
