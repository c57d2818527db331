"""``maskserve train-demo``: train the demo inpainting model (``backend.training.demo``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from backend.config import Settings


def cmd_train_demo(args, settings: Settings) -> int:
    import torch

    from backend.training.demo import train_demo
    from backend.training.recipe import Recipe

    overrides = {
        name: value
        for name, value in (
            ("vae_steps", args.vae_steps),
            ("unet_steps", args.unet_steps),
            ("examples", args.examples),
            ("seed", args.seed),
        )
        if value is not None
    }
    recipe = Recipe.smoke(**overrides) if args.smoke else dataclasses.replace(Recipe(), **overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = Path(args.workdir or settings.paths.data_dir / "train-demo")
    out = Path(args.out or workdir / "model")
    record = train_demo(recipe, workdir, out)
    minutes = sum(record["seconds"].values()) / 60
    print(f"trained in {minutes:.1f} min on {record['device']}: {out}")
    print(f"serve it with: MASKSERVE_MODEL={out.resolve()} maskserve up")
    return 0


def add_train_parser(sub) -> None:
    train = sub.add_parser(
        "train-demo",
        help="train the demo inpainting model on generated scenes (about an hour on 2 CPU cores)",
        description=(
            "Train the demo-sd2-inpaint recipe: autoencoder, encoded examples, denoiser, export. "
            "Stopped runs resume from the checkpoints in --workdir; change the recipe only "
            "with a new --workdir."
        ),
    )
    train.add_argument("--workdir", help="checkpoints (default: <data_dir>/train-demo)")
    train.add_argument("--out", help="exported diffusers directory (default: <workdir>/model)")
    train.add_argument("--smoke", action="store_true", help="the seconds-long test recipe")
    train.add_argument("--vae-steps", type=_positive, help="autoencoder optimiser steps")
    train.add_argument("--unet-steps", type=_positive, help="denoiser optimiser steps")
    train.add_argument("--examples", type=_positive, help="training examples to encode")
    train.add_argument("--seed", type=int, help="recipe seed (default 0: the shipped weights)")
    train.add_argument("--threads", type=_positive, help="torch CPU threads (default: all)")
    train.set_defaults(func=cmd_train_demo)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
