"""`maskserve bench exactness`: how far the mask-aware engine's latents are from the ordinary
pipeline's on a device and dtype, for the tiny model of every family.

Checks, each a max absolute difference of final latents (one record per check and cache mode):

* ``all-masked-dense``: every token masked, no cache: the engine's dense path vs the pipeline;
* ``all-masked-cached``: every token masked through the cached path (the cache is read, every
  token computed) vs the pipeline;
* ``exact-replay``: the template cache recorded with the edit's own prompt, mask and seed, so the
  cached activations are the ones the edit would compute: vs the pipeline;
* ``mixed-batch``: two rows with other templates, masks, prompts and seeds in one forward, one
  row a step ahead of the other, vs each row run alone;
* ``pinned-feeder``: the cache read from pinned host RAM (on CUDA: side-stream copies, per-unit
  events) vs read from its files (plain copies): the same computation, so 0 is expected.

Tolerances: float32 (on CUDA with TF32 off, matmuls and convolutions) within 1e-4, so its
differences are summation-order ones only. A lower precision's rounding moves the ordinary
pipeline itself, so each check's bound is ``LOW_PRECISION_FACTOR`` times how far the ordinary
pipeline in that dtype lands from the ordinary pipeline in float32 on the same inputs (``floor``),
capped at ``LOW_PRECISION_CAP`` of the latents' largest magnitude: the mask-aware edit may differ
from the ordinary one no more than the dtype's own rounding moves the ordinary one, and never by a
tenth of the signal (a misplaced token or a wrong cache row differs by about all of it).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backend.cache import MemoryTemplateCache
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.ordinary import run_ordinary
from backend.models import load_pipeline, resolve_model
from templates_store.samples import sample_template

FAMILIES = ("sd2-inpaint", "sdxl-inpaint", "flux-fill")
MODES = ("kv", "hidden")
SIZE, STEPS = 128, 3
PROMPT = "a blue vase"
CHECKED_DTYPES = ("float32", "bfloat16")
FLOAT32_TOLERANCE = 1e-4
LOW_PRECISION_FACTOR = 1.5
LOW_PRECISION_CAP = 0.1


@dataclass
class ExactnessRecord:
    model: str
    device: str
    dtype: str
    check: str
    mode: str  # cache mode, "" where no cache is read
    max_abs_diff: float
    reference_max_abs: float  # the scale of the latents compared
    # float32: 0; else max |ordinary in dtype - ordinary in float32| on the check's inputs
    floor: float
    tolerance: float

    @property
    def within_tolerance(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def _rect_mask(box: tuple[int, int, int, int]) -> Image.Image:
    pixels = np.zeros((SIZE, SIZE), dtype=np.uint8)
    x0, y0, x1, y1 = box
    pixels[y0:y1, x0:x1] = 255
    return Image.fromarray(pixels)


FULL = Image.fromarray(np.full((SIZE, SIZE), 255, dtype=np.uint8))
MASK = _rect_mask((32, 40, 96, 80))
OTHER_MASK = _rect_mask((0, 0, 48, 128))


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _require(holds: bool, failure: str) -> None:
    if not holds:
        raise RuntimeError(f"exactness check is not measuring what it should: {failure}")


class _Checker:
    """The checks of one tiny model on one device and dtype."""

    def __init__(self, model_id: str, models_dir: Path, cache_dir: Path, device: str, dtype):
        spec = resolve_model(model_id)
        pipe = load_pipeline(model_id, models_dir, device=device, dtype=dtype)
        self.engine = MaskAwareEngine(pipe, spec, cache_dir)
        self.device, self.dtype = device, str(dtype).removeprefix("torch.")
        # the float32 ordinary pipeline that measures the dtype's own rounding (``floor``)
        self.full_precision = (
            None
            if dtype == torch.float32
            else load_pipeline(model_id, models_dir, device=device, dtype=torch.float32)
        )
        self.floors: dict[tuple[int, int], float] = {}
        self.template = sample_template(SIZE, SIZE, seed=7)
        self.records: list[ExactnessRecord] = []

    def params(self, **overrides) -> EditParams:
        fields = dict(
            steps=STEPS,
            guidance=self.engine.spec.default_guidance,
            size=(SIZE, SIZE),
            template_seed=5,
            record_on_first_edit=False,
        )
        return EditParams(**{**fields, **overrides})

    def ordinary(self, mask: Image.Image, seed: int, params: EditParams, pipe=None):
        return run_ordinary(
            pipe or self.engine.pipe,
            self.engine.spec,
            self.template,
            mask,
            PROMPT,
            seed,
            params,
            output_type="latent",
        )

    def floor(self, mask: Image.Image, seed: int) -> float:
        """How far the dtype's rounding moves the ordinary pipeline on these inputs (0 at
        float32)."""
        if self.full_precision is None:
            return 0.0
        key = (id(mask), seed)
        if key not in self.floors:
            params = self.params(use_cache=False)
            low = self.ordinary(mask, seed, params).float().cpu()
            full = self.ordinary(mask, seed, params, self.full_precision).float().cpu()
            self.floors[key] = (low - full).abs().max().item()
        return self.floors[key]

    def note(self, check: str, mode: str, ours, reference, floor_of: tuple) -> None:
        """Record one check; ``floor_of``: the (mask, seed) whose ordinary run sets the bound."""
        ours, reference = ours.float().cpu(), reference.float().cpu()
        floor, scale = self.floor(*floor_of), reference.abs().max().item()
        bound = min(LOW_PRECISION_FACTOR * floor, LOW_PRECISION_CAP * scale)
        self.records.append(
            ExactnessRecord(
                self.engine.spec.model_id,
                self.device,
                self.dtype,
                check,
                mode,
                (ours - reference).abs().max().item(),
                scale,
                floor,
                bound if floor else FLOAT32_TOLERANCE,
            )
        )

    def all_masked(self) -> None:
        params = self.params(use_cache=False)
        result = self.engine.edit(self.template, FULL, PROMPT, 3, params)
        self.note("all-masked-dense", "", result.latents, self.ordinary(FULL, 3, params), (FULL, 3))
        for mode in MODES:
            params = self.params(mode=mode, dense_above_ratio=1.0)
            cache = self.engine.prepare_template(self.template, params)
            result = self.engine.edit(self.template, FULL, PROMPT, 3, params, cache=cache)
            _require(result.used_cache, "the cached path did not run with every token masked")
            reference = self.ordinary(FULL, 3, params)
            self.note("all-masked-cached", mode, result.latents, reference, (FULL, 3))

    def exact_replay(self) -> None:
        for mode in MODES:
            params = self.params(mode=mode, template_seed=9)
            cache = self.engine.prepare_template(self.template, params, prompt=PROMPT, mask=MASK)
            result = self.engine.edit(self.template, MASK, PROMPT, 9, params, cache=cache)
            _require(result.used_cache and result.mask_ratio < 0.5, "replay ran dense")
            reference = self.ordinary(MASK, 9, params)
            self.note("exact-replay", mode, result.latents, reference, (MASK, 9))

    def mixed_batch(self) -> None:
        params = self.params(mode="kv")
        templates = [self.template, sample_template(SIZE, SIZE, seed=8)]
        caches = [self.engine.prepare_template(t, params) for t in templates]
        rows = list(zip(templates, (MASK, OTHER_MASK), (PROMPT, "a cat"), (1, 2), caches))

        def state(i):
            template, mask, prompt, seed, cache = rows[i]
            return self.engine.start(template, mask, prompt, seed, params, cache=cache)

        alone = [state(0), state(1)]
        for one in alone:
            while not one.done:
                self.engine.step([one], "kv")
        together = [state(0), state(1)]
        self.engine.step([together[0]], "kv")  # row 0 a step ahead from here on
        while not all(s.done for s in together):
            self.engine.step([s for s in together if not s.done], "kv")
        for row, (solo, batched) in enumerate(zip(alone, together)):
            floor_of = rows[row][1], rows[row][3]
            self.note(f"mixed-batch row {row}", "kv", batched.latents, solo.latents, floor_of)

    def pinned_feeder(self) -> None:
        pin = self.device.startswith("cuda")
        for mode in MODES:
            params = self.params(mode=mode)
            on_disk = self.engine.prepare_template(self.template, params)
            in_ram = MemoryTemplateCache.load(on_disk.path, pin_memory=pin)
            from_disk = self.engine.edit(self.template, MASK, PROMPT, 4, params, cache=on_disk)
            from_ram = self.engine.edit(self.template, MASK, PROMPT, 4, params, cache=in_ram)
            self.note("pinned-feeder", mode, from_ram.latents, from_disk.latents, (MASK, 4))


def run_exactness(
    models_dir: Path,
    cache_dir: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    families: tuple[str, ...] = FAMILIES,
) -> list[ExactnessRecord]:
    """Every check for the tiny model of each family in ``families``."""
    records: list[ExactnessRecord] = []
    with _no_tf32():
        for family in families:
            checker = _Checker(f"tiny-{family}", models_dir, cache_dir / family, device, dtype)
            checker.all_masked()
            checker.exact_replay()
            checker.mixed_batch()
            checker.pinned_feeder()
            records += checker.records
    return records


def write_records(records: list[ExactnessRecord], json_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) | {"within_tolerance": r.within_tolerance} for r in records]
    bounds = {
        "float32": FLOAT32_TOLERANCE,
        "low_precision_factor": LOW_PRECISION_FACTOR,
        "low_precision_cap": LOW_PRECISION_CAP,
    }
    json_path.write_text(json.dumps({"tolerance": bounds, "records": rows}, indent=1))
