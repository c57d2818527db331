"""`maskserve bench launch-proxy`: a CPU proxy of the launch-bound GPU regime.

On a GPU these models' steps are bound by the host launching operators, not by compute
(docs/bench/gpu-h200.md). A tiny model's forward at 64 px on a CPU is bound the same way: many
small operators, each costing more in dispatch than in arithmetic. For each model, at ``rows``
denoiser rows (requests = rows / the model's rows per request), on the inputs of a real first step
of the ordinary pipeline:

* the ordinary denoiser forward eager and under ``torch.compile`` (inductor; the arm
  ``ordinary-compiled`` of `bench engine`): median ms over ``repeats`` calls, the aten operators
  one call dispatches (``torch.profiler``), the seconds the first compiled call took (compiling),
  and the compiled output's largest |difference| from eager;
* the mask-aware step (engine ``step``: forward, guidance and scheduler update) at mask ratio
  ``mask_ratio``, every row reading its template's ``kv`` cache from host RAM, eager: the time and
  operators a compiled mask-aware step is held against.

It is a benchmark, not a test: figures depend on the machine.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from backend.bench.engine_arms import (
    PROMPT,
    check_compiled,
    compile_denoiser,
    default_compile_mode,
    denoiser_inputs,
    plain_pipeline,
)
from backend.bench.engine_bench import cache_params, device_name, hot_cache, make_batch
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.families import ADAPTERS
from backend.models import load_pipeline, resolve_model
from templates_store.samples import sample_template

PROXY_MODELS = ("tiny-sd2-inpaint", "tiny-sdxl-inpaint", "tiny-flux-fill")
PROXY_STEPS = 8  # steps of the recorded cache; the mask-aware step restarts its edits when done


@dataclass(frozen=True)
class ProxyRecord:
    model: str
    size: int
    rows: int
    requests: int
    eager_ms: float  # ordinary denoiser forward
    compiled_ms: float
    speedup: float  # eager_ms / compiled_ms
    eager_operators: int  # aten operators one forward dispatches
    compiled_operators: int
    compile_s: float  # the first compiled call
    max_abs_difference: float  # compiled vs eager output
    reference_max_abs: float
    maskaware_step_ms: float  # eager mask-aware step at mask_ratio
    maskaware_operators: int
    mask_ratio: float
    measured_mask_ratio: float  # fresh tokens / all tokens on the model's token grid
    compile_mode: str
    device_name: str
    threads: int
    torch: str


def aten_operators(run: Callable[[], object]) -> int:
    """The aten operators one call of ``run`` dispatches (``torch.profiler``, CPU activity)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return sum(1 for event in profile.events() if event.name.startswith("aten::"))


def median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def probe_model(
    model_id: str,
    models_dir: Path,
    cache_dir: Path,
    size: int,
    rows: int,
    repeats: int,
    mask_ratio: float,
    compile_mode: str,
    progress: tqdm,
) -> ProxyRecord:
    spec = resolve_model(model_id)
    per_request = spec.traits.rows_per_request
    if rows % per_request:
        raise ValueError(f"--rows: {model_id} takes {per_request} rows a request, got {rows}")
    requests = rows // per_request
    pipe = load_pipeline(model_id, models_dir)
    plain = plain_pipeline(pipe, spec)  # before the engine hooks the denoiser it keeps
    engine = MaskAwareEngine(pipe, spec, cache_dir)
    template = sample_template(size, size, seed=7)
    batch = make_batch(template, mask_ratio, requests, seed=1)
    params = EditParams(steps=PROXY_STEPS, guidance=spec.default_guidance, size=(size, size))
    args, kwargs = denoiser_inputs(plain, spec, params, batch)
    eager = getattr(plain, ADAPTERS[spec.family].denoiser_name)
    compiled = compile_denoiser(eager, compile_mode)

    def forward(module) -> Callable[[], object]:
        return lambda: module(*args, **kwargs)

    progress.set_postfix_str(f"{model_id}: compiling")
    with torch.no_grad():
        started = time.perf_counter()
        compiled(*args, **kwargs)
        compile_s = time.perf_counter() - started
        check = check_compiled(eager, compiled, (args, kwargs), torch.float32)
        progress.set_postfix_str(f"{model_id}: timing forwards")
        eager_ms = median_ms(forward(eager), repeats)
        compiled_ms = median_ms(forward(compiled), repeats)
        eager_operators = aten_operators(forward(eager))
        compiled_operators = aten_operators(forward(compiled))
    progress.set_postfix_str(f"{model_id}: mask-aware step")
    step_ms, step_operators, measured = _maskaware_step(engine, spec, batch, size, repeats)
    return ProxyRecord(
        model=model_id,
        size=size,
        rows=rows,
        requests=requests,
        eager_ms=eager_ms,
        compiled_ms=compiled_ms,
        speedup=eager_ms / compiled_ms,
        eager_operators=eager_operators,
        compiled_operators=compiled_operators,
        compile_s=compile_s,
        max_abs_difference=check.max_abs_difference,
        reference_max_abs=check.reference_max_abs,
        maskaware_step_ms=step_ms,
        maskaware_operators=step_operators,
        mask_ratio=mask_ratio,
        measured_mask_ratio=measured,
        compile_mode=compile_mode,
        device_name=device_name("cpu"),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
    )


