"""`maskserve bench adapter-quality`: what template caches and late joining cost an edit with a
LoRA adapter, against the ordinary diffusers pipeline with the same adapter (PEFT layers).

Per model, synthetic adapters (``backend.bench.synthetic_lora``: random PEFT weights, alpha set so
that each layer changes by a chosen relative delta) are resident in the engine and loaded through
``load_lora_weights`` into a second pipeline of the same model, the reference. Cases are held-out
scenes with blob masks at fixed mask ratios (``demo_quality.sweep_cases``). Three measurements:

* **fidelity**, per mask ratio, each arm against its own ordinary result (SSIM/PSNR, whole image
  and inside the mask, after paste-back): ``base-cache`` (no adapter: cached edit vs the ordinary
  pipeline), ``adapter-base-cache`` (the adapter on the base model's template cache: unmasked K/V
  from the base pass), ``adapter-pinned`` (the adapter on a cache recorded with it), and
  ``adapter-effect`` (the ordinary pipeline without vs with the adapter: how much the adapter
  itself changes the edit, the scale the losses are read against);
* **late join**: the adapter joins a row at step k instead of 0, against the ordinary pipeline
  with the adapter from step 0, the row on the base cache (``cache: base``: what the worker runs,
  the cache's own loss included) and dense (``cache: none``: k = 0 is the ordinary pipeline, so
  the loss is late joining's alone);
* **join step** (``adapter_divergence``): per adapter, the first step after which latents with and
  without it fall below cosine similarity 0.99 (dense, full mask: whole images compared).

Invariants: an arm and its reference share template, mask, prompt and seed; every template cache
is recorded with the template seed and no prompt, as the serving system records it.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from backend.bench.demo_quality import EDIT_SEED_BASE, Case, sweep_cases
from backend.bench.engine_bench import _quality
from backend.bench.synthetic_lora import SyntheticLora, calibrated_adapter, load_into_pipeline
from backend.engine import cache_store
from backend.engine.adapter_divergence import divergence
from backend.engine.cache_store import TemplateCache
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.lora import RowAdapters
from backend.engine.ordinary import run_ordinary
from backend.imaging.masks import paste_back
from backend.models import load_pipeline, resolve_model

FIDELITY_ARMS = ("base-cache", "adapter-base-cache", "adapter-pinned", "adapter-effect")
METRICS = ("ssim", "ssim_masked", "psnr", "psnr_masked")
# adapter name -> relative delta (synthetic_lora.relative_delta); "medium" is the measured one
STRENGTHS = {"weak": 0.05, "medium": 0.1, "strong": 0.2}
MEASURED = "medium"
RANK = 8
ADAPTER_SEED = 11


@dataclass(frozen=True)
class QualityConfig:
    models: tuple[str, ...] = ("demo-sd2-inpaint", "tiny-sdxl-inpaint", "tiny-flux-fill")
    ratios: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5)
    per_ratio: int = 2  # cases (templates) per mask ratio
    steps: int = 20
    size: int = 128
    late_ratio: float = 0.2  # the late-join cases' mask ratio
    late_share: float = 0.4  # join steps k = 0 .. late_share * steps
    mode: str = "kv"
    parts: tuple[str, ...] = ("fidelity", "late", "join")

    def join_steps(self) -> tuple[int, ...]:
        """0, 1, 2, 3, then every second step up to ``late_share`` of the steps."""
        last = int(self.late_share * self.steps)
        return tuple(sorted({*range(min(4, last + 1)), *range(4, last + 1, 2), last}))


@dataclass
class ModelRun:
    """One model's engine (adapters resident) and its reference pipeline (adapters via PEFT)."""

    engine: MaskAwareEngine
    reference: object  # the same model's diffusers pipeline with the adapters loaded
    adapters: dict[str, SyntheticLora]
    params: EditParams  # cached edits (the base cache recorded beforehand)
    ordinary: EditParams  # the ordinary pipeline's settings (no cache)


