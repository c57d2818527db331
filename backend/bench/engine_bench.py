"""`maskserve bench engine`: the ordinary pipeline, compiled or not, and the mask-aware edit, side
by side in one run.

The arms (``backend.bench.engine_arms.ARMS``, chosen with ``--arms``) serve the same batches: for
each mask ratio and batch size B, B requests (one template, B masks of that ratio, B seeds) go
through every arm, the arms taking turns (``repeats`` rounds), so that machine noise falls on all
alike. An arm's first call at a batch size is a warm-up, not timed; a compiled arm is called until
a call compiles nothing, and that time (``warmup_s``) is reported apart from the timed calls.
Caches are recorded beforehand and not timed. The engine of the eager mask-aware arms runs exact
step shapes on every device (``step_shapes="exact"``); ``maskaware-compiled`` sets its own.

One record per (arm, cache mode, mask ratio, batch): ``edit_s`` is the median seconds of one call
serving the whole batch (prompt encoding to decoded images), ``edits_per_s`` = B / ``edit_s``,
``step_s`` the median seconds of one denoising step (the gaps between step ends; a one-step run has
none and reports ``edit_s``). ``speedup`` = the ordinary arm's ``edit_s`` / this arm's at the same
ratio and batch, ``speedup_vs_compiled`` the same against ``ordinary-compiled`` (None when that arm
did not run); ``ideal_speedup`` = denoiser FLOPs of one ordinary step / FLOPs of one step of this
arm (1 for the ordinary arms). Quality compares each arm's first request with the ordinary arm's,
the same paste-back applied to both (None for the ordinary arm itself, or without it).

The ``ordinary-fresh-process`` arm answers whether the in-process ordinary arm is slowed by
anything of MaskServe's: its ``speedup`` is the ordinary arm's time over the fresh process's.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from backend.bench.engine_arms import (
    ARMS,
    MASKAWARE_ARMS,
    ORDINARY_MODE,
    PROMPT,
    ArmRun,
    Batch,
    BenchSetup,
    BuiltArm,
    default_compile_mode,
    plain_pipeline,
)
from backend.bench.flops import count_flops
from backend.cache import MemoryTemplateCache
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.imaging.masks import paste_back, synthetic_mask
from backend.imaging.quality import psnr, ssim
from backend.models import load_pipeline, materialize, resolve_model
from templates_store.samples import sample_template


@dataclass
class EngineBenchRecord:
    model: str
    arm: str
    mode: str  # cache mode of a mask-aware arm; "dense" for the ordinary arms
    mask_ratio: float  # requested
    measured_mask_ratio: float  # masked tokens / all tokens on the model's token grid
    batch: int  # requests served by one call
    steps: int
    resolution: int
    device: str
    device_name: str  # the GPU's name on CUDA, else the processor's architecture
    dtype: str
    edit_s: float
    edits_per_s: float
    step_s: float
    speedup: float | None
    speedup_vs_compiled: float | None
    ideal_speedup: float
    cache_bytes: int  # 0 for arms that read no cache
    # peak GPU memory allocated during one call (weights included; 0 off CUDA)
    peak_gpu_bytes: int
    ssim: float | None = None
    psnr: float | None = None
    ssim_masked: float | None = None
    psnr_masked: float | None = None


@dataclass
class EngineBenchReport:
    model: str
    records: list[EngineBenchRecord]
    # arm -> what was measured about it outside the timed calls (build and warm-up seconds, the
    # compiled forward's check against eager)
    arms: dict[str, dict]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} cpu"


def _quality(image: Image.Image, reference: Image.Image, pixels: np.ndarray) -> dict[str, float]:
    ours, theirs = np.asarray(image), np.asarray(reference)
    return {
        "ssim": ssim(ours, theirs),
        "psnr": psnr(ours, theirs),
        "ssim_masked": ssim(ours, theirs, mask=pixels),
        "psnr_masked": psnr(ours, theirs, mask=pixels),
    }


def _step_flops(engine: MaskAwareEngine, template, mask, params, cache) -> tuple[int, float]:
    """FLOPs of one denoising step of one request (mask-aware when ``cache`` is given), and the
    request's measured mask ratio."""
    state = engine.start(template, mask, PROMPT, 1, params, cache=cache)
    with count_flops() as count:
        engine.step([state], params.mode)
    return count.total, state.mask_ratio


def cache_params(spec, size: int, steps: int, mode: str) -> EditParams:
    """An edit of ``spec`` that reads a template cache recorded beforehand (never on its way)."""
    return EditParams(
        steps=steps,
        guidance=spec.default_guidance,
        size=(size, size),
        mode=mode,
        record_on_first_edit=False,
    )


def hot_cache(engine: MaskAwareEngine, template, params: EditParams, device: str):
    """``template``'s cache for ``params`` (recorded when missing), resident in the host-RAM tier
    (pinned on CUDA), as a worker serves a hot template."""
    on_disk = engine.lookup(template, params) or engine.prepare_template(template, params)
    return MemoryTemplateCache.load(on_disk.path, pin_memory=device.startswith("cuda"))


