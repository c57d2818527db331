"""Per-family glue between diffusers pipelines and the mask-aware step loop.

An adapter turns one request (image, mask, prompt, seed, ...) into ``RequestTensors`` by calling the
pipeline's own helpers in the pipeline's own order (so random draws match the ordinary pipeline
for the same seed), builds the model input of one step for a batch of rows, and runs the denoiser.
Rows: a request with classifier-free guidance owns two consecutive rows (uncond, cond), matching
the two halves recorded in a template cache; without guidance it owns one.

A pipeline may hold only some parts of the model (``backend.engine.factory.ROLES``): an adapter
never reaches for a part it was not given; a call that needs one raises ``MissingComponentError``
naming it.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux_fill import calculate_shift, retrieve_timesteps
from PIL import Image

from backend.engine.flux import install_flux_hooks
from backend.engine.unet import install_unet_hooks

# The parts of a model a role may leave out, each as the pipeline attributes that hold it (any one
# of them present counts: an SDXL checkpoint may have only its second text encoder).
DENOISER, VAE, TEXT_ENCODERS = "denoiser", "VAE", "text encoders"
# batches whose concatenated conditioning is kept: a worker stepping two groups of rows (two
# resolutions, say) alternates two batches every step
KEEP_BATCHES = 2
_PART_ATTRIBUTES = {VAE: ("vae",), TEXT_ENCODERS: ("text_encoder", "text_encoder_2")}


class MissingComponentError(RuntimeError):
    """A call needs a part of the model that this process's role did not load."""


def require_parts(pipe, denoiser_name: str, purpose: str, *parts: str) -> None:
    """Raise ``MissingComponentError`` unless ``pipe`` holds every one of ``parts``."""
    missing = [part for part in parts if not _holds(pipe, denoiser_name, part)]
    if missing:
        raise MissingComponentError(
            f"{purpose} needs the model's {' and '.join(missing)}, which this process did not "
            "load: engine workers load the denoiser only (everything with 'inline' batching), "
            "CPU workers the text encoders and VAE only"
        )


def _holds(pipe, denoiser_name: str, part: str) -> bool:
    names = (denoiser_name,) if part == DENOISER else _PART_ATTRIBUTES[part]
    return any(getattr(pipe, name, None) is not None for name in names)


@dataclass(frozen=True)
class UnitLayout:
    """The denoiser's mask-aware units in forward order, each with the id of its stack (the token
    grid it runs on: one stack for a DiT, one per transformer stack of a UNet)."""

    stack_ids: tuple[int, ...]

    @property
    def num_units(self) -> int:
        return len(self.stack_ids)


@dataclass
class RequestTensors:
    """Everything one request needs for its denoising steps. Leading dim 1 unless noted."""

    init_latents: torch.Tensor  # latents before step 0 (Flux: packed tokens)
    conditioning: dict[str, torch.Tensor]  # per-row model conditioning, leading dim = halves
    # concatenated to the latent input every step (mask + masked image)
    extra_channels: torch.Tensor
    # the request's own scheduler (diffusers schedulers keep a mutable step index)
    scheduler: object
    timesteps: torch.Tensor
    guidance: float
    halves: int
    # Inputs shared by every row of a resolution (Flux: text and image position ids).
    shared: dict[str, torch.Tensor] = field(default_factory=dict)