def _open(model_id: str, models_dir: Path, cfg: QualityConfig, root: Path) -> ModelRun:
    spec = resolve_model(model_id)
    engine = MaskAwareEngine(load_pipeline(model_id, models_dir), spec, root / "cache")
    reference = load_pipeline(model_id, models_dir)
    base = dict(steps=cfg.steps, guidance=spec.default_guidance, size=(cfg.size, cfg.size))
    adapters = {}
    for index, (name, strength) in enumerate(STRENGTHS.items()):
        made = calibrated_adapter(
            engine.adapter.denoiser,
            engine.adapters.targets,
            name,
            ADAPTER_SEED + index,
            RANK,
            strength,
        )
        engine.adapters.put(made.adapter)
        load_into_pipeline(reference, engine.adapter.denoiser_name, made, root / name)
        adapters[name] = made
    return ModelRun(
        engine,
        reference,
        adapters,
        EditParams(**base, mode=cfg.mode, record_on_first_edit=False),
        EditParams(**base, use_cache=False),
    )


def _ordinary(run: ModelRun, case: Case, seed: int, adapters: RowAdapters) -> Image.Image:
    """The ordinary pipeline's edit, pasted back; the reference pipeline with ``adapters`` set
    when there are any."""
    pipe = run.engine.pipe
    if adapters:
        pipe = run.reference
        pipe.set_adapters([a for a, _ in adapters], [s for _, s in adapters])
    generated = run_ordinary(
        pipe, run.engine.spec, case.template, _mask_image(case), case.prompt, seed, run.ordinary
    )
    return paste_back(generated, case.template, case.mask.astype(np.float32))


def _mask_image(case: Case) -> Image.Image:
    return Image.fromarray(case.mask.astype(np.uint8) * 255)


def _cache(run: ModelRun, case: Case, adapters: RowAdapters = ()) -> TemplateCache:
    """The template's base cache, or its pinned cache with ``adapters``; recorded once."""
    key = run.engine.cache_key(case.template, run.params, adapters)
    found = cache_store.lookup(run.engine.cache_root, key)
    return found or run.engine.prepare_template(case.template, run.params, adapters=adapters)


def joined_late(
    run: ModelRun,
    case: Case,
    seed: int,
    cache: TemplateCache | None,
    adapters: RowAdapters,
    k: int,
) -> Image.Image:
    """The edit whose ``adapters`` join at step ``k`` (0: from the start), as the worker joins an
    adapter that reaches the device late; on ``cache``, or dense without one (then with the
    edit's seed outside the mask too: at k = 0 it is the ordinary pipeline's computation)."""
    engine = run.engine
    params = run.params if cache is not None else replace(run.ordinary, template_seed=seed)
    state = engine.start(
        case.template, _mask_image(case), case.prompt, seed, params, cache=cache, pixels=case.mask
    )
    while not state.done:
        if state.step == k:
            state.adapters = adapters
        engine.step([state], params.mode)
    image, _generated = engine.finish(state, case.template, case.mask, params)
    return image


def measure_case(run: ModelRun, case: Case, seed: int, cfg: QualityConfig) -> Iterator[dict]:
    """The fidelity records of one case and, at the late-join ratio, its late-join records."""
    adapters = ((MEASURED, 1.0),)
    adapted = _ordinary(run, case, seed, adapters)
    base_cache = _cache(run, case)
    common = {"model": run.engine.spec.model_id, "ratio": _nearest(case.mask_ratio, cfg.ratios)}
    if "fidelity" in cfg.parts:
        plain = _ordinary(run, case, seed, ())
        edit = partial(
            run.engine.edit, case.template, _mask_image(case), case.prompt, seed, run.params
        )
        arms = {
            "base-cache": (edit(base_cache).image, plain),
            "adapter-base-cache": (edit(base_cache, adapters).image, adapted),
            "adapter-pinned": (edit(_cache(run, case, adapters), adapters).image, adapted),
            "adapter-effect": (plain, adapted),
        }
        for arm, (image, reference) in arms.items():
            yield {
                **common,
                "part": "fidelity",
                "arm": arm,
                **_quality(image, reference, case.mask),
            }
    if "late" in cfg.parts and common["ratio"] == cfg.late_ratio:
        for k in cfg.join_steps():
            for variant, cache in (("base", base_cache), ("none", None)):
                image = joined_late(run, case, seed, cache, adapters, k)
                late = {"part": "late", "cache": variant, "k": k}
                yield {**common, **late, **_quality(image, adapted, case.mask)}


