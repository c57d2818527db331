"""`maskserve bench engine`: the ordinary pipeline vs the mask-aware edit, side by side in one run.

For each mask ratio, the same template, mask, prompt and seed go through the ordinary diffusers
pipeline and through the mask-aware engine in each cache mode (caches recorded beforehand, not
timed, and read from the host-RAM tier, as a worker serves a hot template). One JSON record per
(model, mode, mask ratio); speedup = ordinary_s / maskaware_s, both medians over ``repeats`` runs
after one warm-up; ideal_speedup = denoiser FLOPs of one ordinary step / FLOPs of one mask-aware
step. Quality is measured against the ordinary pipeline's output with the same paste-back applied to
both.
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

from backend.bench.flops import count_flops
from backend.cache import MemoryTemplateCache
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.ordinary import run_ordinary
from backend.imaging.masks import paste_back, synthetic_mask
from backend.imaging.quality import psnr, ssim
from backend.models import load_pipeline, resolve_model
from templates_store.samples import sample_template

PROMPT = "a red leather armchair"


@dataclass
class EngineBenchRecord:
    model: str
    mode: str
    mask_ratio: float  # requested
    measured_mask_ratio: float  # masked tokens / all tokens on the model's token grid
    steps: int
    resolution: int
    device: str
    device_name: str  # the GPU's name on CUDA, else the processor's architecture
    dtype: str
    ordinary_s: float
    maskaware_s: float
    speedup: float
    ideal_speedup: float
    cache_bytes: int
    # peak GPU memory allocated during one edit (weights included; 0 off CUDA)
    ordinary_peak_gpu_bytes: int
    maskaware_peak_gpu_bytes: int
    ssim: float
    psnr: float
    ssim_masked: float
    psnr_masked: float


def _interleaved(
    runs: dict, repeats: int, warm_up: bool, device: str
) -> tuple[dict[str, float], dict, dict[str, int]]:
    """Median seconds of each run, the runs taking turns so that machine noise hits all alike;
    their outputs; and on CUDA the peak GPU bytes allocated during each run (0 elsewhere)."""
    if warm_up:
        for run in runs.values():
            run()  # allocator, thread pools, page cache; verifies the cache files' checksums once
    cuda = device.startswith("cuda")
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs, peaks = {}, dict.fromkeys(runs, 0)
    for _ in range(repeats):
        for name, run in runs.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            outputs[name] = run()  # returns a decoded image: the device work has finished
            times[name].append(time.perf_counter() - started)
            if cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
    return {name: statistics.median(values) for name, values in times.items()}, outputs, peaks


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


def _step_flops(engine: MaskAwareEngine, template, mask, params, cache) -> int:
    """FLOPs of one denoising step of the batch (mask-aware when ``cache`` is given)."""
    state = engine.start(template, mask, PROMPT, 1, params, cache=cache)
    with count_flops() as count:
        engine.step([state], params.mode)
    return count.total


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
) -> list[EngineBenchRecord]:
    spec = resolve_model(model_id)
    size = resolution or spec.default_resolution
    pipe = load_pipeline(model_id, models_dir, device=device, dtype=dtype, in_memory=in_memory)
    engine = MaskAwareEngine(pipe, spec, cache_dir)
    template = sample_template(size, size, seed=7)
    records: list[EngineBenchRecord] = []
    caches = {}
    for mode in modes:
        params = cache_params(spec, size, steps, mode)
        caches[mode] = (params, hot_cache(engine, template, params, device))
    ordinary_params = EditParams(
        steps=steps, guidance=spec.default_guidance, size=(size, size), use_cache=False
    )
    dense_flops = None
    for ratio in tqdm(mask_ratios, desc=f"bench {model_id}", unit="ratio"):
        mask = Image.fromarray(
            synthetic_mask(size, size, ratio, seed=11, kind="blob").astype(np.uint8) * 255
        )
        pixels = np.asarray(mask) > 127
        runs = {
            "ordinary": lambda m=mask: run_ordinary(
                pipe, spec, template, m, PROMPT, seed, ordinary_params
            )
        }
        for mode, (params, cache) in caches.items():
            runs[mode] = lambda p=params, c=cache, m=mask: engine.edit(
                template, m, PROMPT, seed, p, cache=c
            )
        seconds, outputs, peaks = _interleaved(runs, repeats, not records, device)
        reference = paste_back(outputs["ordinary"], template, pixels.astype(np.float32))
        if dense_flops is None:
            dense_flops = _step_flops(engine, template, mask, ordinary_params, None)
        for mode, (params, cache) in caches.items():
            result = outputs[mode]
            records.append(
                EngineBenchRecord(
                    model=model_id,
                    mode=mode,
                    mask_ratio=ratio,
                    measured_mask_ratio=result.mask_ratio,
                    steps=steps,
                    resolution=size,
                    device=device,
                    device_name=device_name(device),
                    dtype=str(dtype).removeprefix("torch."),
                    ordinary_s=seconds["ordinary"],
                    maskaware_s=seconds[mode],
                    speedup=seconds["ordinary"] / seconds[mode],
                    ideal_speedup=dense_flops
                    / _step_flops(
                        engine, template, mask, params, cache if result.used_cache else None
                    ),
                    cache_bytes=cache.bytes_total,
                    ordinary_peak_gpu_bytes=peaks["ordinary"],
                    maskaware_peak_gpu_bytes=peaks[mode],
                    **_quality(result.image, reference, pixels),
                )
            )
    return records


def write_outputs(records: list[EngineBenchRecord], json_path: Path) -> Path:
    """Write the JSON records and a PNG plot of speedup vs mask ratio beside them."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps([asdict(r) for r in records], indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model in sorted({r.model for r in records}):
        for mode in sorted({r.mode for r in records}):
            rows = sorted(
                (r for r in records if r.model == model and r.mode == mode),
                key=lambda r: r.mask_ratio,
            )
            if rows:
                ax.plot(
                    [r.mask_ratio for r in rows],
                    [r.speedup for r in rows],
                    marker="o",
                    label=f"{model} {mode}",
                )
        ideal = sorted(
            (r for r in records if r.model == model and r.mode == "kv"), key=lambda r: r.mask_ratio
        )
        if ideal:
            ax.plot(
                [r.mask_ratio for r in ideal],
                [r.ideal_speedup for r in ideal],
                ls="--",
                label=f"{model} FLOP ideal",
            )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("mask ratio")
    ax.set_ylabel("speedup vs ordinary pipeline")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    machines = ", ".join(sorted({f"{r.device_name} {r.dtype}" for r in records}))
    ax.set_title(f"MaskServe engine: mask-aware edit speedup ({machines})", fontsize=9)
    fig.tight_layout()
    plot_path = json_path.with_suffix(".png")
    fig.savefig(plot_path, dpi=120)
    plt.close(fig)
    return plot_path
