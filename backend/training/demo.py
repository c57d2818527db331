"""``maskserve train-demo``: the whole recipe, stage by stage, resumable, ending in a diffusers
directory that ``from_pretrained`` loads offline.

Stages: the autoencoder (``autoencoder``), the examples' latents (``latents``), the denoiser
(``denoiser``), then the export: the EMA denoiser, the trained autoencoder, the frozen text
encoder, the tokenizer and the family's Euler scheduler, saved in half precision (about half the
bytes; loading upcasts to the serving dtype), with ``training.json`` (the recipe, the losses,
the seconds of each stage and the device) and a loss plot.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from backend.models.registry import quiet_libraries
from backend.training.autoencoder import autoencoder_stage, scene_pool, set_scaling_factor
from backend.training.denoiser import CaptionTable, averaged_copy, denoiser_stage
from backend.training.latents import encode_examples
from backend.training.loop import run_stage
from backend.training.parts import as_pipeline, build_parts
from backend.training.recipe import Recipe

TRAINING_FILE = "training.json"
PLOT_FILE = "training-loss.png"


def device_name() -> str:
    """The CPU's model and the threads torch uses (the figures' device)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {torch.get_num_threads()} threads"


def train_demo(recipe: Recipe, workdir: Path, out: Path, progress: bool = True) -> dict:
    """Run (or resume) every stage of ``recipe`` in ``workdir``; export the pipeline to ``out``.
    Returns the training record written as ``out/training.json``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)
    parts = build_parts(recipe)
    parts["text_encoder"].requires_grad_(False)
    seconds: dict[str, float] = {}

    started = time.perf_counter()
    pool = scene_pool(recipe, recipe.vae_scenes, progress)
    vae_stage = autoencoder_stage(parts["vae"], pool, recipe)
    vae_losses = run_stage(vae_stage, workdir, recipe.seed, recipe.checkpoint_every, progress)
    parts["vae"].requires_grad_(False)
    scaling = set_scaling_factor(parts["vae"], pool)
    del pool
    seconds["autoencoder"] = time.perf_counter() - started

    started = time.perf_counter()
    pipe = as_pipeline(parts)
    data = encode_examples(pipe, recipe, workdir, progress)
    table = CaptionTable(pipe, data.captions)
    seconds["latents"] = time.perf_counter() - started

    started = time.perf_counter()
    average = averaged_copy(parts["unet"])
    unet_stage = denoiser_stage(
        parts["unet"], average, data, table, parts["scheduler"].alphas_cumprod, recipe
    )
    unet_losses = run_stage(unet_stage, workdir, recipe.seed, recipe.checkpoint_every, progress)
    seconds["denoiser"] = time.perf_counter() - started

    record = {
        "recipe": recipe.to_dict(),
        "device": device_name(),
        "seconds": seconds,  # of this invocation (a resumed run counts only what it redid)
        "vae_scaling_factor": scaling,
        "distinct_captions": len(table.names) - 1,
        "losses": {"vae": vae_losses, "unet": unet_losses},
    }
    export(as_pipeline({**parts, "unet": average}), out, record)
    return record


def export(pipe, out: Path, record: dict) -> None:
    """Save ``pipe`` (half precision) with the training record and plot into ``out``; files of
    ``out`` the export does not write (a model card) are kept. Each file is replaced
    atomically."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    restore = quiet_libraries()  # casting to half precision warns once per model
    try:
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.eval()
        pipe.to(torch.float16).save_pretrained(staging, safe_serialization=True)
        pipe.to(torch.float32)
        (staging / TRAINING_FILE).write_text(json.dumps(record, indent=1))
        plot_losses(record, staging / PLOT_FILE)
        for path in sorted(staging.iterdir()):
            target = out / path.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(path, target)
    finally:
        restore()
        shutil.rmtree(staging, ignore_errors=True)


def plot_losses(record: dict, path: Path) -> None:
    """Both stages' losses per step, with a running mean (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    titles = {"vae": "autoencoder reconstruction (L1 + MSE)", "unet": "denoiser noise MSE"}
    for axis, (stage, losses) in zip(axes, record["losses"].items()):
        values = np.asarray(losses, dtype=float)
        window = max(1, len(values) // 50)
        smooth = np.convolve(values, np.ones(window) / window, mode="valid")
        axis.plot(values, alpha=0.3, label="per step")
        axis.plot(np.arange(len(smooth)) + window - 1, smooth, label=f"mean of {window}")
        axis.set_yscale("log")
        axis.set_title(titles[stage])
        axis.set_xlabel("optimiser step")
        axis.legend()
    fig.suptitle(f"train-demo on {record['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
