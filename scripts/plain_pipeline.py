"""The plain diffusers inpainting pipeline, timed in a process of its own that imports nothing of
MaskServe (torch, diffusers and PIL only): the ``ordinary-fresh-process`` arm of `maskserve bench
engine` (``--fresh-process-baseline``), which shows whether anything of MaskServe's (its imports,
hooks, settings) slows the in-process ordinary arm.

It loads a saved diffusers directory with ``from_pretrained`` (``--euler``: the Euler scheduler
from its config, as MaskServe gives checkpoints), prints one JSON line about itself (``ready``),
then serves requests: each line on stdin is a JSON batch ``{"template": image file, "masks": [mask
files], "seeds": [ints], "outputs": [image files to write]}``, run as one pipeline call (the prompt,
an empty negative prompt per request with ``--negative-prompts``, ``--max-sequence-length`` when
given), answered by one JSON line: ``edit_s``, the call's seconds, and ``step_s``, the gaps between
step ends (marked through ``callback_on_step_end``, waiting for the device on CUDA; the bench's own
step clock is MaskServe code, so it is written out here). Outputs are written after the timing.
It ends at the end of its input.

    echo '{"template": "t.png", "masks": ["m.png"], "seeds": [1], "outputs": ["o.png"]}' | \\
        python scripts/plain_pipeline.py --model-dir .maskserve/models/tiny-sd2-inpaint --size 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import diffusers
import torch
from diffusers import DiffusionPipeline, EulerDiscreteScheduler
from PIL import Image

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="a saved diffusers pipeline")
    parser.add_argument("--prompt", default="a red leather armchair")
    parser.add_argument("--size", type=int, required=True, help="px, square")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=7.5)
    parser.add_argument("--negative-prompts", action="store_true", help="an empty one per request")
    parser.add_argument("--max-sequence-length", type=int, default=0)
    parser.add_argument("--euler", action="store_true", help="EulerDiscreteScheduler from config")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    return parser


def answer(message: dict) -> None:
    print(json.dumps(message), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = args.device.startswith("cuda")
    started = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(args.model_dir, dtype=DTYPES[args.dtype])
    if args.euler:
        pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe = pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    answer(
        {
            "ready": True,
            "load_s": time.perf_counter() - started,
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "threads": torch.get_num_threads(),
            "maskserve_modules": sorted(m for m in sys.modules if m.split(".")[0] == "backend"),
        }
    )
    marks: list[float] = []

    def mark(pipe, step, timestep, tensors):
        if cuda:
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        return tensors

    for line in sys.stdin:
        request = json.loads(line)
        template = Image.open(request["template"]).convert("RGB")
        masks = [Image.open(path).convert("L") for path in request["masks"]]
        extra: dict = {}
        if args.negative_prompts:
            extra["negative_prompt"] = [""] * len(masks)
        if args.max_sequence_length:
            extra["max_sequence_length"] = args.max_sequence_length
        marks.clear()
        began = time.perf_counter()
        images = pipe(
            prompt=[args.prompt] * len(masks),
            image=[template] * len(masks),
            mask_image=masks,
            height=args.size,
            width=args.size,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            strength=1.0,
            generator=[torch.Generator().manual_seed(seed) for seed in request["seeds"]],
            callback_on_step_end=mark,
            **extra,
        ).images
        edit_s = time.perf_counter() - began
        for image, path in zip(images, request["outputs"], strict=True):
            image.save(path)
        answer({"edit_s": edit_s, "step_s": [b - a for a, b in zip(marks, marks[1:])]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