def make_batch(template: Image.Image, ratio: float, requests: int, seed: int) -> Batch:
    """``requests`` blob masks of ``ratio`` (each its own shape), seeds ``seed``, ``seed + 1``..."""
    width, height = template.size
    pixels = [
        synthetic_mask(height, width, ratio, seed=11 + row, kind="blob") for row in range(requests)
    ]
    masks = [Image.fromarray(p.astype(np.uint8) * 255) for p in pixels]
    return Batch(template, masks, pixels, [seed + row for row in range(requests)])


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters  # dynamo loads only when a bench counts graphs

    return counters["stats"]["unique_graphs"]


def _warm_up(built: BuiltArm, runner, batch: Batch, limit: int = 5) -> float:
    """One call, or for a compiled arm calls until one compiles nothing (at most ``limit``);
    returns their seconds."""
    started = time.perf_counter()
    for _ in range(limit if built.compiled else 1):
        before = compiled_graphs()
        runner(batch)
        if compiled_graphs() == before:
            break
    return time.perf_counter() - started


def _interleaved(
    runs: dict, batch: Batch, repeats: int, device: str
) -> tuple[dict, dict, dict, dict[tuple, int]]:
    """Per run: median seconds of a call, median seconds of a step, the last call's ``ArmRun``
    and on CUDA the peak GPU bytes allocated during a call (0 elsewhere); the runs take turns."""
    cuda = device.startswith("cuda")
    calls: dict = {name: [] for name in runs}
    steps: dict = {name: [] for name in runs}
    outputs: dict[tuple, ArmRun] = {}
    peaks = dict.fromkeys(runs, 0)
    for _ in range(repeats):
        for name, run in runs.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            outputs[name] = run(batch)  # decoded images: the device work has finished
            wall_s = time.perf_counter() - started
            calls[name].append(outputs[name].edit_s or wall_s)
            steps[name] += outputs[name].step_s
            if cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
    edit_s = {name: statistics.median(values) for name, values in calls.items()}
    step_s = {name: statistics.median(steps[name] or calls[name]) for name in runs}
    return edit_s, step_s, outputs, peaks


def run_engine_bench(
    model_id: str,
    mask_ratios: list[float],
    steps: int,
    models_dir: Path,
    cache_dir: Path,
    modes: tuple[str, ...] = ("kv", "hidden"),
    repeats: int = 1,
    resolution: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 1,
    in_memory: bool = False,
    arms: tuple[str, ...] = ("ordinary", "maskaware"),
    batches: tuple[int, ...] = (1,),
    compile_mode: str | None = None,
    partial_json: Path | None = None,
) -> EngineBenchReport:
    """``partial_json``: the report so far, rewritten after every cell (a run cut short keeps
    the cells it finished)."""
    spec = resolve_model(model_id)
    size = resolution or spec.default_resolution
    pipe = load_pipeline(model_id, models_dir, device=device, dtype=dtype, in_memory=in_memory)
    plain = plain_pipeline(pipe, spec)  # before the engine hooks the denoiser it keeps
    engine = MaskAwareEngine(pipe, spec, cache_dir, step_shapes="exact")
    template = sample_template(size, size, seed=7)
    caches = {}
    if MASKAWARE_ARMS & set(arms):
        for mode in modes:
            params = cache_params(spec, size, steps, mode)
            caches[mode] = (params, hot_cache(engine, template, params, device))
    ordinary_params = EditParams(
        steps=steps, guidance=spec.default_guidance, size=(size, size), use_cache=False
    )
    setup = BenchSetup(
        spec,
        engine,
        plain,
        ordinary_params,
        caches,
        device,
        dtype,
        compile_mode or default_compile_mode(device),
        None if in_memory else materialize(model_id, models_dir),
    )
    built: dict[str, BuiltArm] = {}
    meta: dict[str, dict] = {}
    records: list[EngineBenchRecord] = []
    cells = [(ratio, requests) for ratio in mask_ratios for requests in batches]
    try:
        for ratio, requests in tqdm(cells, desc=f"bench {model_id}", unit="cell"):
            batch = make_batch(template, ratio, requests, seed)
            for name in arms:
                if name not in built:
                    built[name], meta[name] = _build(name, setup, batch)
            runs = _warmed_runs(built, meta, batch)
            timed = _interleaved(runs, batch, repeats, device)
            records += _cell_records(setup, batch, ratio, template, timed)
            if partial_json is not None:
                report = EngineBenchReport(model_id, records, meta)
                partial_json.write_text(json.dumps(asdict(report), indent=1))
    finally:
        for arm in built.values():
            arm.close()
    return EngineBenchReport(model_id, records, meta)


def _build(name: str, setup: BenchSetup, batch: Batch) -> tuple[BuiltArm, dict]:
    """Arm ``name`` built on the first ``batch``, and what to record about it."""
    started = time.perf_counter()
    built = ARMS[name](setup, batch)
    meta = {"build_s": time.perf_counter() - started, "warmup_s": {}} | built.extra
    if built.check is not None:
        meta["compile_check"] = asdict(built.check) | {
            "within_tolerance": built.check.within_tolerance
        }
    return built, meta


