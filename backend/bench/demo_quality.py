"""`maskserve bench demo`: does a model paint what the prompt names, and does the mask-aware edit
keep the ordinary pipeline's quality on learned weights?

Cases: held-out examples (``make_example(seed, "heldout")``: masks of the kinds users paint over
one object) and a sweep of blob masks at fixed mask ratios over held-out scenes. Each case's
prompt names a size, a colour absent from the mask's surroundings and from what was there, and a
shape (``backend.training.judge``). Every case runs through the ordinary diffusers pipeline and
through the mask-aware engine in each cache mode (the template's cache recorded beforehand, with
the template seed), same prompt and seed. Reported per arm: colour agreement, how often the edit
is closer to the prompt than the template was, and whether pixels outside the mask are the
template's; per mode and mask ratio: SSIM and PSNR against the ordinary pipeline, whole image and
inside the mask. The ordinary pipeline is run a second time with another seed ("reseeded"): how
far its result moves says how far any change of noise moves this model's edits.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from backend.bench.engine_bench import _quality
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.ordinary import run_ordinary
from backend.imaging.masks import paste_back, synthetic_mask
from backend.models import load_pipeline, resolve_model
from backend.training.examples import make_example
from backend.training.judge import edit_prompt, judge, surrounding_colours
from backend.training.scenes import make_scene

SWEEP_RATIOS = (0.05, 0.1, 0.2, 0.3, 0.5)
# "reseeded": the ordinary pipeline again with another seed, the yardstick of how far an edit's
# masked area moves when only its noise changes
COMPARED = ("kv", "hidden", "reseeded")  # measured against the ordinary pipeline's result
ARMS = ("ordinary", *COMPARED)
RESEED_OFFSET = 7777
SWEEP_SEED_BASE = 5000  # held-out scenes of the sweep, apart from the examples'
EDIT_SEED_BASE = 1000


@dataclass(frozen=True)
class Case:
    source: str  # "painted" (a held-out example's mask) or "sweep" (a blob mask)
    seed: int
    template: Image.Image = field(repr=False)
    mask: np.ndarray = field(repr=False)
    prompt: str
    colour: str
    surroundings: frozenset[str]

    @property
    def mask_ratio(self) -> float:
        return float(self.mask.mean())


def painted_cases(count: int, size: int) -> list[Case]:
    cases = []
    for seed in range(count):
        example = make_example(seed, "heldout", size)
        around = surrounding_colours(example.image, example.mask)
        prompt, colour = edit_prompt(seed, example.target.size, around | {example.target.colour})
        cases.append(
            Case("painted", seed, example.image, example.mask, prompt, colour, frozenset(around))
        )
    return cases


def sweep_cases(per_ratio: int, size: int, ratios=SWEEP_RATIOS) -> list[Case]:
    cases = []
    for ratio in ratios:
        size_name = "small" if ratio <= 0.1 else "medium" if ratio <= 0.25 else "large"
        for index in range(per_ratio):
            seed = SWEEP_SEED_BASE + index
            scene = make_scene(seed, "heldout", size)
            mask = synthetic_mask(size, size, ratio, seed=seed, kind="blob")
            around = surrounding_colours(scene.image, mask)
            prompt, colour = edit_prompt(seed + int(ratio * 1000), size_name, set(around))
            cases.append(Case("sweep", seed, scene.image, mask, prompt, colour, frozenset(around)))
    return cases


def _judged(image: Image.Image, case: Case) -> dict:
    verdict = judge(image, case.mask, case.colour, set(case.surroundings))
    outside = np.asarray(image)[~case.mask] == np.asarray(case.template.convert("RGB"))[~case.mask]
    return {**asdict(verdict), "outside_identical": bool(outside.all())}


def _ordinary(engine, case: Case, mask_image: Image.Image, seed: int, params: EditParams):
    generated = run_ordinary(
        engine.pipe, engine.spec, case.template, mask_image, case.prompt, seed, params
    )
    return paste_back(generated, case.template, case.mask.astype(np.float32))


def run_case(engine: MaskAwareEngine, case: Case, params: dict[str, EditParams], seed: int):
    """The case through the ordinary pipeline and each mode; returns (record, images)."""
    mask_image = Image.fromarray(case.mask.astype(np.uint8) * 255)
    ordinary = _ordinary(engine, case, mask_image, seed, params["ordinary"])
    template_verdict = judge(case.template, case.mask, case.colour, set(case.surroundings))
    record = {
        "source": case.source,
        "seed": case.seed,
        "mask_ratio": case.mask_ratio,
        "prompt": case.prompt,
        "colour": case.colour,
        "template_prompt_share": template_verdict.prompt_share,
        "ordinary": _judged(ordinary, case),
    }
    reseeded = _ordinary(engine, case, mask_image, seed + RESEED_OFFSET, params["ordinary"])
    record["reseeded"] = {**_judged(reseeded, case), **_quality(reseeded, ordinary, case.mask)}
    images = {"ordinary": ordinary}
    for mode in ("kv", "hidden"):
        cache = engine.prepare_template(case.template, params[mode])
        result = engine.edit(case.template, mask_image, case.prompt, seed, params[mode], cache)
        record[mode] = {
            **_judged(result.image, case),
            **_quality(result.image, ordinary, case.mask),
            "measured_mask_ratio": result.mask_ratio,
        }
        images[mode] = result.image
    return record, images


def run_demo_bench(
    model_id: str, models_dir: Path, examples: int, per_ratio: int, margin: int = 0
) -> tuple[list[dict], dict[int, dict[str, Image.Image]]]:
    """Every case's record, and the images of the first 16 painted cases (for the grid)."""
    spec = resolve_model(model_id)
    size = spec.default_resolution
    pipe = load_pipeline(model_id, models_dir)
    base = dict(steps=spec.default_steps, guidance=spec.default_guidance, size=(size, size))
    params = {
        "ordinary": EditParams(**base, use_cache=False),
        **{
            mode: EditParams(**base, mode=mode, mask_margin=margin, record_on_first_edit=False)
            for mode in ("kv", "hidden")
        },
    }
    cases = painted_cases(examples, size) + sweep_cases(per_ratio, size)
    records, grid = [], {}
    with tempfile.TemporaryDirectory(prefix="demo-bench-cache-") as cache_root:
        engine = MaskAwareEngine(pipe, spec, Path(cache_root))
        for index, case in enumerate(tqdm(cases, desc=f"bench demo {model_id}", unit="edit")):
            record, images = run_case(engine, case, params, EDIT_SEED_BASE + index)
            records.append({"model": model_id, "guidance": spec.default_guidance, **record})
            if case.source == "painted" and len(grid) < 16:
                grid[index] = {"template": case.template, "mask": case.mask, **images}
    return records, grid


