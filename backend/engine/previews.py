"""Live previews while denoising: a linear latent -> RGB map per model, no VAE decode in the loop.

Like ComfyUI's and A1111's "latent2rgb" previews: a latent pixel's colour is close to an affine
function of its C channels, so a (C + 1) x 3 matrix (the last row a bias) turns a latent image
into a small RGB image for a fraction of a millisecond.

* **Fitting** (``fit_latent_rgb``): once per model, with the model's own VAE. A fixed set of
  held-out generated scenes (``backend.training.scenes.make_scene``) is encoded (the posterior's
  mean, in the engine's latent convention: ``(z - shift) * scale``, the shift for Flux only);
  every latent pixel is paired with the mean RGB of the image patch it covers, and the matrix is
  the least-squares solution. A worker that loads no VAE (an engine worker loads the denoiser
  only) loads the VAE alone for the fit; the map is kept in memory and on disk under
  ``<models_dir>/.latent-rgb/``, keyed by the model's fingerprint (id + revision), so a restart
  does not fit again (``latent_rgb_map``).
* **A frame** (``JobPreview.frame``): the row's estimate of the clean latents after a step (the
  x0 the scheduler's own update implies, ``clean_estimate``; the latents themselves for a
  scheduler it does not know), composed with the template's known latents outside the mask (the
  masked-image latents the request is conditioned on: the preview shows the template outside the
  painted area, like the final result), mapped to RGB, upscaled with PIL bilinear by the largest
  integer factor that keeps its long side within ``preview_px`` (never scaled down: a latent image
  that large is sent as it is), PNG-encoded as a ``data:image/png;base64,...`` URL. Because the map
  is affine, the composition is done in RGB: the template's part is mapped once per job, and a
  latent pixel with no painted pixel under it is the template's colour at every step.

* **Budget** (``Previews``): a token bucket keeps previews within a share of the denoiser's time;
  a step that cannot afford one goes without (the worker's longest-waiting rows go first).

Invariants: no VAE runs in the step loop; the preview outside the mask is the same at every step of
a job; a failed frame never fails its job (the worker logs it and stops that job's previews).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from backend.atomic import write_atomic

log = logging.getLogger(__name__)

FIT_VERSION = 1  # bump when fitting changes: persisted maps of an older fit are not read
FIT_SCENES = tuple(range(32))  # held-out scene seeds the map is fitted on (12: r 0.81, 32: 0.87)
FIT_BATCH = 8  # scenes encoded at once
FIT_SIZE = 128  # px per side of a fitting scene
DEFAULT_PREVIEW_PX = 64  # long side a preview is upscaled to, px
DEFAULT_BUDGET = 0.025  # previews take at most this share of the denoiser's time
CREDIT_CAP_S = 0.1  # preview time saved up at most (no burst after a long run without previews)
PNG_PREFIX = "data:image/png;base64,"
FLUX = "flux-fill"
_EULER = "EulerDiscreteScheduler"
_FLOW = "FlowMatchEulerDiscreteScheduler"


@dataclass(frozen=True)
class LatentRgbMap:
    """``rgb = [latent channels, 1] @ weights`` per latent pixel, rgb in [0, 1]."""

    weights: np.ndarray  # (C + 1, 3) float32, last row the bias

    @property
    def channels(self) -> int:
        return self.weights.shape[0] - 1

    def rgb(self, latents: torch.Tensor) -> np.ndarray:
        """(H, W, 3) float32 colours (not clipped) of an unpacked (1, C, H, W) or (C, H, W)
        latent image."""
        latents = latents.detach().reshape(-1, *latents.shape[-2:]).to("cpu", torch.float32)
        if latents.shape[0] != self.channels:
            raise ValueError(
                f"latents have {latents.shape[0]} channels, the map {self.channels}: wrong model"
            )
        channels_last = latents.permute(1, 2, 0).numpy()
        return channels_last @ self.weights[:-1] + self.weights[-1]

    def to_json(self) -> str:
        return json.dumps({"fit_version": FIT_VERSION, "weights": self.weights.tolist()})

    @classmethod
    def from_json(cls, text: str) -> LatentRgbMap:
        values = json.loads(text)
        if values.get("fit_version") != FIT_VERSION:
            raise ValueError(f"latent-rgb map of fit version {values.get('fit_version')}")
        return cls(np.asarray(values["weights"], dtype=np.float32))


def engine_latents(vae, images: torch.Tensor, family: str) -> torch.Tensor:
    """The VAE's posterior means of ``images`` ((N, 3, H, W) in [-1, 1]) in the engine's latent
    convention (what the pipelines denoise and ``decode`` expects)."""
    config = vae.config
    latents = vae.encode(images.to(vae.device, vae.dtype)).latent_dist.mode().float()
    shift = (config.shift_factor or 0.0) if family == FLUX else 0.0
    return (latents - shift) * config.scaling_factor


@torch.no_grad()
def fit_latent_rgb(vae, family: str, seeds=FIT_SCENES, size: int = FIT_SIZE) -> LatentRgbMap:
    """Least-squares latent -> RGB map of ``vae`` (module docstring)."""
    from backend.training.scenes import make_scene

    pixels = np.stack([np.asarray(make_scene(s, "heldout", size).image) for s in seeds])
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255.0  # (N, 3, H, W) [0, 1]
    latents = torch.cat(
        [
            engine_latents(vae, batch * 2 - 1, family).cpu().double()
            for batch in images.split(FIT_BATCH)
        ]
    )  # (N, C, h, w)
    patch = size // latents.shape[-1]
    targets = F.avg_pool2d(images.double(), patch)  # the mean colour under each latent pixel
    x = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    y = targets.permute(0, 2, 3, 1).reshape(-1, 3)
    weights = torch.linalg.lstsq(x, y).solution
    return LatentRgbMap(weights.float().numpy())


def map_path(models_dir: Path, model_id: str, revision: str) -> Path:
    """Where the map of a model with this fingerprint is kept (the id may be a path)."""
    digest = hashlib.sha256(f"{model_id}\0{revision}\0{FIT_VERSION}".encode()).hexdigest()[:24]
    return Path(models_dir) / ".latent-rgb" / f"{digest}.json"


_MAPS: dict[Path, LatentRgbMap] = {}  # in-memory, by persisted path (one per fingerprint)


def latent_rgb_map(engine, models_dir: Path) -> LatentRgbMap:
    """The engine's model's map: from memory, else from disk, else fitted (with the pipeline's
    VAE, or the VAE loaded alone when the engine has none) and saved."""
    from backend.engine.families import VAE
    from backend.models.registry import model_revision

    spec = engine.spec
    path = map_path(models_dir, spec.model_id, model_revision(spec))
    if path in _MAPS:
        return _MAPS[path]
    fitted = None
    if path.is_file():
        try:
            fitted = LatentRgbMap.from_json(path.read_text())
        except (OSError, ValueError, KeyError) as exc:
            log.warning("latent-rgb map %s unreadable (%s): fitting it again", path, exc)
    if fitted is None:
        if engine.adapter.holds(VAE):
            vae = engine.pipe.vae
        else:
            vae = _load_vae(spec.model_id, models_dir)
        fitted = fit_latent_rgb(vae, spec.family)
        try:
            write_atomic(path, fitted.to_json().encode())
        except OSError as exc:  # a read-only models dir: keep it in memory only
            log.warning("latent-rgb map not saved to %s: %s", path, exc)
    _MAPS[path] = fitted
    return fitted


def _load_vae(model_id: str, models_dir: Path):
    from backend.models import load_pipeline

    return load_pipeline(model_id, models_dir, components={"vae", "scheduler"}).vae


def clean_estimate(scheduler, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The clean latents (x0) that a deterministic Euler step from ``before`` to ``after`` implies:
    both Euler (any prediction type, no churn) and flow-matching Euler steps are
    ``after = before + (sigma_next - sigma) * (before - x0) / sigma``, so
    ``x0 = before - sigma * (after - before) / (sigma_next - sigma)`` (exact up to rounding; it is
    the scheduler's own ``pred_original_sample``). Call right after the step (the scheduler's step
    index points past it). Any other scheduler: ``after``."""
    index = getattr(scheduler, "step_index", None)
    sigmas = getattr(scheduler, "sigmas", None)
    if type(scheduler).__name__ not in (_EULER, _FLOW) or index is None or sigmas is None:
        return after
    if not 1 <= index < len(sigmas):
        return after
    sigma, sigma_next = float(sigmas[index - 1]), float(sigmas[index])
    if sigma == sigma_next:
        return after
    before, after = before.float(), after.float()
    return before - sigma * (after - before) / (sigma_next - sigma)