class FamilyAdapter(ABC):
    uses_cfg: bool
    denoiser_name: str  # the pipeline attribute that holds the denoiser
    lora_kind: str  # the layers adapters may update: a key of backend.engine.lora.TARGET_PATTERNS
    latent_patch: int  # latent pixels per token side (Flux packs 2x2 latent pixels per token)

    def __init__(self, pipe, max_sequence_length: int | None = None):
        self.pipe = pipe
        self.max_sequence_length = max_sequence_length
        # diffusers derives the execution device by walking every module; do it once.
        self.device = pipe._execution_device
        self._conditioning: OrderedDict[tuple[int, ...], tuple[tuple, dict]] = OrderedDict()

    def batch_conditioning(self, reqs: Sequence[RequestTensors]) -> dict[str, torch.Tensor]:
        """The rows' conditioning tensors concatenated in row order, kept while the same requests
        step together (the ``KEEP_BATCHES`` batches used last): a continuous batch concatenates
        them once, and what is derived from them can be kept on them (``unet._text_keys``)."""
        key = tuple(id(r) for r in reqs)
        kept = self._conditioning.get(key)
        if kept is not None and all(a is b for a, b in zip(kept[0], reqs)):
            self._conditioning.move_to_end(key)
            return kept[1]
        joined = {k: torch.cat([r.conditioning[k] for r in reqs]) for k in reqs[0].conditioning}
        self._conditioning[key] = (tuple(reqs), joined)
        while len(self._conditioning) > KEEP_BATCHES:
            self._conditioning.popitem(last=False)
        return joined

    def holds(self, part: str) -> bool:
        """Whether this pipeline loaded ``part`` (``DENOISER``, ``VAE`` or ``TEXT_ENCODERS``)."""
        return _holds(self.pipe, self.denoiser_name, part)

    def require(self, purpose: str, *parts: str) -> None:
        require_parts(self.pipe, self.denoiser_name, purpose, *parts)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model was loaded in (every part of one pipeline shares it)."""
        if self.holds(DENOISER):
            return self.denoiser.dtype
        self.require("reading the model's dtype", VAE)
        return self.pipe.vae.dtype

    @property
    def denoiser(self) -> torch.nn.Module:
        self.require("denoising", DENOISER)
        return getattr(self.pipe, self.denoiser_name)

    @property
    def token_px(self) -> int:
        """Image pixels per token side (the pipeline reads its VAE factor off the VAE's config,
        so a pipeline without VAE weights knows it too)."""
        return self.pipe.vae_scale_factor * self.latent_patch

    @abstractmethod
    def install_hooks(self) -> UnitLayout:
        """Put the mask-aware forward on the denoiser; its units in forward order."""

    @abstractmethod
    def prepare(
        self,
        image: Image.Image,
        mask: Image.Image,
        prompt: str,
        negative_prompt: str,
        guidance: float,
        steps: int,
        strength: float,
        seed: int,
        size: tuple[int, int],
    ) -> RequestTensors:
        """Request tensors; ``size`` is (height, width) in pixels."""

    @abstractmethod
    def schedule(
        self, steps: int, strength: float, size: tuple[int, int]
    ) -> tuple[object, torch.Tensor]:
        """A fresh scheduler for one request and its timesteps (deterministic: the CPU stages and
        the worker agree)."""

    @abstractmethod
    def _init_latents(self, init, scheduler, timesteps, strength, seed, size): ...

    def template_latents(
        self, image: Image.Image, steps: int, strength: float, seed: int, size
    ) -> torch.Tensor:
        """The latents before step 0 that ``prepare`` would draw with ``seed`` (the template's
        noise)."""
        self.require("drawing the template's latents", VAE)
        scheduler, timesteps = self.schedule(steps, strength, size)
        init = self.pipe.image_processor.preprocess(image, height=size[0], width=size[1]).to(
            dtype=torch.float32
        )
        return self._init_latents(init, scheduler, timesteps, strength, seed, size)[0]

    @abstractmethod
    def step_rows(
        self, req: RequestTensors, latents: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """Model input rows (halves, ...) of one request at timestep ``t``."""

    def denoise(
        self, rows: torch.Tensor, row_timesteps: torch.Tensor, reqs: list[RequestTensors]
    ) -> torch.Tensor:
        """Run the denoiser over all rows of a batch (rows of each request consecutive)."""
        return self.forward(rows, row_timesteps, self.batch_conditioning(reqs), reqs[0].shared)

    @abstractmethod
    def forward(
        self,
        rows: torch.Tensor,
        row_timesteps: torch.Tensor,
        conditioning: dict[str, torch.Tensor],
        shared: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The denoiser over a batch's rows, given their joined ``conditioning``
        (``batch_conditioning``) and the tensors the batch's requests share (``shared``). Tensors
        and dicts of tensors only, so ``torch.compile`` traces it whole (a compiled step)."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> Image.Image: ...

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(seed)

    @contextlib.contextmanager
    def _using(self, scheduler) -> Iterator[None]:
        """Let the pipeline's own helpers act on a request's scheduler instead of the shared one."""
        original, self.pipe.scheduler = self.pipe.scheduler, scheduler
        try:
            yield
        finally:
            self.pipe.scheduler = original

    def _timesteps(self, steps: int, strength: float, **kwargs) -> tuple[object, torch.Tensor]:
        scheduler = copy.deepcopy(self.pipe.scheduler)
        with self._using(scheduler):
            timesteps, steps = retrieve_timesteps(scheduler, steps, self.device, **kwargs)
            timesteps, steps = self.pipe.get_timesteps(steps, strength, self.device)
        if steps < 1:
            raise ValueError(
                f"strength {strength} leaves no denoising steps: raise strength or steps"
            )
        return scheduler, timesteps

    def _images(self, image: Image.Image, mask: Image.Image, size: tuple[int, int]):
        height, width = size
        init = self.pipe.image_processor.preprocess(image, height=height, width=width).to(
            dtype=torch.float32
        )
        mask_t = self.pipe.mask_processor.preprocess(mask, height=height, width=width)
        return init, mask_t


class UnetAdapter(FamilyAdapter):
    """SD2- and SDXL-style 9-channel inpainting UNets."""

    uses_cfg = True
    denoiser_name = "unet"
    lora_kind = "unet"  # which layers adapters may update (backend.engine.lora.TARGET_PATTERNS)
    latent_patch = 1

    def install_hooks(self) -> UnitLayout:
        stacks = install_unet_hooks(self.denoiser)
        return UnitLayout(tuple(s.stack_id for s in stacks for _ in range(s.num_units)))

    def prepare(self, image, mask, prompt, negative_prompt, guidance, steps, strength, seed, size):
        self.require("encoding a request", TEXT_ENCODERS, VAE)
        conditioning = self._encode(prompt, negative_prompt, size)
        scheduler, timesteps = self.schedule(steps, strength, size)
        init, mask_t = self._images(image, mask, size)
        latents, gen = self._init_latents(init, scheduler, timesteps, strength, seed, size)
        masked_image = init * (mask_t < 0.5)
        mask_lat, masked_lat = self.pipe.prepare_mask_latents(
            mask_t, masked_image, 1, size[0], size[1], self.dtype, self.device, gen, False
        )
        return RequestTensors(
            init_latents=latents,
            conditioning=conditioning,
            extra_channels=torch.cat([mask_lat, masked_lat], dim=1),
            scheduler=scheduler,
            timesteps=timesteps,
            guidance=guidance,
            halves=2,
        )

    def _init_latents(self, init, scheduler, timesteps, strength, seed, size):
        pipe, gen = self.pipe, self._generator(seed)
        with self._using(scheduler):
            latents, _noise = pipe.prepare_latents(
                1,
                pipe.vae.config.latent_channels,
                size[0],
                size[1],
                self.dtype,
                self.device,
                gen,
                image=init,
                timestep=timesteps[:1],
                is_strength_max=strength == 1.0,
                return_noise=True,
            )
        return latents, gen

    def schedule(self, steps, strength, size):
        return self._timesteps(steps, strength)

    def _encode(self, prompt: str, negative_prompt: str, size) -> dict[str, torch.Tensor]:
        embeds, negative = self.pipe.encode_prompt(prompt, self.device, 1, True, negative_prompt)
        return {"encoder_hidden_states": torch.cat([negative, embeds])}

    def step_rows(self, req, latents, t):
        scaled = req.scheduler.scale_model_input(torch.cat([latents] * 2), t)
        return torch.cat([scaled, torch.cat([req.extra_channels] * 2)], dim=1)

    def forward(self, rows, row_timesteps, conditioning, shared):
        conditioning = dict(conditioning)
        text = conditioning.pop("encoder_hidden_states")
        added = conditioning or None
        return self.denoiser(
            rows,
            row_timesteps,
            encoder_hidden_states=text,
            added_cond_kwargs=added,
            return_dict=False,
        )[0]

    def decode(self, latents, size):
        self.require("decoding", VAE)
        vae = self.pipe.vae
        image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")[0]


# the pipeline's defaults for checkpoints trained on aesthetic scores (``__call__`` arguments)
AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE = 6.0, 2.5


class SdxlAdapter(UnetAdapter):
    """SDXL inpainting: two text encoders plus pooled text and size conditions."""

    def _encode(self, prompt, negative_prompt, size):
        pipe = self.pipe
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=prompt,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=True,
            negative_prompt=negative_prompt,
        )
        time_ids, negative_time_ids = self._time_ids(size, embeds.dtype)
        return {
            "encoder_hidden_states": torch.cat([negative, embeds]),
            "text_embeds": torch.cat([negative_pooled, pooled]),
            "time_ids": torch.cat([negative_time_ids, time_ids]).to(self.device),
        }

    def _time_ids(self, size, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(positive, negative) size conditions, as the pipeline's ``_get_add_time_ids`` builds
        them for an uncropped image of ``size``: original size, crop corner (0, 0), then the
        target size, or the aesthetic score when the checkpoint's pipeline asks for one. That
        helper also checks the width against the UNet's embedding, which the CPU stages do not
        load; a wrong width still fails, in the UNet's forward."""
        if self.pipe.config.requires_aesthetics_score:
            ends = (AESTHETIC_SCORE,), (NEGATIVE_AESTHETIC_SCORE,)
        else:
            ends = tuple(size), tuple(size)
        positive, negative = (torch.tensor([[*size, 0, 0, *end]], dtype=dtype) for end in ends)
        return positive, negative


