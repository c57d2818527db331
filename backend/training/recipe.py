"""The demo model's recipe: its architecture and every training hyperparameter, in one frozen value.

``Recipe()`` is the run that made the shipped ``demo-sd2-inpaint`` weights (about an hour on two CPU
cores); ``Recipe.smoke()`` is the same pipeline shrunk to seconds for the tests. A recipe is
written next to every checkpoint, and a run resumes only from checkpoints of the same recipe.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

from backend.models.configs import _clip, _sd2_unet, _vae

FAMILY = "sd2-inpaint"
PREDICTIONS = ("epsilon", "v_prediction")  # denoiser targets the family's Euler scheduler steps
# what the autoencoder's weights depend on (its checkpoint and the encoded examples are kept while
# only the denoiser's fields change)
AUTOENCODER_FIELDS = (
    "seed",
    "size",
    "vae_channels",
    "vae_scenes",
    "vae_crop",
    "vae_steps",
    "vae_batch",
    "vae_lr",
    "vae_kl_weight",
)


@dataclass(frozen=True)
class Recipe:
    size: int = 128  # training and default serving resolution (pixels per side)
    seed: int = 0
    # autoencoder: narrow at full resolution (it dominates a CPU's time), trained on random crops
    vae_channels: tuple[int, ...] = (16, 32, 64, 64)
    vae_scenes: int = 4000  # scene pool the crops come from
    vae_crop: int = 64
    vae_steps: int = 700
    vae_batch: int = 32
    vae_lr: float = 1e-3
    vae_kl_weight: float = 1e-6  # just enough to keep the latent bounded
    # denoiser: the sd2 UNet shape with the 9 inpainting input channels
    unet_channels: tuple[int, ...] = (64, 128, 128)
    unet_heads: tuple[int, ...] = (2, 4, 4)
    unet_layers: int = 1
    text_hidden: int = 64  # frozen CLIP text encoder at seed 0
    examples: int = 16000  # training examples, encoded once by the trained autoencoder
    unet_steps: int = 2600
    unet_batch: int = 32
    unet_lr: float = 5e-4
    warmup_steps: int = 100
    caption_dropout: float = 0.1  # empty caption, so classifier-free guidance has a baseline
    # what the denoiser predicts: "v_prediction" (Salimans & Ho 2022) keeps the first, noisiest
    # steps' estimate of the image sound on a 16 x 16 latent, where "epsilon" amplifies its error
    # ~15x; those steps decide the masked area's colour
    prediction: str = "v_prediction"
    min_snr_gamma: float = 5.0  # Min-SNR loss weighting (Hang et al. 2023): faster convergence
    ema_decay: float = 0.999
    checkpoint_every: int = 100  # optimiser steps between checkpoints

    @classmethod
    def smoke(cls, **overrides) -> Recipe:
        """A recipe of seconds: the whole pipeline on tiny shapes (tests, dry runs)."""
        small = dict(
            size=64,
            vae_channels=(8, 8, 8, 8),
            vae_scenes=8,
            vae_crop=32,
            vae_steps=3,
            vae_batch=4,
            unet_channels=(32, 32),
            unet_heads=(2, 2),
            text_hidden=32,
            examples=12,
            unet_steps=4,
            unet_batch=4,
            warmup_steps=2,
            checkpoint_every=2,
        )
        return replace(cls(**small), **overrides)

    def configs(self) -> dict[str, dict]:
        """Keyword arguments of each component's class (as ``configs.CONFIGS`` entries)."""
        vae = _vae(4, self.vae_channels[0], False)
        vae.update(
            block_out_channels=self.vae_channels,
            norm_num_groups=min(8, self.vae_channels[0]),
            sample_size=self.size,
        )
        unet = _sd2_unet(
            self.unet_channels, self.unet_heads, self.text_hidden, layers=self.unet_layers
        )
        unet.update(sample_size=self.size // 8)
        return dict(unet=unet, vae=vae, text_encoder=_clip(self.text_hidden, 2, 4))

    def __post_init__(self) -> None:
        if self.prediction not in PREDICTIONS:
            raise ValueError(
                f"unknown prediction {self.prediction!r}: use one of {', '.join(PREDICTIONS)}"
            )

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))  # tuples as lists, as JSON keeps them

    def fingerprint(self, *fields: str) -> str:
        """Hash of the named fields (all when none): what a stage's checkpoint depends on."""
        values = self.to_dict()
        chosen = {name: values[name] for name in (fields or tuple(values))}
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:12]
