"""`maskserve profile`: measure a model's unit costs on a device and fit the cost lines.

Compute samples are (FLOPs, seconds) of every unit, run with the cache at several mask ratios
and densely; load samples are (bytes, seconds) of moving one unit's cached tensors of one step
from the cache store to the device. The fitted ``CostProfile`` drives the bubble-free loading
plan (``plan.solve_plan``) of every batch and, later, the router's cost model.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from backend.costmodel.costs import (
    CostProfile,
    RowWork,
    UnitShape,
    build_profile,
    tokens_for_ratio,
    unit_flops,
)
from backend.costmodel.plan import solve_plan
from backend.costmodel.profiles import load_profile, profile_path
from backend.engine.editor import EditParams, EditState, MaskAwareEngine
from backend.engine.feeder import MODE_TENSORS
from backend.imaging.masks import synthetic_mask, token_mask
from templates_store.samples import sample_template

PROFILE_RATIOS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75)


def unit_shapes(engine: MaskAwareEngine, cache, mode: str) -> list[UnitShape]:
    """Shapes of every unit, read off a recorded cache (tokens, width, bytes per token)."""
    shapes = []
    text_tokens = engine.spec.max_sequence_length or 77
    for unit in range(engine.num_units):
        width, num_tokens, per_token = 0, 0, 0
        for name in MODE_TENSORS[mode]:
            if not cache.has(0, unit, name):
                continue
            tensor = cache.step_tensor(0, unit, name)
            num_tokens = tensor.shape[1]
            width = max(width, tensor.shape[2])
            per_token += tensor.shape[0] * tensor.shape[2] * tensor.element_size()
        shapes.append(
            UnitShape(
                f"unit{unit:03d}",
                engine.stack_ids[unit],
                num_tokens,
                width,
                text_tokens,
                cache_bytes_per_token=per_token,
            )
        )
    return shapes


def _grid_ratio(pixels: np.ndarray, num_tokens: int) -> float:
    side = math.isqrt(num_tokens)  # profiles run on square images
    return float(token_mask(pixels, (side, side)).mean())


def measure_profile(
    engine: MaskAwareEngine, mode: str, size: int, device: str, repeats: int = 2
) -> CostProfile:
    params = EditParams(
        steps=2,
        guidance=engine.spec.default_guidance,
        size=(size, size),
        mode=mode,
        dense_above_ratio=1.0,
        record_on_first_edit=False,
    )
    template = sample_template(size, size, seed=3)
    cache = engine.prepare_template(template, params)
    shapes = unit_shapes(engine, cache, mode)
    compute, load, rest = [], [], []
    for ratio in tqdm(
        (*PROFILE_RATIOS, None), desc=f"profile {engine.spec.model_id} {mode}", unit="ratio"
    ):
        pixels = synthetic_mask(size, size, ratio or 1.0, seed=5, kind="blob")
        mask = Image.fromarray(pixels.astype(np.uint8) * 255)
        for _ in range(repeats):
            state = engine.start(
                template, mask, "profile", 0, params, cache=cache if ratio else None
            )
            seconds: dict[int, float] = {}
            rest.append(_time_rest(engine, [state], mode, seconds))
            for unit, shape in enumerate(shapes):
                masked = (
                    shape.num_tokens
                    if ratio is None
                    else tokens_for_ratio(shape.num_tokens, _grid_ratio(pixels, shape.num_tokens))
                )
                flops = state.req.halves * unit_flops(shape, masked, dense=ratio is None)
                compute.append((flops, seconds[unit]))
    _time_load(
        cache, range(engine.num_units), mode, device
    )  # checksum check and page cache, untimed
    for count in range(1, engine.num_units + 1):  # growing batches of units: distinct byte counts
        load.append(_time_load(cache, range(count), mode, device))
    everything = Image.fromarray(synthetic_mask(size, size, 1.0, seed=5).astype(np.uint8) * 255)
    for _ in range(repeats):  # a dense batch of two requests: the rest's second row count
        pair = [engine.start(template, everything, "profile", seed, params) for seed in (0, 1)]
        rest.append(_time_rest(engine, pair, mode, {}))
    return build_profile(engine.spec.model_id, device, mode, shapes, compute, load, rest)


def _time_rest(engine: MaskAwareEngine, states: list, mode: str, seconds: dict) -> tuple:
    """(rows, seconds) of one step of ``states`` spent outside the units (``seconds`` receives
    each unit's time)."""
    started = time.perf_counter()
    engine.step(states, mode, unit_seconds=seconds)
    elapsed = time.perf_counter() - started
    return float(sum(s.req.halves for s in states)), max(0.0, elapsed - sum(seconds.values()))


def _time_load(cache, units, mode: str, device: str) -> tuple[float, float]:
    """(bytes, seconds) of reading some units' tensors of one step and placing them on
    ``device``."""
    target = torch.device(device)
    started = time.perf_counter()
    total = 0
    for unit in units:
        for name in MODE_TENSORS[mode]:
            if cache.has(1, unit, name):
                tensor = cache.step_tensor(1, unit, name)
                if target.type == "cuda":
                    tensor = tensor.pin_memory().to(target, non_blocking=True)
                total += tensor.numel() * tensor.element_size()
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    return float(total), time.perf_counter() - started


def make_planner(profile: CostProfile, num_units: int):
    """A batch planner for ``MaskAwareEngine``: the exact Algorithm 1 plan over the profile."""
    if len(profile.units) != num_units:
        raise ValueError(
            f"profile has {len(profile.units)} units, the model has {num_units}: "
            "re-run `maskserve profile`"
        )

    def plan(states: list[EditState], mode: str) -> tuple[bool, ...]:
        rows = [
            RowWork(
                s.mask_ratio if s.token_masks is not None else 1.0,
                str(s.cache.path) if s.cache else "dense",
                needs_load=s.cache is not None,
            )
            for s in states
            for _ in range(s.req.halves)
        ]
        return solve_plan(
            profile.unit_costs(rows), profile.stack_ids, monotone_within_stack=mode == "kv"
        ).use_cache

    return plan


def load_planners(profiles_dir: Path, model_id: str, device: str, num_units: int) -> dict:
    """Planners for every mode whose profile file exists and fits the model (others are skipped)."""
    planners = {}
    for mode in MODE_TENSORS:
        if profile_path(profiles_dir, model_id, device, mode).exists():
            profile = load_profile(profiles_dir, model_id, device, mode)
            if len(profile.units) == num_units:
                planners[mode] = make_planner(profile, num_units)
    return planners