def _maskaware_step(engine, spec, batch, size: int, repeats: int) -> tuple[float, int, float]:
    """Median ms and aten operators of one mask-aware step of the batch's requests (kv cache in
    host RAM), and their mean measured mask ratio."""
    params = cache_params(spec, size, PROXY_STEPS, "kv")
    cache = hot_cache(engine, batch.template, params, "cpu")

    def start() -> list:
        return [
            engine.start(batch.template, mask, PROMPT, seed, params, cache=cache, pixels=pixels)
            for mask, seed, pixels in zip(batch.masks, batch.seeds, batch.pixels, strict=True)
        ]

    states = start()
    measured = sum(s.mask_ratio for s in states) / len(states)

    times = []
    for _ in range(repeats):
        if states[0].done:
            states = start()  # outside the clock: a new edit's encoding is no step
        started = time.perf_counter()
        engine.step(states, "kv")
        times.append((time.perf_counter() - started) * 1000)
    if states[0].done:
        states = start()
    operators = aten_operators(lambda: engine.step(states, "kv"))
    return statistics.median(times), operators, measured


def run_launch_proxy(
    models: tuple[str, ...],
    models_dir: Path,
    cache_dir: Path,
    size: int = 64,
    rows: int = 2,
    repeats: int = 20,
    mask_ratio: float = 0.2,
    compile_mode: str | None = None,
) -> list[ProxyRecord]:
    mode = compile_mode or default_compile_mode("cpu")
    records = []
    with tqdm(models, desc="launch proxy", unit="model") as progress:
        for model_id in progress:
            records.append(
                probe_model(
                    model_id, models_dir, cache_dir, size, rows, repeats, mask_ratio, mode, progress
                )
            )
    return records


def write_launch_proxy(records: list[ProxyRecord], json_path: Path) -> Path:
    """The JSON records and a PNG beside them: per model, ms of the eager and compiled ordinary
    forward and of the eager mask-aware step (left), and their aten operators (right)."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps([asdict(r) for r in records], indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    bars = (
        ("ordinary forward, eager", "eager_ms", "eager_operators"),
        ("ordinary forward, compiled", "compiled_ms", "compiled_operators"),
        ("mask-aware step, eager", "maskaware_step_ms", "maskaware_operators"),
    )
    width = 0.8 / len(bars)
    for index, (label, ms, operators) in enumerate(bars):
        places = [m + index * width for m in range(len(records))]
        left.bar(places, [getattr(r, ms) for r in records], width, label=label)
        right.bar(places, [getattr(r, operators) for r in records], width, label=label)
    for ax, ylabel in ((left, "ms per call (median)"), (right, "aten operators per call")):
        ax.set_xticks([m + width for m in range(len(records))], [r.model for r in records])
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    first = records[0]
    fig.suptitle(
        f"CPU launch proxy: {first.size} px, {first.rows} rows, mask ratio {first.mask_ratio:.2f} "
        f"({first.device_name}, {first.threads} threads, inductor {first.compile_mode})",
        fontsize=9,
    )
    fig.tight_layout()
    plot_path = json_path.with_suffix(".png")
    fig.savefig(plot_path, dpi=120)
    plt.close(fig)
    return plot_path
