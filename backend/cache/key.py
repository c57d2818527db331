"""The key of a template's activation cache, built without a model library (no torch).

One implementation for every process that names a cache: pre-processing builds the key of each job
it encodes (``MaskAwareEngine.cache_key``), and the API builds the key of a template for given
settings to say where that cache is (``backend.cachestatus``). Both call ``template_key``.

A key is everything that determines the recorded activations:

* the template's content: ``image_sha256`` of its decoded RGB pixels at the model resolution (the
  upload after its resolution bucket), so the same picture gives the same key whatever its file
  format, name or gallery id;
* what the job chooses: resolution (through the bucket's size), steps, strength, guidance (only
  for a model without classifier-free guidance: there it conditions the denoiser), and what the
  deployment sets (template seed, cache mode);
* what the loaded model contributes (``ModelKeyBasis``): its revision and scheduler, whether it uses
  classifier-free guidance, the multiple its image sides must have. Only a process that loaded the
  model knows these (a built model's revision hashes its tokenizers), so the CPU stages publish it;
* for a pinned cache, the LoRA adapter set it was recorded with (``adapter_set``: ids and scales).
  A base cache's key has ``adapters == ""`` and the same digest as before pinned caches existed.

Invariant of pinned keys: an adapter id names the adapter's content (the worker's ids are the
sha256 of the normalized adapter file), so the same id with other weights must never share a cache
root. An edit with adapters may read its pinned cache or the base cache (``lookup_keys``); an edit
without adapters reads only the base cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

from PIL import Image


@dataclass(frozen=True)
class CacheKey:
    """Everything that determines a template's recorded activations."""

    image_sha256: str
    model_id: str
    model_revision: str
    height: int
    width: int
    num_steps: int
    scheduler: str
    strength: float
    template_seed: int
    mode: str
    prompt: str = ""
    negative_prompt: str = ""
    guidance: float = 0.0
    mask_sha256: str = "none"
    adapters: str = ""  # adapter_set of a pinned cache; "" for the base model's

    def digest(self) -> str:
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:
        """Computed once per key (the worker asks for it for every waiting row at every step);
        the key is frozen, so it never goes stale. A base key hashes without its empty
        ``adapters``, so base caches recorded before pinned caches existed keep their digest."""
        fields = asdict(self)
        if not self.adapters:
            del fields["adapters"]
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def mismatches(self, other: CacheKey) -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [
            f"{k}: cache has {theirs[k]!r}, request needs {mine[k]!r}"
            for k in mine
            if mine[k] != theirs[k]
        ]


@dataclass(frozen=True)
class ModelKeyBasis:
    """What a loaded model contributes to its cache keys (``MaskAwareEngine.key_basis``)."""

    model_id: str
    revision: str  # registry.model_revision: changes whenever the weights change
    scheduler: str  # the class name of the pipeline's scheduler
    uses_cfg: bool  # classifier-free guidance: then guidance does not enter the key
    size_multiple: int  # image sides at the model resolution are multiples of this

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelKeyBasis:
        return cls(**json.loads(text))


def image_sha256(image: Image.Image) -> str:
    """Content hash of the decoded pixels (RGB) and size: same picture, same hash, whatever the
    file format."""
    rgb = image.convert("RGB")
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def key_guidance(uses_cfg: bool, guidance: float) -> float:
    """The guidance a key holds: a model with classifier-free guidance records its template with
    no prompt, so guidance changes nothing recorded (0.0); without it, guidance is an input of
    the denoiser."""
    return 0.0 if uses_cfg else guidance


def template_key(
    basis: ModelKeyBasis,
    template: Image.Image,
    size: tuple[int, int],
    *,
    steps: int,
    strength: float,
    guidance: float,
    template_seed: int,
    mode: str,
) -> CacheKey:
    """The key of ``template`` (its pixels at the model resolution, ``size`` = (height, width))
    recorded by ``basis``'s model with these settings."""
    return CacheKey(
        image_sha256=image_sha256(template),
        model_id=basis.model_id,
        model_revision=basis.revision,
        height=size[0],
        width=size[1],
        num_steps=steps,
        scheduler=basis.scheduler,
        strength=strength,
        template_seed=template_seed,
        mode=mode,
        guidance=key_guidance(basis.uses_cfg, guidance),
    )


def adapter_set(adapters: Iterable[tuple[str, float]]) -> str:
    """Canonical text of a row's adapters ((id, scale) pairs) as the engine applies them: a
    repeated id's scales add up (``BatchLora``), ids whose scale is then 0 are dropped (they change
    nothing), the rest sorted by id; ``""`` when nothing is left (the base model)."""
    scales: dict[str, float] = {}
    for adapter_id, scale in adapters:
        scales[adapter_id] = scales.get(adapter_id, 0.0) + float(scale)
    kept = sorted((adapter_id, scale) for adapter_id, scale in scales.items() if scale != 0.0)
    return json.dumps(kept, separators=(",", ":")) if kept else ""


def pinned_key(key: CacheKey, adapters: Iterable[tuple[str, float]]) -> CacheKey:
    """The key of ``key``'s template recorded with ``adapters`` (the base key for none)."""
    return replace(key, adapters=adapter_set(adapters))


def lookup_keys(key: CacheKey, adapters: Iterable[tuple[str, float]]) -> tuple[CacheKey, ...]:
    """The caches an edit with ``adapters`` may read, best first: its pinned cache, then the
    template's base cache (whether ``key`` is the base key or a pinned one)."""
    pinned, base = pinned_key(key, adapters), replace(key, adapters="")
    return (pinned, base) if pinned.adapters else (base,)
