"""`maskserve bench step-trace`: where one denoising step's time goes on this device, the model's
own dense step (what the ordinary pipeline runs at every step) against the mask-aware step that
reads its template's cache, for batches of 1, 2, 4 ... requests.

The requests are ``batch_ops.hot_batch``'s (their own templates, blob masks of mean ratio 0.11,
caches resident in host RAM). Per (requests, arm), in one process, the arms' steps interleaved:

* ``step_s``: the step's median wall seconds (``MaskAwareEngine.step`` waits for the device);
* ``operators``: the aten operators it dispatches (the host's share: each is a launch on a GPU);
* on CUDA, from ``torch.profiler``'s device timeline of one more step: ``kernels`` launched,
  ``compute_s`` (the union of the kernels' intervals: the device computing), ``copy_s`` (of the
  host -> device copies: the cache's loads), ``copy_hidden_s`` (copy time under compute: what the
  side-stream pipeline hides), ``busy_s`` (either) and ``idle_share`` (1 - busy / wall: a step
  bound by launching its operators leaves the device idle while the host launches them).

On a CPU the device fields stay 0: there the step is host work (``step_s``, ``operators``).
``--trace DIR`` also writes each profiled step's Chrome trace (``chrome://tracing``, Perfetto).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from backend.bench.batch_ops import PROMPT, attention_form, hot_batch
from backend.bench.engine_bench import device_name
from backend.bench.route_deadlines import save_beside
from backend.engine.attention import check_attention_batching
from backend.engine.editor import EditState, MaskAwareEngine

ARMS = ("dense", "cached")
COPY_PREFIX = "Memcpy HtoD"  # the profiler's name of a host -> device copy on the device


@dataclass(frozen=True)
class StepTraceRecord:
    model: str
    resolution: int
    mode: str
    attention: str  # the rows' attention: grouped per request or padded into one call
    requests: int
    rows: int  # the requests' CFG halves
    arm: str  # dense: the model's own step; cached: the mask-aware step reading the cache
    step_s: float  # median wall seconds over the repeats
    operators: int  # aten operators dispatched by one step
    kernels: int  # device kernels launched by one step (0 on a CPU)
    compute_s: float  # the device computing (union of kernel intervals)
    copy_s: float  # host -> device copies (union of their intervals)
    copy_hidden_s: float  # copy time during which the device also computed
    busy_s: float  # computing or copying
    idle_share: float  # 1 - busy_s / the profiled step's wall (0 on a CPU)
    device: str
    device_name: str
    dtype: str


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals (seconds)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def overlap_s(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Seconds in both unions: |A| + |B| - |A or B|."""
    return max(0.0, union_s(a) + union_s(b) - union_s([*a, *b]))


def _device_kind(event) -> str:
    """What a device event is: ``kernel``, ``gpu_memcpy`` or something else (a memset, a
    synchronisation, profiler overhead), from the profiler's activity type where it gives one,
    else from the event's name."""
    kind = getattr(event, "activity_type", None)
    if kind:
        return str(kind)
    if event.name.startswith("Memcpy"):
        return "gpu_memcpy"
    if event.name.startswith("Memset") or "Sync" in event.name:
        return "other"
    return "kernel"


def device_times(events: Iterable, wall_s: float) -> dict[str, float]:
    """The device fields of a record from a profile's events (each with ``name``,
    ``device_type``, ``time_range`` in microseconds and, where the profiler gives it,
    ``activity_type``): kernels computing; host -> device copies as ``copy``; memsets,
    synchronisations (device time spent waiting) and other copies in neither."""
    kernels, copies = [], []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        kind = _device_kind(event)
        if kind == "kernel":
            kernels.append(span)
        elif kind == "gpu_memcpy" and event.name.startswith(COPY_PREFIX):
            copies.append(span)
    busy = union_s([*kernels, *copies])
    return {
        "kernels": len(kernels),
        "compute_s": union_s(kernels),
        "copy_s": union_s(copies),
        "copy_hidden_s": overlap_s(kernels, copies),
        "busy_s": busy,
        "idle_share": max(0.0, 1.0 - busy / wall_s) if kernels and wall_s > 0 else 0.0,
    }


