"""Mask-aware editing engine: record a template's cache once, then edit its masked region fast.

``MaskAwareEngine`` is batch-ready: ``start`` turns a request into an ``EditState``, ``step`` runs
ONE denoising step for any list of states (each with its own template, step, mask and scheduler)
in one forward pass, and ``finish`` decodes and pastes back. ``edit`` and ``prepare_template`` are
the one-request loops over those three.

Invariants:
* unmasked latents of a cached edit follow the template's recorded trajectory at every step, so the
  cached activations and the latents they came from always agree;
* a request's seed drives noise inside its mask, the template's seed outside;
* with every token masked, or with no cache, the edit is the ordinary pipeline's computation;
* a cache holds the activations of the adapter set in its key (``CacheKey.adapters``, "" for the
  base model): a recording row applies exactly that set at every step (``step`` refuses
  otherwise), so a base cache never holds adapted activations. An edit with adapters reads its
  pinned (template, adapters) cache when there is one, else the base cache.

An engine may wrap a pipeline holding only some parts of the model (``backend.engine.factory``):
the CPU stages' engine encodes and decodes but has no denoiser (no units, no hooks); an engine
worker's denoises but has no text encoders or VAE weights. A call needing a missing part raises
``MissingComponentError``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backend.cache.key import (
    CacheKey,
    ModelKeyBasis,
    lookup_keys,
    pinned_key,
    template_key,
)
from backend.engine import cache_store
from backend.engine.attention import check_attention_batching, pads_attention
from backend.engine.buckets import buckets_steps, check_step_shapes, row_bucket
from backend.engine.cache_store import CacheWriter, TemplateCache, check_recording
from backend.engine.compiled import (
    check_compile_mode,
    compile_mode,
    compiled_step,
    release_graphs,
    step_compiles,
)
from backend.engine.context import ForwardContext, active_context
from backend.engine.families import (
    ADAPTERS,
    DENOISER,
    MissingComponentError,
    RequestTensors,
    UnitLayout,
)
from backend.engine.feeder import MODE_TENSORS, BatchCacheFeeder, RowCacheRef
from backend.engine.graph_book import GraphBook
from backend.engine.host import to_device
from backend.engine.layout import row_tokens
from backend.engine.lora import ResidentAdapters, RowAdapters, check_lora_batching
from backend.engine.prepared import PreparedRequest
from backend.engine.step_layouts import LayoutMemo, StepLayouts, TokensOf
from backend.engine.stepping import advance_step_indices, batched_step, guide_all
from backend.imaging.masks import (
    feather,
    feather_support,
    load_mask,
    paste_back,
    require_nonempty,
    token_mask,
)
from backend.models.registry import model_revision


@dataclass(frozen=True)
class EditParams:
    steps: int
    guidance: float
    size: tuple[int, int]  # (height, width) in pixels, multiples of the model's token size
    strength: float = 1.0
    negative_prompt: str = ""
    mode: str = "kv"
    template_seed: int = 0
    mask_margin: int = 0
    dense_above_ratio: float = 0.75
    feather_px: float = 0.0
    use_cache: bool = True
    record_on_first_edit: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> EditParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown edit parameters: {', '.join(unknown)}")
        return cls(**{**values, "size": tuple(values["size"])})


@dataclass
class EditState:
    """One request in flight. ``step`` counts finished denoising steps."""

    req: RequestTensors
    latents: torch.Tensor
    fresh: torch.Tensor  # bool, broadcastable to latents: tokens this request computes itself
    token_masks: object  # callable grid -> flat bool tensor, or None (every token fresh)
    # bucketed steps: grid -> the request's RowTokens on the device, built when it is admitted
    tokens: TokensOf | None = None
    cache: TemplateCache | None = None
    trajectory: torch.Tensor | None = None  # (steps + 1, *latents.shape[1:]) template latents
    writer: CacheWriter | None = None
    recorded_latents: list[torch.Tensor] = field(default_factory=list)
    mask_ratio: float = 1.0  # fresh tokens / all tokens on the model's token grid
    grid: tuple[int, int] = (0, 0)  # the model's token grid at the request's size
    step: int = 0
    adapters: RowAdapters = ()  # (adapter id, scale) applied to both halves of the request

    @property
    def done(self) -> bool:
        return self.step >= len(self.req.timesteps)


@dataclass
class EditResult:
    image: Image.Image  # after paste-back
    generated: Image.Image  # decoded output before paste-back
    latents: torch.Tensor
    seed: int
    mask_ratio: float
    used_cache: bool
    timings: dict[str, float]


class MaskAwareEngine:
    def __init__(
        self,
        pipe,
        spec,
        cache_root: Path,
        planners: dict | None = None,
        attention: str = "auto",
        lora_batching: str = "stacked",
        step_shapes: str = "auto",
        compile_steps: str = "off",
        graphs: GraphBook | None = None,
    ):
        self.pipe, self.spec, self.cache_root = pipe, spec, Path(cache_root)
        self.attention = check_attention_batching(attention)
        self.step_shapes = check_step_shapes(step_shapes)
        # bucketed steps run their whole forward compiled (``backend.engine.compiled``)
        self.compile_steps = check_compile_mode(compile_steps)
        # the step graphs the engine may compile (``graph_book``)
        self.graphs = graphs if graphs is not None else GraphBook()
        self._layout_memo: LayoutMemo | None = None
        self.lora_batching = check_lora_batching(lora_batching)
        self.adapter = ADAPTERS[spec.family](pipe, spec.max_sequence_length)
        # mode -> planner(states, mode) -> use_cache per unit (profiler.make_planner); none: all
        self.planners = dict(planners or {})
        # without a denoiser (the CPU stages' engine) there are no units to hook
        self._units = self.adapter.install_hooks() if self.adapter.holds(DENOISER) else None
        self.token_size = self.adapter.token_px
        self._adapters: ResidentAdapters | None = None

    @property
    def adapters(self) -> ResidentAdapters:
        """The LoRA adapters on the device that rows may name (``EditState.adapters``)."""
        if self._adapters is None:
            self._adapters = ResidentAdapters(self.adapter.denoiser, self.adapter.lora_kind)
        return self._adapters

    @property
    def units(self) -> UnitLayout:
        if self._units is None:
            raise MissingComponentError(
                f"{self.spec.model_id} was loaded without its denoiser (the CPU stages' part of "
                "the model): it has no units to step, record or plan"
            )
        return self._units

    @property
    def num_units(self) -> int:
        return self.units.num_units

    @property
    def stack_ids(self) -> tuple[int, ...]:
        return self.units.stack_ids

    # ----- keys and validation -------------------------------------------------------------
    def key_basis(self) -> ModelKeyBasis:
        """What this model contributes to its cache keys (published for the cache status, which
        builds keys without loading the model)."""
        return ModelKeyBasis(
            model_id=self.spec.model_id,
            revision=model_revision(self.spec),
            scheduler=type(self.pipe.scheduler).__name__,
            uses_cfg=self.adapter.uses_cfg,
            size_multiple=self.size_multiple,
        )

    def cache_key(
        self, template: Image.Image, params: EditParams, adapters: RowAdapters = ()
    ) -> CacheKey:
        """The template's base cache key, or with ``adapters`` its pinned cache's."""
        base = template_key(
            self.key_basis(),
            template,
            params.size,
            steps=params.steps,
            strength=params.strength,
            guidance=params.guidance,
            template_seed=params.template_seed,
            mode=params.mode,
        )
        return pinned_key(base, adapters)

    @property
    def size_multiple(self) -> int:
        """Image sides must be multiples of this (a token, times 2 for every halving of the token
        grid inside the denoiser)."""
        return self.token_size * 2**self.spec.traits.grid_halvings

    def _check_params(self, params: EditParams) -> None:
        height, width = params.size
        multiple = self.size_multiple
        if height % multiple or width % multiple or height <= 0 or width <= 0:
            raise ValueError(
                f"size {width}x{height} must be positive multiples of {multiple} px for "
                f"{self.spec.model_id}"
            )
        if params.mode not in MODE_TENSORS:
            raise ValueError(
                f"cache mode must be one of {sorted(MODE_TENSORS)}, got {params.mode!r}"
            )
        if not 0.0 < params.strength <= 1.0:
            raise ValueError(f"strength must be in (0, 1], got {params.strength}")
        if params.steps < 1:
            raise ValueError(f"steps must be at least 1, got {params.steps}")

    def pixel_mask(
        self, image: Image.Image, mask: Image.Image | None, params: EditParams
    ) -> np.ndarray:
        """Bool (H, W) mask at the model resolution; ``None`` means keep everything (recording)."""
        if mask is None:
            return np.zeros(params.size, dtype=bool)
        pixels = load_mask(mask, expected_size=image.size)
        resized = Image.fromarray(pixels.astype(np.uint8) * 255).resize(
            params.size[::-1], Image.NEAREST
        )
        return np.asarray(resized) > 127

    # ----- batch-ready core -----------------------------------------------------------------
    @torch.no_grad()
    def encode(
        self,
        image: Image.Image,
        mask: Image.Image | None,
        prompt: str,
        seed: int,
        params: EditParams,
        pixels: np.ndarray | None = None,
        record: bool = False,
    ) -> PreparedRequest:
        """Pre-processing (text encoders, VAE encode, mask resize): everything before the first
        step.

        ``pixels``: the mask already read by ``pixel_mask`` (else it is read from ``mask``)."""
        self._check_params(params)
        if pixels is None:
            pixels = self.pixel_mask(image, mask, params)
        rgb = image.convert("RGB")
        mask_image = Image.fromarray(pixels.astype(np.uint8) * 255)
        req = self.adapter.prepare(
            rgb,
            mask_image,
            prompt,
            params.negative_prompt,
            params.guidance,
            params.steps,
            params.strength,
            seed,
            params.size,
        )
        template_latents = None
        if not record and pixels.mean() < 1.0:
            template_latents = self.adapter.template_latents(
                rgb, params.steps, params.strength, params.template_seed, params.size
            )
        key = self.cache_key(image, params) if params.use_cache else None
        return PreparedRequest(
            model_id=self.spec.model_id,
            params=params.to_dict(),
            seed=seed,
            pixels=pixels,
            init_latents=req.init_latents,
            conditioning=req.conditioning,
            extra_channels=req.extra_channels,
            halves=req.halves,
            guidance=req.guidance,
            shared=req.shared,
            template_latents=template_latents,
            cache_key=key,
        )

    def admit(
        self,
        prepared: PreparedRequest,
        cache: TemplateCache | None = None,
        record: bool = False,
        adapters: RowAdapters = (),
    ) -> EditState:
        """Turn a prepared request into a running ``EditState`` (no encoder runs here). A
        recording request with adapters records a pinned cache: its writer's key must name the
        same adapter set (``cache_key(..., adapters)``)."""
        if prepared.model_id != self.spec.model_id:
            raise ValueError(
                f"request was prepared for {prepared.model_id}, this engine serves "
                f"{self.spec.model_id}"
            )
        params = EditParams.from_dict(prepared.params)
        scheduler, timesteps = self.adapter.schedule(params.steps, params.strength, params.size)
        req = RequestTensors(
            init_latents=prepared.init_latents,
            conditioning=prepared.conditioning,
            extra_channels=prepared.extra_channels,
            scheduler=scheduler,
            timesteps=timesteps,
            guidance=prepared.guidance,
            halves=prepared.halves,
            shared=prepared.shared,
        )
        grid = (params.size[0] // self.token_size, params.size[1] // self.token_size)
        # every pixel the feathered paste-back takes is computed fresh (the cache holds the
        # template's own values there); pre-processing hands over the support already, with 0
        support = feather_support(prepared.pixels, params.feather_px)
        fresh_tokens = token_mask(support, grid, params.mask_margin)
        ratio = float(fresh_tokens.mean())
        dense = record or cache is None or ratio > params.dense_above_ratio
        state = EditState(
            req=req,
            latents=req.init_latents,
            fresh=self._fresh(fresh_tokens, req),
            mask_ratio=ratio,
            grid=grid,
            token_masks=None if dense else self._token_mask_fn(prepared.pixels, params.mask_margin),
            adapters=tuple(adapters),
        )
        if not dense and self.buckets(req.init_latents.device):
            state.tokens = self._tokens_of(
                state.token_masks, req.init_latents.device, self._grids(grid)
            )
        if not dense:
            trajectory = to_device(cache.trajectory("latents"), req.init_latents.device)
            state.cache, state.trajectory = cache, trajectory.to(req.init_latents.dtype)
            state.latents = torch.where(state.fresh, req.init_latents, state.trajectory[0:1])
        elif prepared.template_latents is not None:
            state.latents = torch.where(state.fresh, req.init_latents, prepared.template_latents)
        return state

    def start(
        self,
        image: Image.Image,
        mask: Image.Image | None,
        prompt: str,
        seed: int,
        params: EditParams,
        cache: TemplateCache | None = None,
        record: bool = False,
        pixels: np.ndarray | None = None,
        adapters: RowAdapters = (),
    ) -> EditState:
        """``encode`` then ``admit`` in one process."""
        return self.admit(
            self.encode(image, mask, prompt, seed, params, pixels, record), cache, record, adapters
        )

    def _fresh(self, tokens: np.ndarray, req: RequestTensors) -> torch.Tensor:
        fresh = to_device(torch.from_numpy(tokens), req.init_latents.device)
        shape = (1, 1, *tokens.shape) if req.init_latents.dim() == 4 else (1, -1, 1)
        return fresh.reshape(shape)

    def _token_mask_fn(self, pixels: np.ndarray, margin: int):
        memo: dict[tuple[int, int], torch.Tensor] = {}

        def tokens(grid_hw: tuple[int, int]) -> torch.Tensor:
            if grid_hw not in memo:
                memo[grid_hw] = torch.from_numpy(token_mask(pixels, grid_hw, margin).reshape(-1))
            return memo[grid_hw]

        return tokens

    def release_graphs(self, nbytes: int) -> int:
        """Give back the compiled graphs' memory (a step ran out of device memory: the worker asks
        its releasers); the bytes they had taken. Steps compile again as they need graphs."""
        return release_graphs(self.graphs)

    def buckets(self, device: torch.device) -> bool:
        """Whether steps on ``device`` run with bucketed (static) shapes (``step_shapes``)."""
        return buckets_steps(self.step_shapes, torch.device(device).type)

    def layout_memo(self, device: torch.device) -> LayoutMemo:
        device = torch.device(device)
        if self._layout_memo is None or self._layout_memo.device != device:
            self._layout_memo = LayoutMemo(device)
        return self._layout_memo

    def _grids(self, grid: tuple[int, int]) -> list[tuple[int, int]]:
        """The token grids of the denoiser's mask-aware stacks over a latent token ``grid`` (one
        per halving)."""
        return [(grid[0] >> k, grid[1] >> k) for k in range(self.spec.traits.grid_halvings + 1)]

    @staticmethod
    def _tokens_of(masks, device: torch.device, grids: list[tuple[int, int]]) -> TokensOf:
        """A request's ``RowTokens`` per grid from its token masks, put on the device now for
        ``grids`` (a grid asked for later is built once, then kept too)."""
        built: dict[tuple[int, int], object] = {}

        def tokens(grid_hw: tuple[int, int]):
            if grid_hw not in built:
                built[grid_hw] = row_tokens(masks(grid_hw), grid_hw[0] * grid_hw[1], device)
            return built[grid_hw]

        for grid_hw in grids:
            tokens(grid_hw)
        return tokens

    def plan(self, states: list[EditState], mode: str) -> tuple[bool, ...]:
        if not any(s.cache is not None for s in states):
            return (False,) * self.num_units
        planner = self.planners.get(mode)
        if planner is None:
            return (True,) * self.num_units
        return tuple(planner(states, mode))

    @torch.no_grad()
    def step(
        self, states: list[EditState], mode: str, unit_seconds: dict[int, float] | None = None
    ) -> float:
        """One denoising step for every state in ``states`` (all of one cache mode).

        Returns the seconds the denoiser's forward pass took (the rest of the call is batching
        work).
        ``unit_seconds``, when given, receives the time each unit took (profiling).

        Bucketed (``buckets``): the forward runs ``row_bucket(len(states))`` requests, the last
        one repeated into the added places, each grid's masked tokens in their bucket; only the
        real rows' predictions are used or recorded."""
        device = states[0].latents.device
        bucketed = self.buckets(device)
        running = states
        if bucketed:
            running = states + [states[-1]] * (row_bucket(len(states)) - len(states))
        rows, row_t, refs, masks, reqs, tokens = [], [], [], [], [], []
        for s in running:
            t = s.req.timesteps[s.step]
            rows.append(self.adapter.step_rows(s.req, s.latents, t))
            row_t.append(t.reshape(1).repeat(s.req.halves))
            if bucketed and s.token_masks is not None and s.tokens is None:
                s.tokens = self._tokens_of(s.token_masks, device, [])  # admitted unbucketed
            for half in range(s.req.halves):
                refs.append(RowCacheRef(s.cache, s.step, half) if s.cache is not None else None)
                masks.append(s.token_masks)
                tokens.append(s.tokens)
            reqs.append(s.req)
        use_cache = self.plan(states, mode)
        units = [u for u in range(self.num_units) if use_cache[u]]
        feeder = BatchCacheFeeder(refs, units, mode, device) if units else None
        recording = check_recording(states, bool(units))
        row_adapters = [s.adapters for s in running for _ in range(s.req.halves)]
        ctx = ForwardContext(
            masks,
            use_cache,
            mode,
            feeder,
            {} if recording else None,
            device,
            unit_seconds=unit_seconds,
            lora=self.adapters.batch(row_adapters, device, stacked=self.lora_batching == "stacked"),
            padded_attention=bucketed or pads_attention(self.attention, device),
            layouts=StepLayouts(tokens, self.layout_memo(device)) if bucketed else None,
            compile_steps=compile_mode(self.compile_steps, device.type) if bucketed else "off",
            graphs=self.graphs,
        )
        # Nothing to reuse, record, adapt or time: the model's own (fastest dense) forward does
        # the same math.
        ordinary = not units and not recording and unit_seconds is None and ctx.lora is None
        batch_rows, batch_t = torch.cat(rows), torch.cat(row_t)
        forward_started = time.perf_counter()
        prediction = None
        if step_compiles(ctx):
            conditioning = self.adapter.batch_conditioning(reqs)
            prediction = compiled_step(
                ctx,
                ordinary,
                self.adapter.forward,
                self._grids(states[0].grid),
                MODE_TENSORS[mode],
                batch_rows,
                batch_t,
                conditioning,
                reqs[0].shared,
            )
        if prediction is None:
            with contextlib.nullcontext() if ordinary else active_context(ctx):
                prediction = self.adapter.denoise(batch_rows, batch_t, reqs)
        if prediction.is_cuda:
            torch.cuda.synchronize(prediction.device)  # forward time, not launch time
        forward_s = time.perf_counter() - forward_started
        if len(running) > len(states):
            prediction = prediction[: sum(s.req.halves for s in states)]
        offset = 0
        for s in states:
            if s.writer is not None:
                s.writer.write_step(
                    s.step,
                    {
                        k: v[offset : offset + s.req.halves]
                        for k, v in ctx.recorder.items()
                        if k[1] in MODE_TENSORS[mode]
                    },
                )
                s.recorded_latents.append(s.latents)
            offset += s.req.halves
        self._advance(states, prediction)
        return forward_s

    def _advance(self, states: list[EditState], prediction: torch.Tensor) -> None:
        """Guidance and scheduler update of every row, vectorised where the scheduler allows
        (``backend.engine.stepping``), else row by row through diffusers. Every new tensor is
        made before any state changes, so a step that runs out of memory here leaves the rows as
        they were (the worker retries it); the schedulers' step indices move last of all."""
        guided = guide_all(
            prediction, [s.req.halves for s in states], [s.req.guidance for s in states]
        )
        schedulers = [s.req.scheduler for s in states]
        stepped = batched_step(schedulers, guided, torch.cat([s.latents for s in states]))
        following = []
        for row, s in enumerate(states):
            if stepped is not None:
                latents = stepped[row : row + 1]
            else:
                latents = s.req.scheduler.step(
                    guided[row : row + 1], s.req.timesteps[s.step], s.latents, return_dict=False
                )[0]
            if s.trajectory is not None:
                latents = torch.where(s.fresh, latents, s.trajectory[s.step + 1 : s.step + 2])
            following.append(latents)
        for s, latents in zip(states, following):
            s.step += 1
            s.latents = latents
        if stepped is not None:
            advance_step_indices(schedulers)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, params: EditParams) -> Image.Image:
        """Post-processing, first half: the VAE decode of final latents."""
        return self.adapter.decode(latents, params.size)

    @staticmethod
    def compose(
        generated: Image.Image, image: Image.Image, pixels: np.ndarray, params: EditParams
    ) -> Image.Image:
        """Post-processing, second half: generated pixels inside the (feathered) mask, the
        original outside."""
        original = (
            image.convert("RGB").resize(params.size[::-1], Image.LANCZOS)
            if image.size != params.size[::-1]
            else image.convert("RGB")
        )
        alpha = (
            feather(pixels, params.feather_px)
            if params.feather_px > 0
            else pixels.astype(np.float32)
        )
        return paste_back(generated, original, alpha)

    def finish(
        self, state: EditState, image: Image.Image, pixels: np.ndarray, params: EditParams
    ) -> tuple:
        generated = self.decode(state.latents, params)
        return self.compose(generated, image, pixels, params), generated

    # ----- one-request loops ----------------------------------------------------------------
    @torch.no_grad()
    def prepare_template(
        self,
        image: Image.Image,
        params: EditParams,
        prompt: str = "",
        mask: Image.Image | None = None,
        adapters: RowAdapters = (),
    ) -> TemplateCache:
        """Run the ordinary computation over ``image`` with the template seed and record its
        cache; with ``adapters`` (resident) the pinned cache that only edits with exactly that
        set read."""
        key = self.cache_key(image, params, adapters)
        state = self.start(
            image, mask, prompt, params.template_seed, params, record=True, adapters=adapters
        )
        self._record(state, key, params)
        return state.writer.commit()

    def _record(self, state: EditState, key: CacheKey, params: EditParams) -> None:
        state.writer = CacheWriter(
            self.cache_root, key, self.num_units, state.req.halves, self.adapter.dtype
        )
        try:
            while not state.done:
                self.step([state], params.mode)
            state.writer.write_trajectory(
                {"latents": torch.cat(state.recorded_latents + [state.latents])}
            )
        except BaseException:
            state.writer.abort()
            raise

    def _check_cache(self, cache: TemplateCache, accepted: tuple[CacheKey, ...]) -> None:
        """``cache`` must be one of the ``accepted`` keys (``lookup_keys``)."""
        if cache.key not in accepted:
            expected = next((k for k in accepted if k.adapters == cache.key.adapters), accepted[-1])
            raise cache_store.CacheMismatchError(
                "template cache does not fit this edit: "
                + "; ".join(expected.mismatches(cache.key))
            )
        if cache.num_units != self.num_units:
            raise cache_store.CacheMismatchError(
                f"template cache has {cache.num_units} transformer units, {self.spec.model_id} has "
                f"{self.num_units}: the model changed, prepare the template again"
            )

    def lookup(
        self, image: Image.Image, params: EditParams, adapters: RowAdapters = ()
    ) -> TemplateCache | None:
        """The cache an edit with ``adapters`` reads: its pinned cache, else the base cache."""
        return self._first_cache(lookup_keys(self.cache_key(image, params), adapters))

    def _first_cache(self, keys: tuple[CacheKey, ...]) -> TemplateCache | None:
        found = (cache_store.lookup(self.cache_root, key) for key in keys)
        return next((cache for cache in found if cache is not None), None)

    @torch.no_grad()
    def edit(
        self,
        image: Image.Image,
        mask: Image.Image,
        prompt: str,
        seed: int,
        params: EditParams,
        cache: TemplateCache | None = None,
        adapters: RowAdapters = (),
    ) -> EditResult:
        """One edit from start to finish; ``adapters`` must be resident (``self.adapters``). An
        edit with adapters reads its pinned cache, else the base one, but never records one."""
        timings, started = {}, time.perf_counter()
        pixels = self.pixel_mask(image, mask, params)
        require_nonempty(pixels)
        keys = lookup_keys(self.cache_key(image, params), adapters) if params.use_cache else ()
        if cache is None:
            cache = self._first_cache(keys)
        if cache is not None and keys:
            self._check_cache(cache, keys)
        record = cache is None and params.use_cache and params.record_on_first_edit and not adapters
        state = self.start(
            image,
            mask,
            prompt,
            seed,
            params,
            cache=cache if params.use_cache else None,
            pixels=pixels,
            adapters=adapters,
        )
        timings["prepare_s"] = time.perf_counter() - started
        if record:
            self._record(state, keys[0], params)
            state.writer.commit()
        else:
            while not state.done:
                self.step([state], params.mode)
        timings["denoise_s"] = time.perf_counter() - started - timings["prepare_s"]
        result_image, generated = self.finish(state, image, pixels, params)
        timings["total_s"] = time.perf_counter() - started
        return EditResult(
            result_image,
            generated,
            state.latents,
            seed,
            state.mask_ratio,
            state.cache is not None,
            timings,
        )