def summarise(records: list[dict]) -> dict:
    """Per arm: colour agreement, closer-than-template and outside-identical rates (painted and
    sweep cases apart); per mode and ratio: mean and minimum SSIM, mean PSNR."""
    summary: dict = {}
    for source in ("painted", "sweep"):
        rows = [r for r in records if r["source"] == source]
        if not rows:
            continue
        summary[source] = {
            arm: {
                "cases": len(rows),
                "colour_agreement": _share(r[arm]["agrees"] for r in rows),
                "closer_than_template": _share(
                    r[arm]["prompt_share"] > r["template_prompt_share"] for r in rows
                ),
                "outside_identical": _share(r[arm]["outside_identical"] for r in rows),
            }
            for arm in ARMS
        }
    summary["fidelity"] = {
        mode: {
            f"{ratio:g}": _fidelity([r[mode] for r in records if _bin(r) == ratio])
            for ratio in sorted({_bin(r) for r in records})
        }
        for mode in COMPARED
    }
    return summary


def _bin(record: dict) -> float:
    """The sweep's ratio, or the nearest sweep ratio of a painted mask."""
    return min(SWEEP_RATIOS, key=lambda ratio: abs(ratio - record["mask_ratio"]))


def _share(flags) -> float:
    values = [bool(flag) for flag in flags]
    return sum(values) / len(values)


def _fidelity(rows: list[dict]) -> dict:
    return {
        "cases": len(rows),
        **{
            f"{name}_mean": statistics.fmean(row[name] for row in rows)
            for name in ("ssim", "ssim_masked", "psnr", "psnr_masked")
        },
        "ssim_masked_min": min(row["ssim_masked"] for row in rows),
    }


def write_outputs(records: list[dict], grid: dict, json_path: Path) -> dict:
    """JSON (summary and records), a fidelity plot and the before/after grid beside it."""
    from backend.bench.demo_figures import plot_fidelity, save_grid

    summary = summarise(records)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"summary": summary, "records": records}, indent=1))
    plot_fidelity(summary, records, json_path.with_suffix(".png"))
    save_grid(grid, records, json_path.with_name(json_path.stem + "-grid.png"))
    return summary
