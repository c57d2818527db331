"""`maskserve bench crop` (or ``python -m backend.bench.crop_bench``): what "inpaint only the
masked area" (``inpaint_area="masked"``) costs the template cache and what it gains in detail.

One large template (a 1024x768 sample image) and ``masks`` random irregular small masks (each one
localised blob of a few overlapping ellipses, ``ratio_range`` of the image, exact to a pixel), in
two scenarios: ``scattered`` (every mask an object of its own, anywhere) and ``nearby`` (a few
objects, each repainted many times a little differently, as one user edits one template):

* geometry (pure, no model): for every crop grid (none; edges at multiples of 1/16 or 1/8 of each
  image side, ``uploads.masked_crop_box``) and padding, the number of distinct crop boxes over the
  masks (= distinct template caches: a crop is another picture, so another cache key), the detail
  gained (model pixels per image pixel of the masked-area crop over the whole-image edit's: the
  whole crop's area over the masked crop's) and the share of the model's pixels under the mask
  (what masked-token compute has to compute; the whole-image edit's alongside);
* time (a handful of real edits on ``model``, on this CPU, after one uncounted warm-up edit of
  another template): the first ``timed`` scattered masks edited as whole-image edits (the first
  records the template's cache, the others read it), then each as a masked-area edit twice (the
  first records its crop's cache, the second reads it), every edit through the real
  pre-processing (``CpuStages.preprocess``), an engine worker (``EngineWorker``, with a tiered
  cache in a cold directory of its own) and post-processing (``CpuStages.postprocess``).

Writes the JSON and a PNG plot beside it (docs/bench/crop.json, crop.png; docs/bench/crop.md).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

# PIL, OpenCV (through backend.imaging) and the model are imported where they run: `maskserve
# --help` registers this command without loading them
PROMPT = "a red leather armchair"
GRIDS = {"none": 0, "1/16 side": 16, "1/8 side": 8}  # label -> uploads' ``divisions``
SCENARIOS = ("scattered", "nearby")


@dataclass
class CropBenchConfig:
    width: int = 1024
    height: int = 768
    masks: int = 50
    ratio_range: tuple[float, float] = (0.02, 0.1)
    paddings: tuple[int, ...] = (0, 16, 32, 64, 128, 256)  # 32: the default padding
    resolution: int = 0  # the bucket's side (about resolution^2 model pixels); 0: the model's
    size_multiple: int = 8  # the geometry's bucket sides are multiples of this (SD2: 8)
    seed: int = 0
    sites: int = 5  # the nearby scenario's objects
    jitter_px: float = 12.0  # how far a repaint of one of them moves each ellipse (sigma)
    model_id: str = "tiny-sd2-inpaint"
    timed: int = 4  # masks edited for real, each whole and masked (0: geometry only)
    steps: int = 20
    template_seed: int = 3
    grids: dict[str, int] = field(default_factory=lambda: dict(GRIDS))


Ellipse = tuple[float, float, float, float, float]  # centre y, x, radius y, x, angle


def blob_ellipses(centre, side: int, rng: np.random.Generator) -> list[Ellipse]:
    """2-5 rotated ellipses whose centres scatter around ``centre``: one painted object."""
    out = []
    for _ in range(int(rng.integers(2, 6))):
        cy, cx = np.asarray(centre, dtype=float) + rng.normal(0.0, 0.06 * side, size=2)
        ry, rx = rng.uniform(0.04, 0.14, size=2) * side
        out.append((float(cy), float(cx), float(ry), float(rx), float(rng.uniform(0, np.pi))))
    return out


def paint(height: int, width: int, ellipses: list[Ellipse], ratio: float) -> np.ndarray:
    """Exactly ``round(ratio * H * W)`` pixels: those closest to the union of ``ellipses`` (in
    each ellipse's own normalised distance, as ``masks.synthetic_mask`` builds its blobs, but in
    one place, as a painter masks one object)."""
    from backend.imaging.masks import ellipse_union_mask

    return ellipse_union_mask(height, width, round(ratio * height * width), ellipses)


def make_masks(cfg: CropBenchConfig, scenario: str) -> list[np.ndarray]:
    """``scattered``: every mask an object of its own anywhere in the image; ``nearby``:
    ``cfg.sites`` objects, each painted again and again a little differently (every ellipse
    moved by about ``cfg.jitter_px``, resized by up to 10 %, the area by up to 15 %): the edits
    a user makes of one template."""
    rng = np.random.default_rng(cfg.seed)
    low, high = cfg.ratio_range
    side = min(cfg.height, cfg.width)

    def site():
        return blob_ellipses(rng.uniform(0.15, 0.85, size=2) * (cfg.height, cfg.width), side, rng)

    if scenario == "scattered":
        return [
            paint(cfg.height, cfg.width, site(), float(rng.uniform(low, high)))
            for _ in range(cfg.masks)
        ]
    sites = [(site(), float(rng.uniform(low, high))) for _ in range(cfg.sites)]
    masks = []
    for index in range(cfg.masks):
        ellipses, ratio = sites[index % cfg.sites]
        moved = [
            (
                cy + rng.normal(0, cfg.jitter_px),
                cx + rng.normal(0, cfg.jitter_px),
                ry * rng.uniform(0.9, 1.1),
                rx * rng.uniform(0.9, 1.1),
                theta,
            )
            for cy, cx, ry, rx, theta in ellipses
        ]
        masks.append(paint(cfg.height, cfg.width, moved, ratio * rng.uniform(0.85, 1.15)))
    return masks


def _base(cfg: CropBenchConfig) -> int:
    """The bucket's side: the configured one, else the model's default resolution."""
    from backend.models import resolve_model

    return cfg.resolution or resolve_model(cfg.model_id).default_resolution


def _area(box) -> int:
    return (box[2] - box[0]) * (box[3] - box[1])


def geometry(cfg: CropBenchConfig, masks: list[np.ndarray]) -> dict:
    """Per grid and padding: distinct crops, detail gain and masked share of the model pixels."""
    from backend.imaging.uploads import (
        crop_box_for,
        mask_to_bucket,
        masked_crop_box,
        resolution_bucket,
    )

    size_hw = resolution_bucket(cfg.width, cfg.height, _base(cfg), cfg.size_multiple)
    whole = crop_box_for((cfg.width, cfg.height), size_hw)
    whole_share = [float(mask_to_bucket(m, size_hw, whole).mean()) for m in masks]
    rows = []
    for label, divisions in cfg.grids.items():
        for padding in cfg.paddings:
            boxes = [masked_crop_box(m, size_hw, padding, divisions) for m in masks]
            gains = [_area(whole) / _area(box) for box in boxes]
            shares = [float(mask_to_bucket(m, size_hw, b).mean()) for m, b in zip(masks, boxes)]
            rows.append(
                {
                    "grid": label,
                    "divisions": divisions,
                    "padding_px": padding,
                    "distinct_crops": len(set(boxes)),
                    "whole_image_crops": sum(box == whole for box in boxes),
                    "gain_mean": statistics.fmean(gains),
                    "gain_median": statistics.median(gains),
                    "gain_min": min(gains),
                    "gain_max": max(gains),
                    "masked_share_mean": statistics.fmean(shares),
                    "crop_side_mean_px": statistics.fmean(b[2] - b[0] for b in boxes),
                }
            )
    return {
        "bucket_hw": list(size_hw),
        "whole_crop_box": list(whole),
        "whole_masked_share_mean": statistics.fmean(whole_share),
        "mask_ratio_mean": statistics.fmean(float(m.mean()) for m in masks),
        "rows": rows,
    }


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def timing(cfg: CropBenchConfig, masks: list[np.ndarray], models_dir: Path) -> list[dict]:
    """Real edits through pre-processing, an engine worker and post-processing, on the CPU."""
    from PIL import Image

    from backend.blobs import BlobStore
    from backend.cache import TieredActivationCache
    from backend.config import load_settings
    from backend.engine.editor import MaskAwareEngine
    from backend.imaging.uploads import DEFAULT_CROP_PADDING_PX
    from backend.models import load_pipeline, resolve_model
    from backend.protocol import EditJob
    from backend.tasks.core import CpuStages
    from backend.worker.channels import LocalInbox, LocalSink
    from backend.worker.loop import EngineWorker
    from templates_store.samples import sample_template

    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="crop-bench-") as tmp:
        root = Path(tmp)
        settings = load_settings(
            env={}, paths={"data_dir": str(root), "models_dir": str(models_dir)}
        )
        spec = resolve_model(cfg.model_id)
        engine = MaskAwareEngine(load_pipeline(spec.model_id, models_dir), spec, root / "cache")
        blobs = BlobStore(root / "blobs")
        stages = CpuStages(settings, engine, blobs=blobs)
        inbox, sink = LocalInbox(), LocalSink()
        caches = TieredActivationCache(engine.cache_root, 4 << 30, 16 << 30)
        worker = EngineWorker(engine, blobs, inbox, sink, caches=caches)
        template = sample_template(cfg.width, cfg.height, seed=cfg.template_seed)
        template_ref = blobs.put("uploads", "template.png", _png(template))
        warm_up_ref = blobs.put(
            "uploads", "warm-up.png", _png(sample_template(cfg.width, cfg.height, seed=99))
        )
        seen: set[str] = set()
        plan = [(0, "whole", warm_up_ref)]  # the process's first edit, not counted
        plan += [(i, "whole", template_ref) for i in range(cfg.timed)]
        plan += [(i, "masked", template_ref) for i in range(cfg.timed) for _ in range(2)]
        for number, (index, area, ref) in enumerate(plan):
            mask = Image.fromarray(masks[index].astype(np.uint8) * 255)
            job = EditJob(
                job_id=f"crop-{number:03d}",
                model_id=spec.model_id,
                template_ref=ref,
                mask_ref=blobs.put("uploads", f"mask-{number:03d}.png", _png(mask)),
                prompt=PROMPT,
                seed=number,
                steps=cfg.steps,
                guidance=spec.default_guidance,
                resolution=_base(cfg),
                inpaint_area=area,
                crop_padding_px=DEFAULT_CROP_PADDING_PX,
            )
            started = time.perf_counter()
            prepared = stages.preprocess(job)
            pre_done = time.perf_counter()
            inbox.put(prepared)
            while not sink.denoised_jobs:
                if not worker.iterate():
                    caches.wait_for_loads(10)  # a row is held until its cache is in RAM
            denoised = sink.denoised_jobs.pop()
            denoise_done = time.perf_counter()
            stages.postprocess(denoised)
            ended = time.perf_counter()
            if ref == warm_up_ref:
                continue
            records.append(
                {
                    "mask": index,
                    "area": area,
                    "crop_box": list(prepared.paste.crop_box) if prepared.paste else [],
                    "mask_ratio_model": prepared.mask_ratio,
                    "recorded_cache": prepared.cache_digest not in seen,
                    "used_cache": denoised.used_cache,
                    "pre_s": pre_done - started,
                    "denoise_s": denoise_done - pre_done,
                    "post_s": ended - denoise_done,
                    "total_s": ended - started,
                }
            )
            seen.add(prepared.cache_digest)
        caches.close()
    return records


def timing_summary(records: list[dict]) -> dict:
    """Mean seconds per edit, per area, apart for edits that recorded their cache."""
    summary: dict[str, dict] = {}
    for area in ("whole", "masked"):
        for recorded in (True, False):
            rows = [r for r in records if r["area"] == area and r["recorded_cache"] == recorded]
            if not rows:
                continue
            key = f"{area}, {'recording' if recorded else 'cached'}"
            summary[key] = {
                "edits": len(rows),
                **{
                    name: statistics.fmean(r[name] for r in rows)
                    for name in ("pre_s", "denoise_s", "post_s", "total_s", "mask_ratio_model")
                },
            }
    return summary


def run_crop_bench(cfg: CropBenchConfig, models_dir: Path | None) -> dict:
    report: dict = {"config": asdict(cfg), "geometry": {}}
    scattered: list[np.ndarray] = []
    for scenario in SCENARIOS:
        masks = make_masks(cfg, scenario)
        report["geometry"][scenario] = geometry(cfg, masks)
        scattered = scattered or masks
    if cfg.timed and models_dir is not None:
        records = timing(cfg, scattered, models_dir)
        report["timing"] = {"edits": records, "summary": timing_summary(records)}
    return report


def write_outputs(report: dict, json_path: Path) -> Path:
    """The JSON, and a PNG plot beside it (same name, ``.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    panels = 3 if "timing" in report else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.4 * panels, 4.4))
    colours = dict(zip(report["config"]["grids"], ("tab:blue", "tab:orange", "tab:green")))
    for scenario, style in zip(SCENARIOS, ("-", "--")):
        rows = report["geometry"][scenario]["rows"]
        for label in report["config"]["grids"]:
            mine = [r for r in rows if r["grid"] == label]
            pads = [r["padding_px"] for r in mine]
            axes[0].plot(
                pads,
                [r["distinct_crops"] for r in mine],
                style,
                marker="o",
                color=colours[label],
                label=f"{label}, {scenario}",
            )
            if scenario == "scattered":
                axes[1].errorbar(
                    pads,
                    [r["gain_median"] for r in mine],
                    yerr=[
                        [r["gain_median"] - r["gain_min"] for r in mine],
                        [r["gain_max"] - r["gain_median"] for r in mine],
                    ],
                    marker="o",
                    capsize=3,
                    color=colours[label],
                    label=label,
                )
    masks = report["config"]["masks"]
    axes[0].set(
        xlabel="crop padding (px)",
        ylabel=f"distinct crops = template caches (of {masks} masks)",
        title="Caches per template",
    )
    axes[1].set(
        xlabel="crop padding (px)",
        ylabel="model pixels per image pixel, vs whole image",
        title="Detail gain, scattered masks (median, min-max)",
        yscale="log",
    )
    for ax, title in zip(axes[:2], ("crop grid, masks", "crop grid")):
        ax.grid(alpha=0.3)
        ax.legend(title=title, fontsize=7)
    if "timing" in report:
        summary = report["timing"]["summary"]
        names = list(summary)
        bottom = np.zeros(len(names))
        for stage in ("pre_s", "denoise_s", "post_s"):
            values = np.array([summary[name][stage] for name in names])
            axes[2].bar(names, values, bottom=bottom, label=stage.removesuffix("_s"))
            bottom += values
        axes[2].set(ylabel="seconds per edit", title=f"{report['config']['model_id']}, CPU")
        axes[2].tick_params(axis="x", labelrotation=20)
        axes[2].legend()
    fig.tight_layout()
    png = json_path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def print_report(report: dict) -> None:
    cfg = report["config"]
    for scenario, geo in report["geometry"].items():
        print(
            f"{scenario}: template {cfg['width']}x{cfg['height']}, bucket {geo['bucket_hw'][1]}x"
            f"{geo['bucket_hw'][0]}, {cfg['masks']} masks, mean mask ratio "
            f"{geo['mask_ratio_mean']:.3f} (share of the model's pixels in a whole-image edit "
            f"{geo['whole_masked_share_mean']:.3f})"
        )
        for r in geo["rows"]:
            print(
                f"  grid {r['grid']:9s} padding {r['padding_px']:4d}px: {r['distinct_crops']:3d} "
                f"distinct crops ({r['whole_image_crops']} whole-image), detail gain median "
                f"{r['gain_median']:5.2f}x (mean {r['gain_mean']:5.2f}x, {r['gain_min']:.2f}-"
                f"{r['gain_max']:.2f}x), masked share of model pixels "
                f"{r['masked_share_mean']:.3f}"
            )
    for name, row in report.get("timing", {}).get("summary", {}).items():
        print(
            f"{name:20s} n={row['edits']}: total {row['total_s']:6.3f}s (pre {row['pre_s']:.3f}s,"
            f" denoise {row['denoise_s']:.3f}s, post {row['post_s']:.3f}s), masked share "
            f"{row['mask_ratio_model']:.3f}"
        )


