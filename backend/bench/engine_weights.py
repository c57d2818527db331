"""Engine weights A/B: parameter bytes of a Flux transformer with the mask-aware hooks installed,
and the edit time, for two source trees (this one and an older checkout) in one run.

``python -m backend.bench.engine_weights --old-tree /tmp/old --json docs/bench/engine-weights.json``

Each figure comes from child processes that import ``backend`` from one tree (``PYTHONPATH``), so
both trees run the same measuring code:

* ``bytes``: ``arch-flux-fill``'s transformer built on the meta device in bfloat16 (no memory is
  allocated), hooks installed, then ``fused_linear`` called once on every projection set the
  mask-aware forward passes it in kv and hidden mode. Counted: bytes of the unique storages of
  parameters, buffers and any fused weights a tree caches on the modules (``_maskserve_fused``).
* ``edit``: two long-lived children (one per tree) load ``small-flux-fill``, record a kv cache of
  one template (not timed) and serve one edit (mask ratio 0.2, blob mask, kv mode) per request;
  the driver alternates the trees (ABBA order) after one warm-up each and reports medians. The
  edited images of both trees are compared pixel by pixel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MARK = "@@engine-weights "
PROMPT = "a red leather armchair"


# ----- children (import ``backend`` from the tree on PYTHONPATH) ----------------------------------
def _projection_sets(model, mode: str) -> list[tuple]:
    """The (module, ...) sets the mask-aware Flux forward hands ``fused_linear`` in ``mode``."""
    sets: list[tuple] = []
    for block in model.transformer_blocks:
        attn = block.attn
        sets += [
            (attn.to_q, attn.to_k, attn.to_v),
            (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
        ]
        if mode == "hidden":
            sets.append((attn.to_k, attn.to_v))
    for index, block in enumerate(model.single_transformer_blocks):
        attn = block.attn
        sets.append((attn.to_q, attn.to_k, attn.to_v, block.proj_mlp))
        if mode == "hidden" or index == len(model.single_transformer_blocks) - 1:
            sets.append((attn.to_k, attn.to_v))  # text K/V of the last block; hidden-mode K/V
    return sets


def _unique_storage_bytes(model) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for cached in module.__dict__.get("_maskserve_fused", {}).values():
            tensors += [t for t in cached[1:] if t is not None]
    # a storage's identity, valid on the meta device too (where every data pointer is 0)
    sizes = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


def child_bytes(model_id: str) -> dict:
    import torch
    from diffusers import FluxTransformer2DModel

    from backend.engine.attention import fused_linear
    from backend.engine.flux import install_flux_hooks
    from backend.models import resolve_model
    from backend.models.configs import CONFIGS

    spec = resolve_model(model_id)
    with torch.device("meta"):
        model = FluxTransformer2DModel(**CONFIGS[(spec.family, spec.form)]["transformer"])
    model = model.to(torch.bfloat16)
    figures = {"built": _unique_storage_bytes(model)}
    install_flux_hooks(model)
    figures["installed"] = _unique_storage_bytes(model)
    for mode in ("kv", "hidden"):
        with torch.no_grad():
            for modules in _projection_sets(model, mode):
                x = torch.empty(1, modules[0].in_features, device="meta", dtype=torch.bfloat16)
                fused_linear(x, modules)
        figures[f"after_{mode}_forward"] = _unique_storage_bytes(model)
    return figures


def child_edit(model_id: str, models_dir: str, cache_dir: str, ratio: float, steps: int) -> None:
    """Serve edits: one line ``PNG_PATH`` in, one ``MARK {"seconds": ...}`` line out."""
    import time

    import numpy as np
    import torch
    from PIL import Image

    from backend.cache import MemoryTemplateCache
    from backend.engine.editor import EditParams, MaskAwareEngine
    from backend.imaging.masks import synthetic_mask
    from backend.models import load_pipeline, resolve_model
    from templates_store.samples import sample_template

    spec = resolve_model(model_id)
    size = spec.default_resolution
    pipe = load_pipeline(model_id, Path(models_dir), device="cpu", dtype=torch.float32)
    engine = MaskAwareEngine(pipe, spec, Path(cache_dir))
    template = sample_template(size, size, seed=7)
    params = EditParams(
        steps=steps,
        guidance=spec.default_guidance,
        size=(size, size),
        mode="kv",
        record_on_first_edit=False,
    )
    on_disk = engine.lookup(template, params) or engine.prepare_template(template, params)
    cache = MemoryTemplateCache.load(on_disk.path, pin_memory=False)
    pixels = synthetic_mask(size, size, ratio, seed=11, kind="blob")
    mask = Image.fromarray(pixels.astype(np.uint8) * 255)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        started, cpu_started = time.perf_counter(), time.process_time()
        result = engine.edit(template, mask, PROMPT, 1, params, cache=cache)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        result.image.save(line.strip())
        reply = {"seconds": seconds, "cpu_seconds": cpu_seconds, "mask_ratio": result.mask_ratio}
        print(MARK + json.dumps(reply), flush=True)


# ----- driver -------------------------------------------------------------------------------------
def _child_command(tree: Path, *args: str) -> tuple[list[str], dict]:
    # -P: the script's own folder (this tree's backend/bench) must not shadow the tree's modules
    env = dict(os.environ, PYTHONPATH=str(tree))
    return [sys.executable, "-P", str(Path(__file__).resolve()), *args], env


def _read_reply(process: subprocess.Popen) -> dict:
    for line in process.stdout:  # type: ignore[union-attr]
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise RuntimeError(f"child exited with {process.wait()} before replying")


def measure_bytes(trees: dict[str, Path], model_id: str) -> dict:
    figures = {}
    for name, tree in trees.items():
        command, env = _child_command(tree, "child-bytes", model_id)
        out = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, check=True)
        replies = [line for line in out.stdout.splitlines() if line.startswith(MARK)]
        figures[name] = json.loads(replies[-1][len(MARK) :])
    return figures


def measure_edits(trees: dict[str, Path], args, work: Path) -> dict:
    children = {}
    for name, tree in trees.items():  # one at a time: the first builds the model files
        command, env = _child_command(
            tree,
            "child-edit",
            args.model,
            str(args.models_dir),
            str(work / f"cache-{name}"),
            str(args.mask_ratio),
            str(args.steps),
        )
        children[name] = subprocess.Popen(
            command, env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        _read_reply(children[name])

    def edit(name: str) -> dict:
        children[name].stdin.write(f"{work / name}.png\n")  # type: ignore[union-attr]
        children[name].stdin.flush()  # type: ignore[union-attr]
        return _read_reply(children[name])

    names = list(trees)
    for name in names:
        edit(name)  # warm-up
    replies: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            replies[name].append(edit(name))
    for child in children.values():
        child.stdin.close()  # type: ignore[union-attr]
        child.wait()
    figures: dict = {}
    for key in ("seconds", "cpu_seconds"):  # CPU seconds: less sensitive to other jobs' load
        runs = {name: [reply[key] for reply in replies[name]] for name in names}
        figures[key] = runs
        figures[f"median_{key}"] = {name: statistics.median(v) for name, v in runs.items()}
        figures[f"min_{key}"] = {name: min(v) for name, v in runs.items()}
    figures["mask_ratio_on_grid"] = replies[names[0]][0]["mask_ratio"]
    return {**figures, **_pixel_difference(work / f"{names[0]}.png", work / f"{names[1]}.png")}


def _pixel_difference(first: Path, second: Path) -> dict:
    import numpy as np
    from PIL import Image

    a, b = (np.asarray(Image.open(p)).astype(np.int16) for p in (first, second))
    difference = np.abs(a - b)
    return {
        "max_pixel_difference": int(difference.max()),
        "pixels_differing": int((difference > 0).sum()),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child-bytes":
        print(MARK + json.dumps(child_bytes(argv[1])), flush=True)
        return
    if argv and argv[0] == "child-edit":
        model_id, models_dir, cache_dir, ratio, steps = argv[1:6]
        child_edit(model_id, models_dir, cache_dir, float(ratio), int(steps))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-tree", type=Path, required=True, help="checkout of the old code")
    parser.add_argument("--new-tree", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--bytes-model", default="arch-flux-fill")
    parser.add_argument("--model", default="small-flux-fill")
    parser.add_argument("--models-dir", type=Path, default=Path(".maskserve/models").resolve())
    parser.add_argument("--mask-ratio", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--skip-edits", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    trees = {"old": args.old_tree.resolve(), "new": args.new_tree.resolve()}
    report: dict = {"trees": {name: str(tree) for name, tree in trees.items()}}
    report["bytes"] = {"model": args.bytes_model, **measure_bytes(trees, args.bytes_model)}
    print(json.dumps(report["bytes"], indent=1))
    if not args.skip_edits:
        with tempfile.TemporaryDirectory() as work:
            edits = measure_edits(trees, args, Path(work))
        report["edit"] = {
            "model": args.model,
            "mask_ratio": args.mask_ratio,
            "steps": args.steps,
            "mode": "kv",
            "repeats": args.repeats,
            **edits,
        }
        print(json.dumps(report["edit"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
