"""Adapter files: users' ``.safetensors`` read through diffusers' own loaders, and the normalized
format MaskServe stores and engine workers load.

Reading (``read_adapter``) goes the way ``pipe.load_lora_weights`` goes: the family's pipeline
class ``lora_state_dict`` (which converts the kohya layout), then, for the denoiser's keys,
``convert_unet_state_dict_to_peft`` and the ``LoraConfig`` diffusers builds
(``_create_lora_config``: the file's adapter metadata, else ranks and network alphas). A pair's
scale is what PEFT computes for that module from that config: ``alpha / r`` (``alpha / sqrt(r)``
with rsLoRA), ``r`` and ``alpha`` taken from ``rank_pattern`` / ``alpha_pattern`` by PEFT's own
``get_pattern_key``.

Invariants:
* nothing is ever unpickled: files are opened as safetensors only;
* an adapter that is read holds only 2-D pairs of the denoiser, rank ``1..max_rank``, at least one;
  anything else (an adapter of another model family, told from its names: ``family``;
  text-encoder layers, DoRA, convolution (LoCon) layers, LoRA biases, keys diffusers could not
  convert) is refused with ``AdapterFileError`` saying what and why;
* a normalized file holds ``<module>.down`` (rank, in) and ``<module>.up`` (out, rank) per pair and
  its metadata (``FORMAT_VERSION``, family, model, layout read from, per-module scale); it is
  written atomically and its bytes depend only on its content (the store deduplicates by hash).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from backend.adapters.container import safetensors_keys
from backend.adapters.family import other_family
from backend.adapters.store import AdapterError
from backend.atomic import atomic_path
from backend.engine.lora import LoraAdapter, LoraPair, check_adapter, lora_targets
from backend.models import resolve_model
from backend.models.configs import CONFIGS
from backend.models.registry import pipeline_class

FORMAT_VERSION = 1
META_KEY = "maskserve.adapter"
# family -> (prefix of its denoiser's keys in diffusers' LoRA state dicts, lora_targets kind)
DENOISERS = {
    "sd2-inpaint": ("unet", "unet"),
    "sdxl-inpaint": ("unet", "unet"),
    "flux-fill": ("transformer", "flux"),
}
TEXT_ENCODER_PREFIXES = ("text_encoder.", "text_encoder_2.")
REFUSED_MARKERS = {
    "dora_scale": "DoRA",
    "lora_magnitude_vector": "DoRA",
    "lokr_": "LoKr",
    "hada_": "LoHa",
}
SHOWN = 3  # layer names quoted in a message


class AdapterFileError(ValueError):
    """An adapter file the user must fix; the message says what and how. ``code``:
    ``unsupported_format`` (not a safetensors file), ``invalid`` (anything else)."""

    def __init__(self, message: str, code: str = "invalid"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ReadAdapter:
    adapter: LoraAdapter
    source_layout: str  # "peft" (diffusers/PEFT keys) or "kohya"


@dataclass(frozen=True)
class NormalizedMeta:
    family: str
    model_id: str
    source_layout: str


def _names(keys) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def _file_keys(path: Path) -> list[str]:
    try:
        return safetensors_keys(path)
    except AdapterError as exc:
        raise AdapterFileError(str(exc), exc.code) from None


def _refuse_unsupported_kinds(keys: list[str]) -> None:
    for marker, kind in REFUSED_MARKERS.items():
        hits = [key for key in keys if marker in key]
        if hits:
            raise AdapterFileError(
                f"the file is a {kind} adapter ({_names(hits)}): only plain LoRA adapters "
                "(down/up matrices of linear layers) are supported"
            )


def _layout(keys: list[str]) -> str:
    kohya = any(".lora_down." in key or key.startswith(("lora_unet_", "lora_te")) for key in keys)
    return "kohya" if kohya else "peft"


def _diffusers_state(path: Path, family: str, unet_config) -> tuple[dict, dict | None, dict | None]:
    """(state dict, network alphas, adapter metadata) as the pipeline's ``lora_state_dict`` gives
    them to ``load_lora_weights``."""
    loader = pipeline_class(family)
    options: dict = dict(
        weight_name=path.name,
        use_safetensors=True,  # never the pickle fallback
        local_files_only=True,
        return_lora_metadata=True,
    )
    if family == "flux-fill":
        options["return_alphas"] = True
    elif family == "sdxl-inpaint" and unet_config is not None:
        options["unet_config"] = unet_config
    try:
        state, alphas, metadata = loader.lora_state_dict(str(path.parent), **options)
    except (SafetensorError, OSError) as exc:
        raise AdapterFileError(
            f"the file could not be read ({exc}): it is truncated or corrupt; upload it again",
        ) from None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise AdapterFileError(
            f"diffusers could not convert this adapter's keys ({exc}): use a LoRA in the "
            "diffusers/PEFT layout or the kohya layout"
        ) from None
    return dict(state), alphas, metadata


def _denoiser_part(state: dict, alphas, metadata, prefix: str) -> tuple[dict, dict, dict | None]:
    """The denoiser's keys, alphas and metadata without their prefix, as ``load_lora_adapter``
    selects them; text-encoder or unconverted keys are refused."""
    encoder = sorted(
        {key.rsplit(".lora", 1)[0] for key in state if key.startswith(TEXT_ENCODER_PREFIXES)}
    )
    if encoder:
        raise AdapterFileError(
            f"the adapter has {len(encoder)} text-encoder LoRA layers ({_names(encoder)}): only "
            "the denoiser's layers are applied here; save the adapter without its text-encoder "
            "layers (e.g. train or export the UNet/transformer LoRA only)"
        )
    own = f"{prefix}."
    unknown = [key for key in state if not key.startswith(own)]
    if unknown:
        raise AdapterFileError(
            f"diffusers could not convert {len(unknown)} keys of the adapter ({_names(unknown)}): "
            "use a LoRA in the diffusers/PEFT layout or the kohya layout for this model family"
        )
    denoiser = {key.removeprefix(own): value for key, value in state.items()}
    alphas = {key.removeprefix(own): v for key, v in (alphas or {}).items() if key.startswith(own)}
    if metadata is not None:
        metadata = {k.removeprefix(own): v for k, v in metadata.items() if k.startswith(own)}
    return denoiser, alphas, metadata


def _peft_state(denoiser: dict) -> dict:
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    if denoiser and "lora_A" not in next(iter(denoiser)):
        denoiser = convert_unet_state_dict_to_peft(denoiser)
    for key, value in denoiser.items():
        if "lora_B" in key and key.endswith(".bias"):
            raise AdapterFileError(
                f"the adapter's {key.rsplit('.lora_B', 1)[0]} has a LoRA bias: adapters with "
                "biases on their up matrices are not supported"
            )
        if not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterFileError(
                f"diffusers could not convert the adapter's key {key}: use a LoRA in the "
                "diffusers/PEFT layout or the kohya layout"
            )
        if value.ndim != 2:
            raise AdapterFileError(
                f"the adapter's {key.rsplit('.lora_', 1)[0]} is a convolution (LoCon) layer "
                f"({value.ndim}-D weights): only linear layers are supported"
            )
    return denoiser


def _pairs(state: dict, alphas: dict, metadata: dict | None) -> dict[str, LoraPair]:
    from diffusers.utils.peft_utils import _create_lora_config
    from peft.utils.other import get_pattern_key

    rank = {f"^{key}": value.shape[1] for key, value in state.items() if "lora_B" in key}
    try:
        config = _create_lora_config(state, alphas or None, metadata, rank)
    except (TypeError, ValueError) as exc:
        raise AdapterFileError(f"the adapter's LoRA metadata is not valid: {exc}") from None
    if config.use_dora:
        raise AdapterFileError("the file is a DoRA adapter: only plain LoRA adapters are supported")
    modules = sorted({key.rsplit(".lora_", 1)[0] for key in state})
    pairs = {}
    for module in modules:
        down, up = state.get(f"{module}.lora_A.weight"), state.get(f"{module}.lora_B.weight")
        if down is None or up is None:
            raise AdapterFileError(f"the adapter's {module} lacks its down or up matrix")
        r_key = get_pattern_key(config.rank_pattern.keys(), module)
        alpha_key = get_pattern_key(config.alpha_pattern.keys(), module)
        r = config.rank_pattern.get(r_key, config.r)
        alpha = config.alpha_pattern.get(alpha_key, config.lora_alpha)
        if not down.shape[0] == up.shape[1] == r:
            raise AdapterFileError(
                f"the adapter's {module} has down rank {down.shape[0]} and up rank "
                f"{up.shape[1]}, its config says {r}: the file is inconsistent"
            )
        scale = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        pairs[module] = LoraPair(down.contiguous(), up.contiguous(), float(scale))
    return pairs


def read_adapter(
    source: Path | str | bytes,
    family: str,
    *,
    max_rank: int,
    unet_config=None,
    adapter_id: str = "",
) -> ReadAdapter:
    """The denoiser LoRA of a user's ``.safetensors`` (a path or its bytes) for ``family``.
    ``unet_config``: the SDXL UNet's config, with which diffusers maps kohya SGM block names.
    Raises ``AdapterFileError``."""
    if isinstance(source, bytes):
        with tempfile.TemporaryDirectory(prefix="maskserve-adapter-") as folder:
            path = Path(folder) / "adapter.safetensors"
            path.write_bytes(source)
            return read_adapter(
                path, family, max_rank=max_rank, unet_config=unet_config, adapter_id=adapter_id
            )
    path = Path(source)
    prefix, _kind = DENOISERS[family]
    keys = _file_keys(path)
    if not keys:
        raise AdapterFileError("the file holds no tensors: it is not a LoRA adapter")
    _refuse_unsupported_kinds(keys)
    mismatch = other_family(keys, family)
    if mismatch:  # before diffusers, whose conversion would fail on the other family's names
        raise AdapterFileError(mismatch)
    state, alphas, metadata = _diffusers_state(path, family, unet_config)
    denoiser, alphas, metadata = _denoiser_part(state, alphas, metadata, prefix)
    pairs = _pairs(_peft_state(denoiser), alphas, metadata)
    if not pairs:
        raise AdapterFileError(
            "the adapter has no LoRA layers for the denoiser: there is nothing to apply"
        )
    worst = max(pairs.items(), key=lambda item: item[1].rank)
    if worst[1].rank > max_rank:
        raise AdapterFileError(
            f"the adapter's {worst[0]} has rank {worst[1].rank}, over this deployment's limit of "
            f"{max_rank}: use an adapter of rank {max_rank} or less"
        )
    return ReadAdapter(LoraAdapter(adapter_id or path.stem, pairs), _layout(keys))


# ----- validation against a model ---------------------------------------------------------------
@cache
def _meta_denoiser(model_id: str) -> torch.nn.Module:
    """The model's denoiser built from its config on the meta device (no weights, no memory)."""
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    spec = resolve_model(model_id)
    prefix, _kind = DENOISERS[spec.family]
    model_class = FluxTransformer2DModel if prefix == "transformer" else UNet2DConditionModel
    with torch.device("meta"):
        if spec.form != "checkpoint":
            return model_class(**CONFIGS[(spec.family, spec.form)][prefix])
        try:
            config = model_class.load_config(str(spec.source), subfolder=prefix)
        except (OSError, ValueError) as exc:
            raise AdapterFileError(
                f"the configuration of model {model_id}'s {prefix} cannot be read ({exc})"
            ) from None
        return model_class.from_config(config)