def _warmed_runs(built: dict[str, BuiltArm], meta: dict[str, dict], batch: Batch) -> dict:
    """(arm, mode) -> runner, each warmed up for ``batch``: at an arm's first call at this batch
    size, and at every batch when compiled (a new mask ratio may be a new shape)."""
    requests = str(len(batch.masks))
    runs = {}
    for name, arm in built.items():
        warmed = meta[name]["warmup_s"]
        first_of_batch = requests not in warmed
        for mode, runner in arm.runners.items():
            if first_of_batch or arm.compiled:
                warmed[requests] = warmed.get(requests, 0.0) + _warm_up(arm, runner, batch)
            runs[name, mode] = runner
    return runs


def _cell_records(
    setup: BenchSetup, batch: Batch, ratio: float, template: Image.Image, timed: tuple
) -> list[EngineBenchRecord]:
    """One record per (arm, mode) of one mask ratio and batch size."""
    edit_s, step_s, outputs, peaks = timed
    engine, spec, params0 = setup.engine, setup.spec, setup.ordinary_params
    dense_flops, measured = _step_flops(engine, template, batch.masks[0], params0, None)
    ideal = {
        mode: dense_flops / _step_flops(engine, template, batch.masks[0], params, cache)[0]
        for mode, (params, cache) in setup.caches.items()
    }
    alpha = batch.pixels[0].astype(np.float32)
    ordinary = ("ordinary", ORDINARY_MODE)
    reference = (
        paste_back(outputs[ordinary].images[0], template, alpha) if ordinary in outputs else None
    )
    records = []
    for (name, mode), run in outputs.items():
        quality = (
            _quality(paste_back(run.images[0], template, alpha), reference, batch.pixels[0])
            if reference is not None and name != "ordinary"
            else {}
        )
        records.append(
            EngineBenchRecord(
                model=spec.model_id,
                arm=name,
                mode=mode,
                mask_ratio=ratio,
                measured_mask_ratio=measured,
                batch=len(batch.masks),
                steps=params0.steps,
                resolution=params0.size[0],
                device=setup.device,
                device_name=device_name(setup.device),
                dtype=str(setup.dtype).removeprefix("torch."),
                edit_s=edit_s[name, mode],
                edits_per_s=len(batch.masks) / edit_s[name, mode],
                step_s=step_s[name, mode],
                speedup=_ratio(edit_s, ordinary, (name, mode)),
                speedup_vs_compiled=_ratio(
                    edit_s, ("ordinary-compiled", ORDINARY_MODE), (name, mode)
                ),
                ideal_speedup=ideal.get(mode, 1.0),
                cache_bytes=setup.caches[mode][1].bytes_total if mode in setup.caches else 0,
                peak_gpu_bytes=peaks[name, mode],
                **quality,
            )
        )
    return records


def _ratio(seconds: dict, baseline: tuple, arm: tuple) -> float | None:
    return seconds[baseline] / seconds[arm] if baseline in seconds else None


def write_outputs(report: EngineBenchReport, json_path: Path) -> Path:
    """Write the JSON report and a PNG plot beside it: each arm's speedup vs mask ratio against
    the ordinary arm (left) and against ``ordinary-compiled`` (right, when it ran)."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(asdict(report), indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = report.records
    baselines = [
        (field_name, label)
        for field_name, label in (
            ("speedup", "ordinary"),
            ("speedup_vs_compiled", "ordinary-compiled"),
        )
        if any(getattr(r, field_name) is not None for r in records)
    ]
    fig, axes = plt.subplots(1, max(1, len(baselines)), figsize=(6 * max(1, len(baselines)), 4))
    axes = np.atleast_1d(axes)
    lines = sorted({(r.arm, r.mode, r.batch) for r in records})
    for ax, (field_name, label) in zip(axes, baselines, strict=False):
        for arm, mode, requests in lines:
            rows = sorted(
                (r for r in records if (r.arm, r.mode, r.batch) == (arm, mode, requests)),
                key=lambda r: r.mask_ratio,
            )
            ax.plot(
                [r.mask_ratio for r in rows],
                [getattr(r, field_name) for r in rows],
                marker="o",
                label=f"{arm} {mode} B={requests}",
            )
        ideal = sorted(
            (r for r in records if r.mode == "kv" and r.batch == lines[0][2]),
            key=lambda r: r.mask_ratio,
        )
        if ideal:
            ax.plot(
                [r.mask_ratio for r in ideal],
                [r.ideal_speedup for r in ideal],
                ls="--",
                color="grey",
                label="kv FLOP ideal",
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("mask ratio")
        ax.set_ylabel(f"speedup vs {label} (edit time, same batch)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    machines = ", ".join(sorted({f"{r.device_name} {r.dtype}" for r in records}))
    fig.suptitle(f"MaskServe engine: {report.model}, arms side by side ({machines})", fontsize=9)
    fig.tight_layout()
    plot_path = json_path.with_suffix(".png")
    fig.savefig(plot_path, dpi=120)
    plt.close(fig)
    return plot_path
