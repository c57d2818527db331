"""`maskserve bench step-launches`: the operators one denoising step launches, mask-aware against
dense, per model and batch size.

For 1, 2, 4 ... requests (each its own template, blob mask and seed, as ``bench batch-ops``
draws them), one engine, three steps of the same rows: ``dense`` (no cache: the ordinary
forward), ``exact`` (the mask-aware step with each row's own token count) and ``bucketed`` (the
mask-aware step with static shapes: ``engine.step_shapes``). The mask-aware rows read their
templates' caches from the device tier, as a worker serves hot templates. Counted with
``backend.engine.launches.count_launches`` after one warm step (which builds the batch's
layouts and conditioning), every step eager. On a device bound by launching operators a step
costs about one host dispatch per operator counted. Counts, not times: they do not depend on the
machine's load.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from backend.bench.batch_ops import PROMPT, hot_batch
from backend.bench.engine_bench import device_name
from backend.bench.route_deadlines import save_beside
from backend.engine.launches import count_launches

FORMS = ("dense", "exact", "bucketed")


@dataclass(frozen=True)
class StepLaunchesRecord:
    model: str
    resolution: int
    mode: str
    requests: int
    form: str  # one of FORMS
    launched: int  # operators one step launches
    device: str
    device_name: str


def run_step_launches(
    model_id: str,
    requests: list[int],
    models_dir: Path,
    cache_dir: Path,
    size: int | None = None,
    mode: str = "kv",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[StepLaunchesRecord]:
    engine, params, templates, masks, caches = hot_batch(
        model_id, max(requests), models_dir, cache_dir, size, mode, 4, device, dtype
    )
    on_device = [cache.to_device(torch.device(device)) for cache in caches]
    records = []
    for count in tqdm(requests, desc=f"bench step-launches {model_id}", unit="batch"):
        for form in FORMS:
            engine.step_shapes = "bucketed" if form == "bucketed" else "exact"
            states = [
                engine.start(
                    templates[i],
                    masks[i],
                    PROMPT,
                    i,
                    params,
                    cache=None if form == "dense" else on_device[i],
                )
                for i in range(count)
            ]
            engine.step(states, mode)  # warm: the batch's layouts and conditioning are built
            launched = count_launches(lambda rows=states: engine.step(rows, mode))
            records.append(
                StepLaunchesRecord(
                    model=model_id,
                    resolution=params.size[0],
                    mode=mode,
                    requests=count,
                    form=form,
                    launched=launched,
                    device=device,
                    device_name=device_name(device),
                )
            )
    return records


def write_step_launches(records: list[StepLaunchesRecord], json_path: Path) -> Path:
    """JSON of the records and a PNG beside it: operators per step against requests, a line per
    model and form."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    for model in dict.fromkeys(r.model for r in records):
        for form, style in zip(FORMS, ("-", ":", "--")):
            mine = [r for r in records if r.model == model and r.form == form]
            ax.plot(
                [r.requests for r in mine],
                [r.launched for r in mine],
                style,
                marker="o",
                label=f"{model} {form}",
            )
    ax.set_xlabel("requests in the step")
    ax.set_ylabel("operators launched per step")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    return save_beside(fig, json_path)


def summary_lines(records: list[StepLaunchesRecord]) -> list[str]:
    """One line per model and batch: each form's count and the mask-aware forms against dense."""
    lines = []
    by_batch: dict[tuple[str, int], dict[str, int]] = {}
    for r in records:
        by_batch.setdefault((r.model, r.requests), {})[r.form] = r.launched
    for (model, count), forms in by_batch.items():
        dense = forms["dense"]
        lines.append(
            f"{model} x{count}: dense {dense}, exact {forms['exact']} "
            f"({forms['exact'] / dense:.2f}x), bucketed {forms['bucketed']} "
            f"({forms['bucketed'] / dense:.2f}x)"
        )
    return lines