@cache
def model_targets(model_id: str) -> dict[str, torch.nn.Linear]:
    """The layers adapters may update in the model's denoiser, by name (meta tensors: shapes
    only)."""
    family = resolve_model(model_id).family
    return lora_targets(_meta_denoiser(model_id), DENOISERS[family][1])


def denoiser_config(model_id: str):
    """The config of the model's denoiser (what SDXL's ``lora_state_dict`` takes)."""
    return _meta_denoiser(model_id).config


def check_for_model(adapter: LoraAdapter, model_id: str) -> None:
    """``check_adapter`` against the model's targetable layers; ``AdapterFileError`` naming the
    layer and the model."""
    try:
        check_adapter(adapter, model_targets(model_id))
    except ValueError as exc:
        raise AdapterFileError(f"{exc} (model {model_id})") from None


def read_for_model(source: Path | str | bytes, model_id: str, *, max_rank: int) -> ReadAdapter:
    """``read_adapter`` for the model's family, checked against the model's layers."""
    family = resolve_model(model_id).family
    unet_config = denoiser_config(model_id) if family == "sdxl-inpaint" else None
    read = read_adapter(source, family, max_rank=max_rank, unet_config=unet_config)
    check_for_model(read.adapter, model_id)
    return read


# ----- the normalized format --------------------------------------------------------------------
def save_normalized(adapter: LoraAdapter, meta: NormalizedMeta, path: Path | str) -> None:
    """Write ``adapter`` in the normalized format, atomically."""
    tensors: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    for module in sorted(adapter.pairs):
        pair = adapter.pairs[module]
        tensors[f"{module}.down"] = pair.down.detach().to("cpu").contiguous()
        tensors[f"{module}.up"] = pair.up.detach().to("cpu").contiguous()
        scales[module] = pair.scale
    header = {
        "format_version": FORMAT_VERSION,
        "family": meta.family,
        "model_id": meta.model_id,
        "source_layout": meta.source_layout,
        "scales": scales,
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(header, sort_keys=True)})


def _header(handle, path: Path | str) -> dict:
    raw = (handle.metadata() or {}).get(META_KEY)
    header = json.loads(raw) if raw else {}
    if header.get("format_version") != FORMAT_VERSION:
        raise AdapterFileError(
            f"{path} is not a normalized adapter of format {FORMAT_VERSION} "
            f"(found {header.get('format_version')!r})"
        )
    return header


def normalized_meta(path: Path | str) -> NormalizedMeta:
    with safe_open(str(path), framework="pt") as handle:
        header = _header(handle, path)
    return NormalizedMeta(header["family"], header["model_id"], header["source_layout"])


def load_normalized(
    path: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    adapter_id: str | None = None,
) -> LoraAdapter:
    """The adapter of a normalized file on ``device`` in ``dtype``; its id: ``adapter_id``, else
    the file's stem (the content hash in the store)."""
    with safe_open(str(path), framework="pt") as handle:
        scales = _header(handle, path)["scales"]
        pairs = {
            module: LoraPair(
                handle.get_tensor(f"{module}.down").to(device, dtype),
                handle.get_tensor(f"{module}.up").to(device, dtype),
                float(scale),
            )
            for module, scale in scales.items()
        }
    return LoraAdapter(adapter_id or Path(path).stem, pairs)
