"""Model registry: ids, offline builds, save/reload, and the real diffusers pipelines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.models import FAMILIES, UnknownModelError, known_model_ids, load_pipeline, materialize, resolve_model
from backend.models.builders import build_components
from backend.models.configs import CONFIGS
from backend.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer
from tests.factories import make_template, rect_mask


def test_known_ids_cover_every_family_and_form():
    ids = known_model_ids()
    assert len(ids) == 9 and "tiny-flux-fill" in ids and "arch-sdxl-inpaint" in ids
    spec = resolve_model("small-sdxl-inpaint")
    assert spec.family == "sdxl-inpaint" and spec.form == "small" and spec.uses_cfg
    flux = resolve_model("tiny-flux-fill")
    assert not flux.uses_cfg and flux.max_sequence_length == 48 and flux.default_guidance == 30.0


@pytest.mark.parametrize("bad", ["tiny-sd9-inpaint", "huge-flux-fill", "flux-fill", "nosuch:/tmp/x", "sd2-inpaint:"])
def test_unknown_ids_list_the_known_ones(bad):
    with pytest.raises(UnknownModelError, match="tiny-sd2-inpaint"):
        resolve_model(bad)


def test_checkpoint_ids_keep_the_source(tmp_path):
    spec = resolve_model(f"flux-fill:{tmp_path}")
    assert spec.form == "checkpoint" and spec.source == str(tmp_path)
    assert materialize(spec.model_id, tmp_path / "models") == tmp_path


def test_missing_checkpoint_directory_is_a_clear_error(tmp_path):
    with pytest.raises(UnknownModelError, match="cannot load"):
        load_pipeline(f"sd2-inpaint:{tmp_path / 'nothing-here'}", tmp_path)


def test_revision_changes_with_the_config():
    assert resolve_model("tiny-sd2-inpaint").revision != resolve_model("small-sd2-inpaint").revision
    assert resolve_model("tiny-sd2-inpaint").revision == resolve_model("tiny-sd2-inpaint").revision


@pytest.mark.parametrize("family", FAMILIES)
def test_building_twice_gives_identical_weights(family):
    first, second = build_components(family, "tiny"), build_components(family, "tiny")
    for name, module in first.items():
        if isinstance(module, torch.nn.Module):
            for (key, a), (_, b) in zip(module.state_dict().items(), second[name].state_dict().items()):
                assert torch.equal(a, b), f"{family} {name}.{key} differs between builds"


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_model_reloads_identically_and_runs(family, models_dir):
    path = materialize(f"tiny-{family}", models_dir)
    assert (path / "model_index.json").exists()
    pipe = load_pipeline(f"tiny-{family}", models_dir)
    built = build_components(family, "tiny")
    denoiser = "transformer" if family == "flux-fill" else "unet"
    for key, value in built[denoiser].state_dict().items():
        assert torch.equal(value, getattr(pipe, denoiser).state_dict()[key])
    assert pipe.vae_scale_factor == 8
    spec = resolve_model(f"tiny-{family}")
    kwargs = {"max_sequence_length": spec.max_sequence_length} if spec.max_sequence_length else {}

    def run():
        return pipe(prompt="a red chair", image=make_template(), mask_image=rect_mask((16, 16, 80, 64)),
                    height=128, width=128, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                    **kwargs).images[0]
    first, second = run(), run()
    assert first.size == (128, 128)
    assert np.array_equal(np.asarray(first), np.asarray(second))


def test_materialize_is_idempotent(models_dir):
    path = materialize("tiny-sd2-inpaint", models_dir)
    stamp = (path / "model_index.json").stat().st_mtime_ns
    assert materialize("tiny-sd2-inpaint", models_dir) == path
    assert (path / "model_index.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("form", ["small", "arch"])
def test_bigger_configs_build_without_allocating(family, form):
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    configs = CONFIGS[(family, form)]
    with torch.device("meta"):
        if family == "flux-fill":
            model = FluxTransformer2DModel(**configs["transformer"])
        else:
            model = UNet2DConditionModel(**configs["unet"])
    assert sum(p.numel() for p in model.parameters()) > 0


def test_arch_denoisers_have_published_sizes():
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    with torch.device("meta"):
        flux = FluxTransformer2DModel(**CONFIGS[("flux-fill", "arch")]["transformer"])
        sdxl = UNet2DConditionModel(**CONFIGS[("sdxl-inpaint", "arch")]["unet"])
    assert 11.8e9 < sum(p.numel() for p in flux.parameters()) < 12.0e9  # Flux.1 Fill: ~11.9 B
    assert 2.5e9 < sum(p.numel() for p in sdxl.parameters()) < 2.7e9  # SDXL UNet: ~2.6 B


def test_tokenizers_are_deterministic_and_offline():
    clip, t5 = build_clip_tokenizer(), build_t5_tokenizer()
    text = "a red leather armchair, 42!"
    assert clip(text).input_ids == build_clip_tokenizer()(text).input_ids
    assert clip(text, padding="max_length").input_ids.__len__() == 77
    assert t5(text).input_ids[-1] == t5.eos_token_id and t5.unk_token_id not in t5("a red cat").input_ids