def _nearest(ratio: float, ratios: tuple[float, ...]) -> float:
    return min(ratios, key=lambda r: abs(r - ratio))


def join_records(run: ModelRun, cfg: QualityConfig) -> Iterator[dict]:
    """Per adapter, the divergence of a dense whole-image edit with and without it."""
    case = sweep_cases(1, cfg.size, ratios=(cfg.late_ratio,))[0]
    full = Image.new("L", case.template.size, 255)
    dense = EditParams(**{**run.ordinary.to_dict(), "mode": cfg.mode})
    for name, made in run.adapters.items():
        found = divergence(
            run.engine, case.template, full, case.prompt, EDIT_SEED_BASE, dense, ((name, 1.0),)
        )
        yield {
            "model": run.engine.spec.model_id,
            "part": "join",
            "adapter": name,
            "relative_delta": STRENGTHS[name],
            "alpha": float(made.config.lora_alpha),
            "rank": RANK,
            "steps": cfg.steps,
            "step": found.step,
            "cosines": list(found.cosines),
        }


def run_adapter_quality(cfg: QualityConfig, models_dir: Path) -> list[dict]:
    """Every record of every model (``part``: fidelity | late | join)."""
    records: list[dict] = []
    cases = sweep_cases(cfg.per_ratio, cfg.size, ratios=cfg.ratios)
    for model_id in cfg.models:
        with tempfile.TemporaryDirectory(prefix="adapter-quality-") as root:
            run = _open(model_id, models_dir, cfg, Path(root))
            if "fidelity" in cfg.parts or "late" in cfg.parts:
                bar = tqdm(cases, desc=f"adapter-quality {model_id}", unit="case")
                for index, case in enumerate(bar):
                    records.extend(measure_case(run, case, EDIT_SEED_BASE + index, cfg))
            if "join" in cfg.parts:
                records.extend(join_records(run, cfg))
    return records


def summarise(records: list[dict]) -> dict:
    """Means over cases: ``fidelity[model][arm][ratio]``, ``late[model][cache][k]`` (each
    metric's mean, PSNR of identical images counted as 100 dB, and the case count), and
    ``join[model][adapter]`` (the step, None when never below)."""
    summary: dict = {"fidelity": {}, "late": {}, "join": {}}
    for r in records:
        if r["part"] == "fidelity":
            cell = summary["fidelity"].setdefault(r["model"], {}).setdefault(r["arm"], {})
            cell.setdefault(f"{r['ratio']:g}", []).append(r)
        elif r["part"] == "late":
            cell = summary["late"].setdefault(r["model"], {}).setdefault(r["cache"], {})
            cell.setdefault(str(r["k"]), []).append(r)
        else:
            summary["join"].setdefault(r["model"], {})[r["adapter"]] = r["step"]
    for by_model in (summary["fidelity"], summary["late"]):
        for model, rows in by_model.items():
            by_model[model] = _means(rows)
    return summary


def _means(tree: dict) -> dict:
    """Lists of records at the leaves become their metric means (and count)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, list):
            out[key] = {"cases": len(value)} | {
                m: statistics.fmean(min(r[m], 100.0) for r in value) for m in METRICS
            }
        else:
            out[key] = _means(value)
    return out
