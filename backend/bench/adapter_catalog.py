"""A catalogue of synthetic LoRA adapters for ``maskserve bench adapters``: many adapters of mixed
ranks, written as users have them (the diffusers layout, through the pipeline class's
``save_lora_weights``) and registered through the real ingest path (read by diffusers, checked
against the model, normalized, stored content-addressed in an ``AdapterStore``).

Each adapter updates the attention projections of every transformer block (q, k, v, out: what
diffusers' LoRA training scripts target by default) with random A and B drawn from its own seed;
B is scaled so the adapter's update is ``strength`` of the layer's weight in Frobenius norm
(alpha = rank: scale 1), which changes an edit visibly without wrecking it.
Invariants: the same (model, count, seed, ranks, strength) gives the same files, byte for byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig
from tqdm import tqdm

from backend.adapters.files import NormalizedMeta, model_targets, read_for_model, save_normalized
from backend.adapters.store import AdapterFacts, AdapterStore
from backend.engine.lora import LoraAdapter, LoraPair
from backend.models import resolve_model
from backend.models.registry import pipeline_class

ATTENTION = re.compile(r".*\.attn[12]?\.(to_q|to_k|to_v|to_out\.0)$")
DEFAULT_RANKS = (8, 16, 32, 64)
DEFAULT_RANK_SHARES = (0.4, 0.3, 0.2, 0.1)  # most adapters are small; a few are large
OWNER = "bench"


@dataclass(frozen=True)
class CatalogAdapter:
    adapter_id: str
    sha256: str  # of its normalized file: what workers load it by
    nbytes: int
    rank: int
    source: Path  # the file as its user has it (the baseline loads this with diffusers)


def _pairs(
    layers: dict[str, torch.nn.Linear], rank: int, strength: float, seed: int
) -> dict[str, torch.Tensor]:
    """PEFT-named tensors of one random adapter (module order fixed: names sorted)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(layers):
        layer = layers[name]
        down = torch.randn(rank, layer.in_features, generator=generator) / layer.in_features**0.5
        up = torch.randn(layer.out_features, rank, generator=generator) / rank**0.5
        # kaiming-uniform weights have entries of variance 1 / (3 in): ||W|| ~ sqrt(out / 3)
        target = strength * (layer.out_features / 3) ** 0.5
        up *= target / (up @ down).norm()
        state[f"{name}.lora_A.weight"] = down.contiguous()
        state[f"{name}.lora_B.weight"] = up.contiguous()
    return state


def attention_layers(model_id: str) -> dict[str, torch.nn.Linear]:
    """The attention projections of ``model_id``'s denoiser adapters update here (meta tensors)."""
    layers = {n: m for n, m in model_targets(model_id).items() if ATTENTION.fullmatch(n)}
    if not layers:
        raise ValueError(f"{model_id} has no attention projections adapters may update")
    return layers


def random_adapter(
    layers: dict[str, torch.nn.Linear],
    adapter_id: str,
    rank: int,
    seed: int,
    strength: float = 0.05,
) -> LoraAdapter:
    """A catalogue adapter of ``rank`` on ``layers`` as the engine holds it (scale 1: alpha =
    rank), without a file: for benches of the engine alone."""
    state = _pairs(layers, rank, strength, seed)
    return LoraAdapter(
        adapter_id,
        {
            name: LoraPair(state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"], 1.0)
            for name in layers
        },
    )


def build_catalog(
    model_id: str,
    folder: Path,
    store: AdapterStore,
    count: int = 200,
    seed: int = 0,
    ranks: tuple[int, ...] = DEFAULT_RANKS,
    rank_shares: tuple[float, ...] = DEFAULT_RANK_SHARES,
    strength: float = 0.05,
) -> list[CatalogAdapter]:
    """``count`` adapters for ``model_id``: source files under ``folder``, registered in ``store``
    (owner ``OWNER``)."""
    spec = resolve_model(model_id)
    prefix = "transformer" if spec.family == "flux-fill" else "unet"
    layers = attention_layers(model_id)
    rng = np.random.default_rng(seed)
    chosen_ranks = rng.choice(ranks, size=count, p=np.asarray(rank_shares) / sum(rank_shares))
    folder.mkdir(parents=True, exist_ok=True)
    catalog = []
    for index in tqdm(range(count), desc="adapters"):
        rank = int(chosen_ranks[index])
        source = folder / f"adapter-{index:04d}.safetensors"
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=sorted(layers))
        pipeline_class(spec.family).save_lora_weights(
            str(folder),
            weight_name=source.name,
            **{
                f"{prefix}_lora_layers": _pairs(layers, rank, strength, seed * 100_003 + index),
                f"{prefix}_lora_adapter_metadata": config.to_dict(),
            },
        )
        catalog.append(_register(model_id, spec.family, source, store, max(ranks)))
    return catalog


def _register(
    model_id: str, family: str, source: Path, store: AdapterStore, max_rank: int
) -> CatalogAdapter:
    """The ingest path's work (read, check, normalize, store), run here."""
    read = read_for_model(source, model_id, max_rank=max_rank)
    normalized = source.with_suffix(".normalized")
    save_normalized(read.adapter, NormalizedMeta(family, model_id, read.source_layout), normalized)
    ranks = {module: pair.rank for module, pair in read.adapter.pairs.items()}
    facts = AdapterFacts(family, model_id, read.source_layout, ranks, read.adapter.nbytes)
    try:
        record = store.add(normalized, facts, source.stem, OWNER)
    finally:
        normalized.unlink(missing_ok=True)
    return CatalogAdapter(
        record.adapter_id, record.sha256, record.nbytes, max(ranks.values()), source
    )
