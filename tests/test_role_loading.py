"""Each role loads only the parts of the model it runs: the CPU stages the text encoders and VAE,
an engine worker the denoiser (everything with ``inline`` batching); split across the two, an
edit is bit for bit the edit of one engine holding every part; a part a role did not load fails
with a message naming it."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from backend.config import load_settings
from backend.engine.factory import CPU_STAGES, DENOISER_ONLY, FULL, ROLES, build_engine
from backend.engine.families import MissingComponentError
from backend.engine.ordinary import run_ordinary
from backend.engine.prepared import PreparedRequest
from backend.models import load_pipeline, materialize
from backend.tasks.celery_app import make_celery
from backend.worker.service import build_worker
from tests.factories import FAMILIES, MASK, make_params, make_template

TEXT_ENCODERS = {
    "sd2-inpaint": {"text_encoder"},
    "sdxl-inpaint": {"text_encoder", "text_encoder_2"},
    "flux-fill": {"text_encoder", "text_encoder_2"},
}
DENOISERS = {"sd2-inpaint": "unet", "sdxl-inpaint": "unet", "flux-fill": "transformer"}


def loaded_modules(engine) -> set[str]:
    """Names of the pipeline parts that hold weights."""
    return {
        name for name, part in engine.pipe.components.items() if isinstance(part, torch.nn.Module)
    }


def settings_for(tmp_path, models_dir, family: str, **sections):
    return load_settings(
        env={},
        paths={"data_dir": str(tmp_path), "models_dir": str(models_dir)},
        engine={"model_id": f"tiny-{family}"},
        **sections,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cpu_stages_load_text_encoders_and_vae_and_no_denoiser(family, models_dir, tmp_path):
    engine = build_engine(settings_for(tmp_path, models_dir, family), role=CPU_STAGES)
    assert loaded_modules(engine) == TEXT_ENCODERS[family] | {"vae"}
    assert getattr(engine.pipe, DENOISERS[family]) is None
    # sizes still come from the model: the same token and bucket multiples as a full engine
    traits = engine.spec.traits
    assert (engine.token_size, engine.size_multiple) == (traits.token_px, traits.size_multiple)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batching", ["continuous", "inline"])
def test_an_engine_worker_loads_the_denoiser_and_the_rest_only_inline(
    family, batching, models_dir, tmp_path, redis_url, redis_client
):
    settings = settings_for(
        tmp_path, models_dir, family, worker={"batching": batching}, redis={"url": redis_url}
    )
    worker, caches = build_worker(settings, redis_client, make_celery(settings))
    try:
        engine = worker.engine
        if batching == "inline":
            assert loaded_modules(engine) == TEXT_ENCODERS[family] | {"vae", DENOISERS[family]}
        else:
            assert loaded_modules(engine) == {DENOISERS[family]}
            assert engine.pipe.tokenizer is None
        # the VAE's config values without its weights: the pipeline's own factor and processors
        assert engine.pipe.vae_scale_factor == 8
        assert engine.token_size == engine.spec.traits.token_px and engine.num_units > 0
    finally:
        caches.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_edit_split_across_the_roles_equals_one_full_engine(family, models_dir, tmp_path):
    settings = settings_for(tmp_path, models_dir, family)
    full = build_engine(settings, role=FULL)
    stages = build_engine(settings, role=CPU_STAGES)
    denoiser = build_engine(settings, role=DENOISER_ONLY)
    params = make_params(full, use_cache=False)
    template = make_template()

    def edit(encoder, stepper, decoder):
        path = tmp_path / f"{id(encoder)}.safetensors"
        encoder.encode(template, MASK, "a blue vase", 3, params).save(path)
        state = stepper.admit(PreparedRequest.load(path))
        while not state.done:
            stepper.step([state], params.mode)
        return state.latents, np.asarray(decoder.decode(state.latents, params))

    whole_latents, whole_image = edit(full, full, full)
    split_latents, split_image = edit(stages, denoiser, stages)
    assert torch.equal(whole_latents, split_latents)
    assert np.array_equal(whole_image, split_image)


def test_a_part_a_role_did_not_load_fails_with_its_name(models_dir, tmp_path):
    settings = settings_for(tmp_path, models_dir, "flux-fill")
    stages = build_engine(settings, role=CPU_STAGES)
    denoiser = build_engine(settings, role=DENOISER_ONLY)
    params = make_params(stages)
    template = make_template()
    prepared = stages.encode(template, MASK, "a blue vase", 3, params)
    state = stages.admit(prepared)
    with pytest.raises(MissingComponentError, match="without its denoiser"):
        stages.step([state], params.mode)
    first_step = state.req.timesteps[:1]
    rows = stages.adapter.step_rows(state.req, state.latents, first_step)
    with pytest.raises(MissingComponentError, match="denoising needs the model's denoiser"):
        stages.adapter.denoise(rows, first_step, [state.req])
    with pytest.raises(MissingComponentError, match="text encoders and VAE"):
        denoiser.encode(template, MASK, "a blue vase", 3, params)
    with pytest.raises(MissingComponentError, match="decoding needs the model's VAE"):
        denoiser.decode(prepared.init_latents, params)
    with pytest.raises(MissingComponentError, match="the ordinary pipeline needs"):
        run_ordinary(denoiser.pipe, denoiser.spec, template, MASK, "a blue vase", 3, params)


def test_parts_left_out_are_never_read_from_disk(models_dir, tmp_path):
    """A checkpoint whose UNet weights are missing still loads for the CPU stages."""
    checkpoint = tmp_path / "no-unet"
    shutil.copytree(materialize("tiny-sd2-inpaint", models_dir), checkpoint)
    for weights in (checkpoint / "unet").glob("*.safetensors"):
        weights.unlink()
    pipe = load_pipeline(f"sd2-inpaint:{checkpoint}", models_dir, components=ROLES[CPU_STAGES])
    assert pipe.unet is None and pipe.vae is not None and pipe.text_encoder is not None
    assert type(pipe.scheduler).__name__ == "EulerDiscreteScheduler"


def test_an_unknown_role_is_refused(models_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown engine role 'gpu'"):
        build_engine(settings_for(tmp_path, models_dir, "sd2-inpaint"), role="gpu")


def test_the_engine_batches_attention_and_adapters_as_the_settings_say(models_dir, tmp_path):
    settings = load_settings(
        env={"MASKSERVE_ATTENTION": "padded", "MASKSERVE_LORA_BATCHING": "grouped"},
        paths={"data_dir": str(tmp_path), "models_dir": str(models_dir)},
    )
    engine = build_engine(settings, role=CPU_STAGES)
    assert (engine.attention, engine.lora_batching) == ("padded", "grouped")
    default = build_engine(settings_for(tmp_path, models_dir, "sd2-inpaint"), role=CPU_STAGES)
    assert (default.attention, default.lora_batching) == ("auto", "stacked")