def unpack(engine, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(1, C, h, w) latents: Flux's packed tokens unpacked as its ``decode`` does, others as they
    are."""
    if engine.spec.family != FLUX:
        return latents
    pipe = engine.pipe
    return pipe._unpack_latents(latents, size[0], size[1], pipe.vae_scale_factor)


def known_latents(engine, extra_channels: torch.Tensor, channels: int, size) -> torch.Tensor:
    """The template's latents outside the mask, as the request is conditioned on them (the
    masked-image latents of its extra channels), unpacked: (1, C, h, w)."""
    if engine.spec.family == FLUX:  # packed (masked image latents, mask), 4 channels per token
        return unpack(engine, extra_channels[..., : channels * 4], size)
    return extra_channels[:, 1 : 1 + channels]  # (mask, masked image latents)


def encode_png(rgb: np.ndarray, preview_px: int) -> str:
    """A ``data:image/png;base64,...`` URL of (h, w, 3) colours in [0, 1], of ``preview_size``
    (upscaled bilinearly)."""
    image = Image.fromarray((np.clip(rgb, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8))
    target = preview_size(rgb.shape[:2], preview_px)
    if target != image.size:
        image = image.resize(target, Image.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)  # as small as 6 here, and faster
    return PNG_PREFIX + base64.b64encode(buffer.getvalue()).decode("ascii")


def preview_size(latent_hw: tuple[int, int], preview_px: int) -> tuple[int, int]:
    """(width, height) of the preview of a latent image of ``latent_hw``: upscaled by the largest
    integer factor keeping the long side within ``preview_px``, at least 1."""
    height, width = latent_hw
    factor = max(1, preview_px // max(height, width))
    return width * factor, height * factor


class JobPreview:
    """One job's previews: the template's colours and the mask's weight per latent pixel, fixed
    when the job is admitted."""

    def __init__(self, engine, latent_map: LatentRgbMap, prepared, preview_px: int):
        size = tuple(prepared.params["size"])
        self.engine, self.map, self.size, self.preview_px = engine, latent_map, size, preview_px
        known = known_latents(engine, prepared.extra_channels, latent_map.channels, size)
        self.template_rgb = latent_map.rgb(known)
        height, width = self.template_rgb.shape[:2]
        # the share of painted pixels under each latent pixel: 0 = the template's colour
        pixels = torch.from_numpy(np.asarray(prepared.pixels, dtype=np.float32))[None, None]
        alpha = F.adaptive_avg_pool2d(pixels, (height, width))[0, 0].numpy()
        self.alpha = alpha[..., None]
        self.sent_at = 0.0  # monotonic time of the last frame (the longest-waiting row goes first)

    def frame(self, scheduler, before: torch.Tensor, after: torch.Tensor) -> str:
        """The preview after a step from ``before`` to ``after`` (latents as the engine keeps
        them)."""
        clean = unpack(self.engine, clean_estimate(scheduler, before, after), self.size)
        rgb = self.alpha * self.map.rgb(clean) + (1.0 - self.alpha) * self.template_rgb
        self.sent_at = time.monotonic()
        return encode_png(rgb, self.preview_px)


@dataclass
class Previews:
    """A worker's previews: its model's map, every how many steps (``every`` >= 1), how large, and
    their time budget.

    ``budget``: the share of the denoiser's time previews may take (0: no cap), a token bucket:
    every forward pass earns ``budget`` times its seconds (``earn``), every frame spends what it
    took (``spend``), and no frame is made while the credit is below zero. A model whose steps are
    short next to a frame (a tiny model, a big batch on a fast GPU) gets fewer previews instead of
    slower steps."""

    latent_map: LatentRgbMap
    every: int = 1
    preview_px: int = DEFAULT_PREVIEW_PX
    budget: float = DEFAULT_BUDGET
    credit_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"previews every {self.every} steps: use 1 or more (no Previews: off)")
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"preview budget {self.budget} is not a share in [0, 1]")

    def start(self, engine, prepared) -> JobPreview:
        return JobPreview(engine, self.latent_map, prepared, self.preview_px)

    def earn(self, forward_s: float) -> None:
        if self.budget > 0:
            self.credit_s = min(self.credit_s + self.budget * forward_s, CREDIT_CAP_S)

    def spend(self, seconds: float) -> None:
        if self.budget > 0:
            self.credit_s -= seconds

    def frames(self, rows: list[tuple], forward_s: float) -> tuple[dict[str, str], list[str]]:
        """Previews of the step just taken: ``rows`` are (job preview or None, job id, state,
        latents before the step). Returns (job id -> frame, for the rows whose preview is due,
        longest-waiting first; job ids whose preview failed, to get no more)."""
        self.earn(forward_s)
        made, broken = {}, []
        for preview, job_id, state, latents in sorted(
            (row for row in rows if row[0] is not None), key=lambda row: row[0].sent_at
        ):
            if not self.due(state.step):
                continue
            started = time.perf_counter()
            try:
                made[job_id] = preview.frame(state.req.scheduler, latents, state.latents)
            except Exception:  # a preview is never worth failing a job for
                log.exception("preview of %s failed: no more previews for it", job_id)
                broken.append(job_id)
            self.spend(time.perf_counter() - started)
        return made, broken

    def due(self, step: int) -> bool:
        """Whether the running event after finished step ``step`` carries a preview (its step is
        one of every ``every``, and the budget has room)."""
        return step % self.every == 0 and (self.budget == 0 or self.credit_s >= 0)


def worker_previews(settings, engine) -> Previews | None:
    """The previews an engine worker makes with these settings (None: ``preview_every`` 0)."""
    worker = settings.worker
    if worker.preview_every == 0:
        return None
    latent_map = latent_rgb_map(engine, settings.paths.resolved_models_dir())
    return Previews(latent_map, worker.preview_every, worker.preview_px, worker.preview_budget)


def measure(model_id: str, models_dir: Path, steps: int = 20, seed: int = 0) -> dict:
    """Median seconds of a denoising step and of its preview, and the previews' mean size, on one
    edit of ``model_id`` at its default resolution (a sample template, a centred mask), a preview
    at every step."""
    from backend.config import load_settings
    from backend.engine.editor import MaskAwareEngine
    from backend.engine.factory import edit_params
    from backend.models import load_pipeline, resolve_model
    from templates_store.samples import sample_template

    spec = resolve_model(model_id)
    side = spec.default_resolution
    engine = MaskAwareEngine(load_pipeline(model_id, models_dir), spec, models_dir / "cache")
    params = edit_params(spec, load_settings({}), steps=steps, use_cache=False)
    mask = Image.new("L", (side, side), 0)
    mask.paste(255, (side // 4, side // 4, 3 * side // 4, 3 * side // 4))
    prepared = engine.encode(sample_template(side, side, seed), mask, "a red ball", seed, params)
    state = engine.admit(prepared)
    preview = Previews(latent_rgb_map(engine, models_dir)).start(engine, prepared)
    step_s, preview_s, sizes = [], [], []
    while not state.done:
        before, started = state.latents, time.perf_counter()
        engine.step([state], params.mode)
        step_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        url = preview.frame(state.req.scheduler, before, state.latents)
        preview_s.append(time.perf_counter() - started)
        sizes.append(len(url))
    step, cost = float(np.median(step_s)), float(np.median(preview_s))
    return {
        "model": model_id,
        "step_ms": 1000 * step,
        "preview_ms": 1000 * cost,
        "share": cost / step,
        "bytes": int(np.mean(sizes)),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m backend.engine.previews [MODEL ...]``: what a preview costs per step."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "models", nargs="*", default=["tiny-sd2-inpaint", "tiny-sdxl-inpaint", "tiny-flux-fill"]
    )
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        for model_id in args.models:
            row = measure(model_id, Path(root), args.steps)
            print(
                f"{row['model']}: step {row['step_ms']:.1f} ms, preview {row['preview_ms']:.2f} ms "
                f"({100 * row['share']:.1f}% of a step), {row['bytes']} bytes per preview URL"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