def _profiled(engine: MaskAwareEngine, states: list[EditState], mode: str, trace: Path | None):
    """(aten operators, device fields) of one step, its Chrome trace to ``trace``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and states[0].latents.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        started = time.perf_counter()
        engine.step(states, mode)
        wall_s = time.perf_counter() - started
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(trace))
    events = profile.events()
    operators = sum(1 for e in events if e.name.startswith("aten::"))
    return operators, device_times(events, wall_s)


def run_step_trace(
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
    trace_dir: Path | None = None,
    attention: str = "auto",
) -> list[StepTraceRecord]:
    """``attention``: the engine's form (``EngineSettings.attention``; auto: padded on CUDA,
    grouped on a CPU)."""
    if not requests or min(requests) < 1:
        raise ValueError(f"--requests: positive counts, got {requests}")
    if steps < repeats + 2:  # a warm-up step, the profiled one, then the timed ones
        raise ValueError(f"--steps {steps} is too few to time {repeats} steps: use {repeats + 2}+")
    check_attention_batching(attention)
    engine, params, templates, masks, caches = hot_batch(
        model_id, max(requests), models_dir, cache_dir, size, mode, steps, device, dtype
    )
    engine.attention = attention
    records = []
    for count in tqdm(requests, desc=f"bench step-trace {model_id}", unit="batch"):
        states = {
            arm: [
                engine.start(
                    templates[i],
                    masks[i],
                    PROMPT,
                    i,
                    params,
                    cache=caches[i] if arm == "cached" else None,
                )
                for i in range(count)
            ]
            for arm in ARMS
        }
        profiled = {}
        for arm in ARMS:
            engine.step(states[arm], mode)  # warm-up (layouts, allocator)
            trace = trace_dir / f"{model_id}-{count}-{arm}.json" if trace_dir else None
            profiled[arm] = _profiled(engine, states[arm], mode, trace)
        timed: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for repeat in range(repeats):  # ABBA: the machine's drift falls on both arms alike
            for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                started = time.perf_counter()
                engine.step(states[arm], mode)
                timed[arm].append(time.perf_counter() - started)
        for arm in ARMS:
            operators, fields = profiled[arm]
            records.append(
                StepTraceRecord(
                    model=model_id,
                    resolution=params.size[0],
                    mode=mode,
                    attention=attention_form(attention, device),
                    requests=count,
                    rows=sum(s.req.halves for s in states[arm]),
                    arm=arm,
                    step_s=statistics.median(timed[arm]),
                    operators=operators,
                    device=device,
                    device_name=device_name(device),
                    dtype=str(dtype).removeprefix("torch."),
                    **fields,  # type: ignore[arg-type]
                )
            )
    return records


def write_step_trace(records: list[StepTraceRecord], json_path: Path) -> Path:
    """The records as JSON and a PNG beside them: each arm's step, split on a GPU into the device
    computing, copying alone and idle."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps([asdict(r) for r in records], indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{r.requests} {r.arm}" for r in records]
    wall = [1e3 * r.step_s for r in records]
    if any(r.kernels for r in records):
        compute = [1e3 * r.compute_s for r in records]
        copy_alone = [1e3 * (r.copy_s - r.copy_hidden_s) for r in records]
        rest = [max(0.0, w - c - k) for w, c, k in zip(wall, compute, copy_alone, strict=True)]
        ax.bar(labels, compute, label="device computing")
        ax.bar(labels, copy_alone, bottom=compute, label="copying only")
        ax.bar(
            labels,
            rest,
            bottom=[c + k for c, k in zip(compute, copy_alone, strict=True)],
            label="device idle",
        )
        ax.legend(fontsize=8)
    else:
        ax.bar(labels, wall)
    first = records[0]
    ax.set_ylabel("step ms (median)")
    ax.set_xlabel("requests, arm")
    ax.tick_params(axis="x", labelsize=7, rotation=30)
    ax.set_title(
        f"{first.model} {first.resolution} px, {first.mode} cache, {first.attention} attention: "
        f"dense step against cached ({first.device_name} {first.dtype})",
        fontsize=9,
    )
    return save_beside(fig, json_path)


def summary_lines(records: list[StepTraceRecord]) -> list[str]:
    """One line per batch size: the two arms side by side."""
    by_key = {(r.requests, r.arm): r for r in records}
    lines = []
    for count in sorted({r.requests for r in records}):
        dense, cached = by_key[(count, "dense")], by_key[(count, "cached")]
        line = (
            f"{count:3d} requests: step dense {1e3 * dense.step_s:.1f} ms cached "
            f"{1e3 * cached.step_s:.1f} ms (x{dense.step_s / cached.step_s:.2f}); operators "
            f"{dense.operators} / {cached.operators}"
        )
        if dense.kernels or cached.kernels:
            line += "".join(
                f"; {r.arm}: {r.kernels} kernels, computing {1e3 * r.compute_s:.1f} ms, copies "
                f"{1e3 * r.copy_s:.1f} ms ({1e3 * r.copy_hidden_s:.1f} hidden), idle "
                f"{r.idle_share:.0%}"
                for r in (dense, cached)
            )
        lines.append(line)
    return lines
