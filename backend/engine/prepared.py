"""A request after pre-processing: what the denoising worker needs, and nothing that needs an
encoder.

Pre-processing (text encoders, VAE encode, mask resize) runs in CPU workers; the GPU worker only
denoises. The two meet through one safetensors file per request, passed by reference (its path),
never inside a queue message. The file holds the tensors plus a JSON header with the scalars.

Invariant: ``load(save(p)) == p`` bit for bit (tensors are stored in their own dtype), so a request
prepared in another process denoises exactly as one prepared in the worker itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from backend.atomic import atomic_path
from backend.engine.cache_store import CacheKey

FORMAT_VERSION = 1


@dataclass
class PreparedRequest:
    model_id: str
    params: dict  # EditParams as a dict (plain values: JSON-safe)
    seed: int
    pixels: np.ndarray  # bool (H, W) mask at the model resolution: True = repaint
    init_latents: torch.Tensor  # before step 0 with the request's seed (Flux: packed tokens)
    conditioning: dict[str, torch.Tensor]
    extra_channels: torch.Tensor
    halves: int
    guidance: float
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    # Before step 0 with the template's seed: the noise outside the mask when no cache is used.
    template_latents: torch.Tensor | None = None
    cache_key: CacheKey | None = None

    def save(self, path: Path) -> Path:
        """Write atomically (temp file + rename): a reader never sees half a request."""
        tensors = {
            "init_latents": self.init_latents,
            "extra_channels": self.extra_channels,
            "pixels": torch.from_numpy(self.pixels.astype(np.uint8)),
        }
        tensors |= {f"cond.{k}": v for k, v in self.conditioning.items()}
        tensors |= {f"shared.{k}": v for k, v in self.shared.items()}
        if self.template_latents is not None:
            tensors["template_latents"] = self.template_latents
        header = {
            "format_version": FORMAT_VERSION,
            "model_id": self.model_id,
            "params": self.params,
            "seed": self.seed,
            "halves": self.halves,
            "guidance": self.guidance,
            "cache_key": asdict(self.cache_key) if self.cache_key else None,
        }
        path = Path(path)
        with atomic_path(path) as tmp:
            save_file(
                {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                str(tmp),
                metadata={"maskserve": json.dumps(header)},
            )
        return path

    @classmethod
    def load(cls, path: Path, device: torch.device | str = "cpu") -> PreparedRequest:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            header = json.loads((handle.metadata() or {}).get("maskserve", "{}"))
        if header.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path} is not a prepared request of format {FORMAT_VERSION}")
        tensors = load_file(str(path), device=str(device))

        def group(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}

        key = header["cache_key"]
        return cls(
            model_id=header["model_id"],
            params=header["params"],
            seed=header["seed"],
            pixels=tensors["pixels"].cpu().numpy().astype(bool),
            init_latents=tensors["init_latents"],
            conditioning=group("cond."),
            extra_channels=tensors["extra_channels"],
            halves=header["halves"],
            guidance=header["guidance"],
            shared=group("shared."),
            template_latents=tensors.get("template_latents"),
            cache_key=CacheKey(**key) if key else None,
        )
