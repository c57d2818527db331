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

The three take turns, ``repeats`` rounds after one untimed round, so that the machine's drift falls
on all alike. ``compile_s`` depends on inductor's cache of earlier compiles (TORCHINDUCTOR_CACHE_DIR
set to an empty directory gives a cold compile).

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


def interleaved_ms(
    runs: dict[str, tuple[Callable[[], object], Callable[[], object]]], repeats: int
):
    """name -> median ms of ``run`` over ``repeats`` calls, the runs taking turns so that the
    machine's drift falls on all alike; each (``prepare``, ``run``) pair's ``prepare`` runs
    before its call, outside the clock."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (prepare, run) in runs.items():
            prepare()
            started = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


class MaskawareStepper:
    """Steps the batch's requests through the engine (kv cache in host RAM); ``ready`` starts
    them again once done (encoding is no step)."""

    def __init__(self, engine: MaskAwareEngine, spec, batch, size: int):
        self.engine, self.batch = engine, batch
        self.params = cache_params(spec, size, PROXY_STEPS, "kv")
        self.cache = hot_cache(engine, batch.template, self.params, "cpu")
        self.states = self._start()
        self.measured_ratio = sum(s.mask_ratio for s in self.states) / len(self.states)

    def _start(self) -> list:
        batch = self.batch
        return [
            self.engine.start(
                batch.template, mask, PROMPT, seed, self.params, cache=self.cache, pixels=pixels
            )
            for mask, seed, pixels in zip(batch.masks, batch.seeds, batch.pixels, strict=True)
        ]

    def ready(self) -> None:
        if self.states[0].done:
            self.states = self._start()

    def __call__(self) -> None:
        self.engine.step(self.states, "kv")


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
        progress.set_postfix_str(f"{model_id}: timing")
        stepper = MaskawareStepper(engine, spec, batch, size)
        runs = {
            "eager": (lambda: None, forward(eager)),
            "compiled": (lambda: None, forward(compiled)),
            "maskaware": (stepper.ready, stepper),
        }
        interleaved_ms(runs, 1)  # warm-up: thread pools, the cache's first read
        ms = interleaved_ms(runs, repeats)
        operators = {}
        for name, (prepare, run) in runs.items():
            prepare()
            operators[name] = aten_operators(run)
    return ProxyRecord(
        model=model_id,
        size=size,
        rows=rows,
        requests=requests,
        eager_ms=ms["eager"],
        compiled_ms=ms["compiled"],
        speedup=ms["eager"] / ms["compiled"],
        eager_operators=operators["eager"],
        compiled_operators=operators["compiled"],
        compile_s=compile_s,
        max_abs_difference=check.max_abs_difference,
        reference_max_abs=check.reference_max_abs,
        maskaware_step_ms=ms["maskaware"],
        maskaware_operators=operators["maskaware"],
        mask_ratio=mask_ratio,
        measured_mask_ratio=stepper.measured_ratio,
        compile_mode=compile_mode,
        device_name=device_name("cpu"),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
    )


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