def add_crop_parser(bench_sub) -> None:
    crop = bench_sub.add_parser(
        "crop",
        help='"inpaint only the masked area": distinct crops (= template caches) with and '
        "without snapping, detail gained, and time per edit whole vs masked",
    )
    defaults = CropBenchConfig()
    crop.add_argument("--masks", type=int, default=defaults.masks)
    crop.add_argument("--model", default=defaults.model_id)
    crop.add_argument("--timed", type=int, default=defaults.timed, help="masks edited for real")
    crop.add_argument("--steps", type=int, default=defaults.steps)
    crop.add_argument("--resolution", type=int, default=defaults.resolution)
    crop.add_argument("--seed", type=int, default=defaults.seed)
    crop.add_argument("--json", default="docs/bench/crop.json")
    crop.set_defaults(func=cmd_bench_crop)


def cmd_bench_crop(args, settings) -> int:
    cfg = CropBenchConfig(
        masks=args.masks,
        model_id=args.model,
        timed=args.timed,
        steps=args.steps,
        resolution=args.resolution,
        seed=args.seed,
    )
    report = run_crop_bench(cfg, settings.paths.resolved_models_dir())
    print_report(report)
    png = write_outputs(report, Path(args.json))
    print(f"wrote {args.json} and {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from backend.config import load_settings

    parser = argparse.ArgumentParser(prog="python -m backend.bench.crop_bench", description=__doc__)
    add_crop_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["crop", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args, load_settings()))


if __name__ == "__main__":
    sys.exit(main())
