"""Model registry: ids, offline builds, save/reload, and the real diffusers pipelines.

Self-contained on purpose (no engine imports): the registry is tested on its own.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from backend.models import (
    FAMILIES,
    FORMS,
    UnknownModelError,
    known_model_ids,
    load_pipeline,
    materialize,
    pipeline_class,
    resolve_model,
)
from backend.models.builders import build_components, build_pipeline
from backend.models.catalog import SHIPPED
from backend.models.configs import CONFIGS
from backend.models.registry import MARKER, model_revision
from backend.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

SIZE = 128


def _template(size: int = SIZE) -> Image.Image:
    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], axis=-1).astype(
        np.uint8
    )
    return Image.fromarray(pixels)


def _rect_mask(box: tuple[int, int, int, int], size: int = SIZE) -> Image.Image:
    pixels = np.zeros((size, size), dtype=np.uint8)
    x0, y0, x1, y1 = box
    pixels[y0:y1, x0:x1] = 255
    return Image.fromarray(pixels)


def _modules(pipe_or_parts) -> dict[str, torch.nn.Module]:
    parts = pipe_or_parts if isinstance(pipe_or_parts, dict) else pipe_or_parts.components
    return {name: part for name, part in parts.items() if isinstance(part, torch.nn.Module)}


def _assert_same_weights(first, second, what: str) -> None:
    a, b = _modules(first), _modules(second)
    assert a.keys() == b.keys(), what
    for name in a:
        left, right = a[name].state_dict(), b[name].state_dict()
        assert left.keys() == right.keys(), f"{what}: {name} keys differ"
        for key in left:
            assert torch.equal(left[key], right[key]), f"{what}: {name}.{key} differs"


def _edit(pipe, spec, steps: int = 2):
    kwargs = {"max_sequence_length": spec.max_sequence_length} if spec.max_sequence_length else {}
    return pipe(
        prompt="A red leather armchair",
        image=_template(),
        mask_image=_rect_mask((16, 24, 96, 80)),
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=spec.default_guidance,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    ).images[0]


# ---- ids and specs -------------------------------------------------------------------------------


def test_known_ids_cover_every_family_and_form():
    ids = known_model_ids()
    built = [f"{form}-{family}" for family in FAMILIES for form in FORMS]
    assert ids == [*SHIPPED, *built]  # the shipped models first: the default is one of them
    for model_id in built:
        spec = resolve_model(model_id)
        assert (
            spec.model_id == model_id
            and f"{spec.form}-{spec.family}" == model_id
            and spec.source is None
        )
        assert spec.uses_cfg == (spec.family != "flux-fill")
        assert spec.default_guidance == (7.5 if spec.uses_cfg else 30.0)
        assert (spec.max_sequence_length is None) == spec.uses_cfg
    expected = {
        "tiny-sd2-inpaint": (256, 20),
        "small-sdxl-inpaint": (512, 20),
        "arch-sd2-inpaint": (512, 50),
        "arch-sdxl-inpaint": (1024, 50),
        "arch-flux-fill": (1024, 28),
    }
    for model_id, (resolution, steps) in expected.items():
        spec = resolve_model(model_id)
        assert (spec.default_resolution, spec.default_steps) == (resolution, steps)
    assert [resolve_model(f"{form}-flux-fill").max_sequence_length for form in FORMS] == [
        48,
        64,
        512,
    ]


@pytest.mark.parametrize(
    "bad",
    [
        "tiny-sd9-inpaint",
        "huge-flux-fill",
        "flux-fill",
        "nosuch:/tmp/x",
        "sd2-inpaint:",
        "",
        "tiny-",
        "Tiny-flux-fill",
    ],
)
def test_unknown_ids_list_the_known_ones(bad):
    with pytest.raises(UnknownModelError, match="tiny-sd2-inpaint") as error:
        resolve_model(bad)
    assert "<family>:" in str(error.value) and "flux-fill" in str(error.value)
    assert isinstance(error.value, ValueError)


def test_pipeline_classes():
    names = {family: pipeline_class(family).__name__ for family in FAMILIES}
    assert names == {
        "sd2-inpaint": "StableDiffusionInpaintPipeline",
        "sdxl-inpaint": "StableDiffusionXLInpaintPipeline",
        "flux-fill": "FluxFillPipeline",
    }
    with pytest.raises(UnknownModelError):
        pipeline_class("sd15")


def test_checkpoint_ids_keep_the_source(tmp_path):
    spec = resolve_model(f"flux-fill:{tmp_path}")
    assert (spec.family, spec.form, spec.source) == ("flux-fill", "checkpoint", str(tmp_path))
    assert spec.max_sequence_length == 512 and spec.default_steps == 28
    assert materialize(spec.model_id, tmp_path / "models") == tmp_path
    hub = resolve_model("flux-fill:black-forest-labs/FLUX.1-Fill-dev")
    assert hub.source == model_revision(hub) == "black-forest-labs/FLUX.1-Fill-dev"


def test_local_directory_is_recognised_by_its_pipeline_class(tmp_path):
    index = tmp_path / "model_index.json"
    index.write_text(json.dumps({"_class_name": "StableDiffusionXLInpaintPipeline"}))
    spec = resolve_model(str(tmp_path))
    assert (spec.family, spec.form, spec.source) == ("sdxl-inpaint", "checkpoint", str(tmp_path))
    before = model_revision(spec)
    os.utime(index, ns=(1, 1))
    # the revision follows model_index.json
    assert model_revision(resolve_model(str(tmp_path))) != before
    index.write_text(json.dumps({"_class_name": "SomethingElsePipeline"}))
    with pytest.raises(UnknownModelError):
        resolve_model(str(tmp_path))


def test_missing_checkpoint_directory_is_a_clear_error(tmp_path):
    with pytest.raises(UnknownModelError, match="cannot load"):
        load_pipeline(f"sd2-inpaint:{tmp_path / 'nothing-here'}", tmp_path)


def test_revision_changes_with_the_config():
    revisions = {model_revision(resolve_model(model_id)) for model_id in known_model_ids()}
    assert len(revisions) == len(known_model_ids())
    assert model_revision(resolve_model("tiny-sd2-inpaint")) == model_revision(
        resolve_model("tiny-sd2-inpaint")
    )


# ---- configs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_configs_are_consistent(family, form):
    configs = CONFIGS[(family, form)]
    vae = configs["vae"]
    # downsample by 8
    assert len(vae["block_out_channels"]) == 4 and len(vae["down_block_types"]) == 4
    assert vae["latent_channels"] == (16 if family == "flux-fill" else 4)
    if form != "arch":
        assert vae["mid_block_add_attention"] is False  # slow at 256+ px on a CPU
    clip = configs["text_encoder"]
    if family == "flux-fill":
        flux, t5 = configs["transformer"], configs["text_encoder_2"]
        packed = vae["latent_channels"] * 4  # 2x2 packing of the latents
        assert flux["in_channels"] == packed + packed + 64 * 4 and flux["out_channels"] == packed
        assert sum(flux["axes_dims_rope"]) == flux["attention_head_dim"] and flux["guidance_embeds"]
        assert (
            flux["joint_attention_dim"] == t5["d_model"]
            and flux["pooled_projection_dim"] == clip["hidden_size"]
        )
    else:
        unet = configs["unet"]
        assert (
            unet["in_channels"] == 9 and unet["out_channels"] == 4 and unet["use_linear_projection"]
        )
        if family == "sd2-inpaint":
            assert unet["cross_attention_dim"] == clip["hidden_size"]
        else:
            clip2 = configs["text_encoder_2"]
            assert (
                unet["down_block_types"][0] == "DownBlock2D"
                and unet["addition_embed_type"] == "text_time"
            )
            assert unet["cross_attention_dim"] == clip["hidden_size"] + clip2["hidden_size"]
            assert (
                unet["projection_class_embeddings_input_dim"]
                == clip2["projection_dim"] + 6 * unet["addition_time_embed_dim"]
            )


@pytest.mark.parametrize("form", ["small", "arch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bigger_forms_build_on_the_meta_device(family, form):
    """Every component of the small and arch forms instantiates without allocating weights."""
    with torch.device("meta"):
        parts = build_components(family, form)
    for name, module in _modules(parts).items():
        assert all(p.is_meta for p in module.parameters()), name
    assert parts["scheduler"] is not None and parts["tokenizer"] is not None


def test_arch_components_have_published_sizes():
    def count(parts, name):
        return sum(p.numel() for p in parts[name].parameters())

    with torch.device("meta"):
        flux, sdxl, sd2 = (
            build_components(family, "arch")
            for family in ("flux-fill", "sdxl-inpaint", "sd2-inpaint")
        )
    assert 11.8e9 < count(flux, "transformer") < 12.0e9  # Flux.1 Fill dev: 11.9 B
    assert 4.7e9 < count(flux, "text_encoder_2") < 4.8e9  # T5-XXL encoder: 4.76 B
    assert 2.5e9 < count(sdxl, "unet") < 2.7e9  # SDXL UNet: 2.57 B
    assert 0.69e9 < count(sdxl, "text_encoder_2") < 0.70e9  # OpenCLIP bigG text tower: 695 M
    assert 0.12e9 < count(sdxl, "text_encoder") < 0.13e9  # CLIP-L text: 123 M
    assert 0.86e9 < count(sd2, "unet") < 0.87e9  # SD2 UNet: 866 M
    assert 0.33e9 < count(sd2, "text_encoder") < 0.35e9  # OpenCLIP-H text tower: 340 M
    assert 83e6 < count(sd2, "vae") < 84e6  # SD VAE: 83.7 M


# ---- tiny forms: build, save, reload, run --------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_building_twice_gives_identical_weights(family):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = build_components(family, "tiny")
    assert torch.equal(torch.rand(3), expected)  # building leaves the caller's RNG alone
    _assert_same_weights(first, build_components(family, "tiny"), family)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_model_reloads_identically_and_runs(family, models_dir):
    model_id = f"tiny-{family}"
    spec = resolve_model(model_id)
    path = materialize(model_id, models_dir)
    assert (path / "model_index.json").exists() and (path / MARKER).read_text() == model_revision(
        spec
    )
    pipe = load_pipeline(model_id, models_dir)
    built = build_pipeline(spec)
    _assert_same_weights(built, pipe, f"{model_id} save/reload")
    assert type(pipe) is pipeline_class(family) and pipe.vae_scale_factor == 8
    assert type(pipe.scheduler).__name__ == type(built.scheduler).__name__
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
    assert public(pipe.scheduler.config) == public(built.scheduler.config)
    assert pipe.tokenizer("A red chair").input_ids == built.tokenizer("A red chair").input_ids
    first, second = _edit(pipe, spec), _edit(pipe, spec)
    assert first.size == (SIZE, SIZE)
    assert np.array_equal(np.asarray(first), np.asarray(second))
    # reloaded == freshly built
    assert np.array_equal(np.asarray(first), np.asarray(_edit(built, spec)))


def test_materialize_is_idempotent(models_dir):
    path = materialize("tiny-sd2-inpaint", models_dir)
    stamp = (path / "model_index.json").stat().st_mtime_ns
    assert materialize("tiny-sd2-inpaint", models_dir) == path
    assert (path / "model_index.json").stat().st_mtime_ns == stamp


def test_materialize_replaces_incomplete_and_stale_directories(tmp_path):
    target = tmp_path / "tiny-flux-fill"
    target.mkdir()
    (target / "model_index.json").write_text("{half written")  # no marker: an interrupted build
    assert materialize("tiny-flux-fill", tmp_path) == target
    assert (target / MARKER).read_text() == model_revision(resolve_model("tiny-flux-fill"))
    json.loads((target / "model_index.json").read_text())
    (target / MARKER).write_text("older-revision")
    materialize("tiny-flux-fill", tmp_path)
    assert (target / MARKER).read_text() == model_revision(resolve_model("tiny-flux-fill"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-flux-fill"]  # no staging leftovers


def test_publish_keeps_a_complete_build_published_by_someone_else(tmp_path):
    from backend.models.registry import _publish

    target, staging = tmp_path / "model", tmp_path / "staging"
    for path, name in ((target, "theirs"), (staging, "ours")):
        path.mkdir()
        (path / "who").write_text(name)
        (path / MARKER).write_text("rev-1")
    _publish(staging, target, "rev-1")  # same revision already complete: theirs stays
    assert (target / "who").read_text() == "theirs"
    (target / MARKER).write_text("rev-0")
    _publish(staging, target, "rev-1")  # older revision: ours replaces it
    assert (target / "who").read_text() == "ours" and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# ---- tokenizers ----------------------------------------------------------------------------------


def test_tokenizers_are_deterministic_and_offline():
    clip, t5 = build_clip_tokenizer(), build_t5_tokenizer()
    text = "A Red leather armchair, 42! café ☕"
    assert clip(text).input_ids == build_clip_tokenizer()(text).input_ids
    assert t5(text).input_ids == build_t5_tokenizer()(text).input_ids
    padded = clip(text, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(padded) == 77 and padded[0] == clip.bos_token_id
    assert len(clip("word " * 200, truncation=True, max_length=77).input_ids) == 77
    ids = t5(text).input_ids
    assert ids[-1] == t5.eos_token_id and (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (
        0,
        1,
        2,
    )
    # all of ASCII
    assert t5.unk_token_id not in t5("A Photo of a CAT, 3 dogs & (one) bird?").input_ids


def test_an_in_memory_build_has_the_saved_builds_weights_and_writes_nothing(models_dir, tmp_path):
    saved = load_pipeline("tiny-flux-fill", models_dir, dtype=torch.bfloat16)
    built = load_pipeline("tiny-flux-fill", tmp_path, dtype=torch.bfloat16, in_memory=True)
    assert not any(tmp_path.iterdir())
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        ours, theirs = getattr(built, name).state_dict(), getattr(saved, name).state_dict()
        assert ours.keys() == theirs.keys()
        assert all(
            ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], theirs[k]) for k in ours
        )