class FluxFillAdapter(FamilyAdapter):
    """Flux Fill: packed 2x2 latent tokens, fill conditioning channels, distilled guidance, no
    CFG."""

    uses_cfg = False
    denoiser_name = "transformer"
    lora_kind = "flux"
    latent_patch = 2

    def install_hooks(self) -> UnitLayout:
        return UnitLayout((0,) * install_flux_hooks(self.denoiser).num_units)

    def prepare(self, image, mask, prompt, negative_prompt, guidance, steps, strength, seed, size):
        self.require("encoding a request", TEXT_ENCODERS, VAE)
        pipe = self.pipe
        embeds, pooled, text_ids = pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length or 512,
        )
        scheduler, timesteps = self.schedule(steps, strength, size)
        init, mask_t = self._images(image, mask, size)
        (latents, image_ids), gen = self._init_latents(
            init, scheduler, timesteps, strength, seed, size
        )
        masked_image = (init * (1 - mask_t)).to(device=self.device, dtype=self.dtype)
        channels = pipe.vae.config.latent_channels
        mask_lat, masked_lat = pipe.prepare_mask_latents(
            mask_t, masked_image, 1, channels, 1, size[0], size[1], self.dtype, self.device, gen
        )
        conditioning = {
            "encoder_hidden_states": embeds,
            "pooled_projections": pooled,
            "guidance": torch.full([1], guidance, device=self.device, dtype=torch.float32),
        }
        return RequestTensors(
            init_latents=latents,
            conditioning=conditioning,
            extra_channels=torch.cat((masked_lat, mask_lat), dim=-1),
            scheduler=scheduler,
            timesteps=timesteps,
            guidance=guidance,
            halves=1,
            shared={"txt_ids": text_ids, "img_ids": image_ids},
        )

    def _init_latents(self, init, scheduler, timesteps, strength, seed, size):
        pipe, gen = self.pipe, self._generator(seed)
        with self._using(scheduler):
            packed = pipe.prepare_latents(
                init,
                timesteps[:1],
                1,
                pipe.vae.config.latent_channels,
                size[0],
                size[1],
                self.dtype,
                self.device,
                gen,
            )
        return packed, gen

    def schedule(self, steps, strength, size):
        height, width = size
        pipe = self.pipe
        seq_len = (height // pipe.vae_scale_factor // 2) * (width // pipe.vae_scale_factor // 2)
        config = pipe.scheduler.config
        mu = calculate_shift(
            seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        return self._timesteps(steps, strength, sigmas=sigmas, mu=mu)

    def template_latents(self, image, steps, strength, seed, size):
        return super().template_latents(image, steps, strength, seed, size)[0]

    def step_rows(self, req, latents, t):
        return torch.cat((latents, req.extra_channels), dim=2)

    def forward(self, rows, row_timesteps, conditioning, shared):
        # rows of one batch share a resolution and a text length, hence one set of position ids
        return self.denoiser(
            hidden_states=rows,
            timestep=row_timesteps.to(rows.dtype) / 1000,
            return_dict=False,
            **shared,
            **conditioning,
        )[0]

    def decode(self, latents, size):
        self.require("decoding", VAE)
        pipe, vae = self.pipe, self.pipe.vae
        latents = pipe._unpack_latents(latents, size[0], size[1], pipe.vae_scale_factor)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pil")[0]


ADAPTERS: dict[str, type[FamilyAdapter]] = {
    "sd2-inpaint": UnetAdapter,
    "sdxl-inpaint": SdxlAdapter,
    "flux-fill": FluxFillAdapter,
}
