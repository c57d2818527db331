"""Stage 2: the training examples, encoded once by the trained autoencoder.

Each example becomes what the serving pipeline hands its denoiser: the image's latents, the mask
at latent resolution and the masked image's latents (made by the pipeline's own
``prepare_mask_latents``), with the caption of what lies under the mask. Chunks are written
atomically as they are done, so a stopped run keeps every finished chunk.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from tqdm import tqdm

from backend.training.examples import make_example
from backend.training.loop import RecipeMismatchError, step_generator
from backend.training.recipe import AUTOENCODER_FIELDS, Recipe

CHUNK = 250  # examples per chunk file


@dataclass
class LatentSet:
    """Every example's denoiser inputs, row i of each tensor being example i."""

    latents: torch.Tensor  # (N, 4, h, w) scaled image latents
    masked: torch.Tensor  # (N, 4, h, w) scaled masked-image latents
    masks: torch.Tensor  # (N, 1, h, w) the mask at latent resolution (1 = repaint)
    captions: list[str]

    def __len__(self) -> int:
        return len(self.captions)


@torch.no_grad()
def _encode_chunk(pipe, recipe: Recipe, first: int, count: int) -> dict:
    examples = [make_example(seed, "train", recipe.size) for seed in range(first, first + count)]
    size = recipe.size
    images = pipe.image_processor.preprocess([ex.image for ex in examples], size, size)
    masks = pipe.mask_processor.preprocess(
        [Image.fromarray(ex.mask.astype("uint8") * 255) for ex in examples], size, size
    )
    generator = step_generator(recipe.seed, "latents", first)
    latents = pipe._encode_vae_image(images, generator)
    mask_latents, masked = pipe.prepare_mask_latents(
        masks, images * (masks < 0.5), count, size, size, torch.float32, "cpu", generator, False
    )
    return {
        "latents": latents,
        "masked": masked,
        "masks": mask_latents,
        "captions": [ex.caption for ex in examples],
    }


def encode_examples(pipe, recipe: Recipe, workdir: Path, progress: bool = True) -> LatentSet:
    """Encode ``recipe.examples`` training examples under ``workdir/latents`` (resuming)."""
    folder = Path(workdir) / "latents"
    folder.mkdir(parents=True, exist_ok=True)
    fingerprint = recipe.fingerprint(*AUTOENCODER_FIELDS, "examples")
    stamp = folder / "recipe.json"
    if stamp.is_file() and json.loads(stamp.read_text())["fingerprint"] != fingerprint:
        raise RecipeMismatchError(f"{folder} holds latents of another recipe: delete it")
    stamp.write_text(json.dumps({"fingerprint": fingerprint}))
    chunks = []
    starts = range(0, recipe.examples, CHUNK)
    for first in tqdm(starts, desc="encode examples", unit="chunk", disable=not progress):
        path = folder / f"chunk-{first:07d}.pt"
        if not path.is_file():
            chunk = _encode_chunk(pipe, recipe, first, min(CHUNK, recipe.examples - first))
            partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
            torch.save(chunk, partial)
            os.replace(partial, path)
        chunks.append(torch.load(path, map_location="cpu", weights_only=True))
    return LatentSet(
        latents=torch.cat([c["latents"] for c in chunks]),
        masked=torch.cat([c["masked"] for c in chunks]),
        masks=torch.cat([c["masks"] for c in chunks]),
        captions=[caption for c in chunks for caption in c["captions"]],
    )
