"""``maskserve train-demo`` end to end on the seconds-long recipe: it trains, resumes, exports a
diffusers directory that loads offline and serves mask-aware edits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from backend.cli import main
from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.ordinary import run_ordinary
from backend.models import load_pipeline, resolve_model
from backend.training.demo import PLOT_FILE, TRAINING_FILE, train_demo
from backend.training.examples import make_example
from backend.training.loop import RecipeMismatchError
from backend.training.recipe import Recipe


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(workdir, exported model dir, record) of one smoke training run."""
    workdir = tmp_path_factory.mktemp("train-demo")
    out = workdir / "model"
    record = train_demo(Recipe.smoke(), workdir, out, progress=False)
    return workdir, out, record


def _unet_weights(path) -> dict:
    pipe = load_pipeline(str(path), path.parent)
    return {name: value.clone() for name, value in pipe.unet.state_dict().items()}


def test_the_export_is_a_diffusers_directory_with_its_record_and_plot(trained):
    _, out, record = trained
    assert resolve_model(str(out)).family == "sd2-inpaint"
    written = json.loads((out / TRAINING_FILE).read_text())
    assert written["recipe"] == Recipe.smoke().to_dict()
    assert len(written["losses"]["unet"]) == Recipe.smoke().unet_steps
    assert len(written["losses"]["vae"]) == Recipe.smoke().vae_steps
    assert written["vae_scaling_factor"] > 0 and written["distinct_captions"] >= 1
    scheduler = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["prediction_type"] == Recipe.smoke().prediction == "v_prediction"
    assert Image.open(out / PLOT_FILE).format == "PNG"
    weights = list(out.glob("*/*.safetensors"))
    assert weights and all(path.stat().st_size > 0 for path in weights)


def test_running_again_resumes_from_the_checkpoints_and_exports_the_same_weights(trained):
    workdir, out, record = trained
    before = _unet_weights(out)
    again = train_demo(Recipe.smoke(), workdir, out, progress=False)
    assert again["losses"] == record["losses"]  # nothing retrained: losses come from checkpoints
    after = _unet_weights(out)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_another_recipe_in_the_same_workdir_is_refused(trained):
    workdir, out, _ = trained
    with pytest.raises(RecipeMismatchError):
        train_demo(Recipe.smoke(vae_lr=0.5), workdir, out, progress=False)


def test_the_trained_model_edits_inside_the_mask_only_and_matches_the_ordinary_pipeline(
    trained, tmp_path
):
    _, out, _ = trained
    spec = resolve_model(str(out))
    pipe = load_pipeline(str(out), out.parent)
    engine = MaskAwareEngine(pipe, spec, tmp_path)
    example = make_example(0, "heldout", Recipe.smoke().size)
    mask = Image.fromarray(example.mask.astype(np.uint8) * 255)
    size = (example.image.height, example.image.width)
    params = EditParams(steps=4, guidance=5.0, size=size, record_on_first_edit=False)
    cache = engine.prepare_template(example.image, params)
    result = engine.edit(example.image, mask, "a small red star", 3, params, cache)
    outside = ~example.mask
    assert np.array_equal(np.asarray(result.image)[outside], np.asarray(example.image)[outside])
    assert result.used_cache
    # every token fresh: the engine's computation is the ordinary pipeline's
    dense = EditParams(steps=4, guidance=5.0, size=size, use_cache=False)
    full = Image.new("L", example.image.size, 255)
    ours = engine.edit(example.image, full, "a small red star", 3, dense).generated
    theirs = run_ordinary(pipe, spec, example.image, full, "a small red star", 3, dense)
    assert np.abs(np.asarray(ours, float) - np.asarray(theirs, float)).max() <= 1


def test_the_command_trains_and_says_how_to_serve_the_model(tmp_path, capsys):
    out = tmp_path / "exported"
    code = main(["train-demo", "--smoke", "--workdir", str(tmp_path / "work"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and f"MASKSERVE_MODEL={out.resolve()}" in printed
    assert (out / "model_index.json").is_file()


def test_the_command_refuses_a_non_positive_step_count(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["train-demo", "--smoke", "--unet-steps", "0"])
    assert stopped.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_the_denoiser_target_gives_back_the_clean_latents_as_the_scheduler_reads_it(prediction):
    """What the scheduler of that prediction type makes of a perfect output is the clean latent."""
    from backend.training.denoiser import _target

    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(3, 4, 8, 8, generator=generator)
    noise = torch.randn(3, 4, 8, 8, generator=generator)
    alpha = torch.tensor([0.995, 0.3, 0.005])
    scale = alpha.sqrt().view(-1, 1, 1, 1)
    noisy = scale * latents + (1 - scale**2).sqrt() * noise
    target, weights = _target(Recipe(prediction=prediction), latents, noise, alpha)
    if prediction == "epsilon":
        recovered = (noisy - (1 - scale**2).sqrt() * target) / scale
    else:
        recovered = scale * noisy - (1 - scale**2).sqrt() * target
    assert torch.allclose(recovered, latents, atol=1e-4)
    # image-space weights: Min-SNR's min(snr, 5) for epsilon, never below 1 for v
    snr = alpha / (1 - alpha)
    image_weights = weights * (snr if prediction == "epsilon" else snr + 1)
    expected = torch.clamp(snr, max=5.0) + (0 if prediction == "epsilon" else 1)
    assert torch.allclose(image_weights, expected, rtol=1e-5)


def test_an_unknown_prediction_type_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="epsilon, v_prediction"):
        Recipe(prediction="sample")
