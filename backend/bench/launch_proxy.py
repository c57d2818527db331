"""`maskserve bench launch-proxy`: a CPU proxy of the launch-bound GPU regime.

On a GPU these models' steps are bound by the host launching operators, not by compute
(docs/bench/gpu-h200.md). A tiny model's forward at 64 px on a CPU is bound the same way: many
small operators, each costing more in dispatch than in arithmetic. For each model, at ``rows``
denoiser rows (requests = rows / the model's rows per request), on the inputs of a real first step
of the ordinary pipeline:

* the ordinary (dense) denoiser forward eager and under ``torch.compile`` (inductor; the arm
  ``ordinary-compiled`` of `bench engine`): median ms, operators launched per call, the seconds
  the first compiled call took (compiling), and the compiled output's largest |difference| from
  eager;
* the mask-aware step (engine ``step``: forward, guidance and scheduler update) at mask ratio
  ``mask_ratio``, every row reading its template's ``kv`` cache resident in memory (the device
  tier's copy, ``MemoryTemplateCache.to_device``), three ways, each on its own engine over its own
  denoiser modules: eager with exact shapes, eager bucketed, and bucketed and compiled
  (``compile_steps`` in the ordinary forward's compile mode: the step's whole forward one graph).
  The compiled one is stepped until a step compiles nothing before any timed call
  (``compiled_step_compile_s``; its first step's update checked against the eager bucketed
  one's), and its ratios are taken against the eager exact step (``compiled_step_vs_eager``,
  target at least 2) and the compiled dense forward (``compiled_step_vs_dense``, target at least
  1: no slower; the step also guides and updates the latents, the forward does not).

Operators are those a call launches (``backend.engine.launches.count_launches``: outermost aten
operators doing work, views and no-op casts excluded). The kernels inductor generates are no aten
operators, so a compiled call counts only the aten operators its graph still calls (matmuls,
convolutions, attention, copies).

The five take turns, ``repeats`` rounds after one untimed round, so that the machine's drift falls
on all alike. Compile seconds depend on inductor's cache of earlier compiles
(TORCHINDUCTOR_CACHE_DIR set to an empty directory gives a cold compile).

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
    Batch,
    check_compiled,
    check_compiled_step,
    compile_denoiser,
    default_compile_mode,
    denoiser_inputs,
    engine_copy,
    plain_pipeline,
    start_states,
)
from backend.bench.engine_bench import (
    cache_params,
    compiled_graphs,
    device_name,
    hot_cache,
    make_batch,
)
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.families import ADAPTERS
from backend.engine.launches import count_launches
from backend.models import load_pipeline, resolve_model
from templates_store.samples import sample_template

PROXY_MODELS = ("tiny-sd2-inpaint", "tiny-sdxl-inpaint", "tiny-flux-fill")
PROXY_STEPS = 8  # steps of the recorded cache; the mask-aware step restarts its edits when done
WARMUP_STEPS = 3 * PROXY_STEPS  # at most, until a compiled step compiles nothing


@dataclass(frozen=True)
class ProxyRecord:
    model: str
    size: int
    rows: int
    requests: int
    eager_ms: float  # ordinary denoiser forward
    compiled_ms: float
    speedup: float  # eager_ms / compiled_ms
    eager_operators: int  # operators one forward launches (count_launches)
    compiled_operators: int
    compile_s: float  # the first compiled call
    max_abs_difference: float  # compiled vs eager output
    reference_max_abs: float
    maskaware_step_ms: float  # eager mask-aware step at mask_ratio, exact shapes
    maskaware_operators: int
    bucketed_step_ms: float  # eager mask-aware step, bucketed shapes
    bucketed_operators: int
    compiled_step_ms: float  # mask-aware step, bucketed shapes, its forward compiled
    compiled_step_operators: int
    compiled_step_compile_s: float  # its steps until one compiled nothing
    compiled_step_max_abs_difference: float  # first step's update vs the eager bucketed step's
    compiled_step_reference_max_abs: float
    compiled_step_vs_eager: float  # maskaware_step_ms / compiled_step_ms (target >= 2)
    compiled_step_vs_eager_bucketed: float  # bucketed_step_ms / compiled_step_ms
    compiled_step_vs_dense: float  # compiled_ms / compiled_step_ms (target >= 1)
    mask_ratio: float
    measured_mask_ratio: float  # fresh tokens / all tokens on the model's token grid
    compile_mode: str  # of the ordinary forward and the compiled step
    device_name: str
    threads: int
    torch: str


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
    """Steps the batch's requests through ``engine``, each reading ``cache``; ``ready`` starts
    them again once done (encoding is no step)."""

    def __init__(self, engine: MaskAwareEngine, batch: Batch, params: EditParams, cache):
        self.engine, self.batch, self.params, self.cache = engine, batch, params, cache
        self.states = start_states(engine, batch, params, cache)
        self.measured_ratio = sum(s.mask_ratio for s in self.states) / len(self.states)

    def ready(self) -> None:
        if self.states[0].done:
            self.states = start_states(self.engine, self.batch, self.params, self.cache)

    def __call__(self) -> None:
        self.engine.step(self.states, self.params.mode)

    def warm_up(self) -> float:
        """Steps until one compiles nothing (at most ``WARMUP_STEPS``); their seconds."""
        started = time.perf_counter()
        for _ in range(WARMUP_STEPS):
            self.ready()
            before = compiled_graphs()
            self()
            if compiled_graphs() == before:
                break
        return time.perf_counter() - started


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
    engine = MaskAwareEngine(pipe, spec, cache_dir, step_shapes="exact")
    # each on its own denoiser modules: compiling the UNet's blocks in place stays in its engine
    bucketed = engine_copy(plain, spec, cache_dir, step_shapes="bucketed")
    compiled_engine = engine_copy(
        plain, spec, cache_dir, step_shapes="bucketed", compile_steps=compile_mode
    )
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
        kv = cache_params(spec, size, PROXY_STEPS, "kv")
        cache = hot_cache(engine, template, kv, "cpu").to_device(torch.device("cpu"))
        steppers = {
            "maskaware": MaskawareStepper(engine, batch, kv, cache),
            "bucketed": MaskawareStepper(bucketed, batch, kv, cache),
            "compiled-step": MaskawareStepper(compiled_engine, batch, kv, cache),
        }
        started = time.perf_counter()
        step_check = check_compiled_step(
            (bucketed, cache), (compiled_engine, cache), batch, kv, torch.float32
        )
        step_compile_s = time.perf_counter() - started + steppers["compiled-step"].warm_up()
        progress.set_postfix_str(f"{model_id}: timing")
        runs = {
            "eager": (lambda: None, forward(eager)),
            "compiled": (lambda: None, forward(compiled)),
            **{name: (stepper.ready, stepper) for name, stepper in steppers.items()},
        }
        interleaved_ms(runs, 1)  # warm-up: thread pools, the cache's first read
        ms = interleaved_ms(runs, repeats)
        operators = {}
        for name, (prepare, run) in runs.items():
            prepare()
            operators[name] = count_launches(run)
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
        bucketed_step_ms=ms["bucketed"],
        bucketed_operators=operators["bucketed"],
        compiled_step_ms=ms["compiled-step"],
        compiled_step_operators=operators["compiled-step"],
        compiled_step_compile_s=step_compile_s,
        compiled_step_max_abs_difference=step_check.max_abs_difference,
        compiled_step_reference_max_abs=step_check.reference_max_abs,
        compiled_step_vs_eager=ms["maskaware"] / ms["compiled-step"],
        compiled_step_vs_eager_bucketed=ms["bucketed"] / ms["compiled-step"],
        compiled_step_vs_dense=ms["compiled"] / ms["compiled-step"],
        mask_ratio=mask_ratio,
        measured_mask_ratio=steppers["maskaware"].measured_ratio,
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
    forward and of the mask-aware steps (left), and the operators each launches (right)."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps([asdict(r) for r in records], indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    bars = (
        ("ordinary forward, eager", "eager_ms", "eager_operators"),
        ("ordinary forward, compiled", "compiled_ms", "compiled_operators"),
        ("mask-aware step, eager, exact", "maskaware_step_ms", "maskaware_operators"),
        ("mask-aware step, eager, bucketed", "bucketed_step_ms", "bucketed_operators"),
        ("mask-aware step, compiled", "compiled_step_ms", "compiled_step_operators"),
    )
    width = 0.8 / len(bars)
    for index, (label, ms, operators) in enumerate(bars):
        places = [m + index * width for m in range(len(records))]
        left.bar(places, [getattr(r, ms) for r in records], width, label=label)
        right.bar(places, [getattr(r, operators) for r in records], width, label=label)
    for ax, ylabel in ((left, "ms per call (median)"), (right, "operators launched per call")):
        centres = [m + (len(bars) - 1) * width / 2 for m in range(len(records))]
        ax.set_xticks(centres, [r.model for r in records])
        ax.set_ylabel(ylabel)
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7)
    first = records[0]
    fig.suptitle(
        f"CPU launch proxy: {first.size} px, {first.rows} rows, mask ratio {first.mask_ratio:.2f} "
        f"({first.device_name}, {first.threads} threads, inductor {first.compile_mode})",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # the legend below the axes
    plot_path = json_path.with_suffix(".png")
    fig.savefig(plot_path, dpi=120)
    plt.close(fig)
    return plot_path
