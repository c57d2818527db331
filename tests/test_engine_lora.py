"""Per-row LoRA adapters in the mask-aware engine, against diffusers + PEFT, on the tiny models.

The reference is a second pipeline of the same model with the same adapter files loaded through
``load_lora_weights`` / ``set_adapters`` (PEFT layers), run as the ordinary pipeline; the engine
reads the adapters' PEFT weights and applies them per row (``backend.bench.synthetic_lora`` makes
both).
"""

from __future__ import annotations

import copy

import pytest
import torch

from backend.bench.synthetic_lora import load_into_pipeline, peft_adapter
from backend.engine.lora import LoraAdapter, LoraPair
from backend.engine.ordinary import run_ordinary
from backend.models import load_pipeline
from tests.factories import FAMILIES, full_mask, make_engine, make_params, make_template, rect_mask

pytestmark = [pytest.mark.model, pytest.mark.slow]

TOL = 1e-4
PROMPT = "a red chair"
SCALES = (("a0", 0.7), ("a1", 1.2))


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, models_dir, tmp_path_factory):
    """(engine with adapters a0, a1 resident, reference pipeline with both loaded via PEFT)."""
    family = request.param
    engine = make_engine(family, models_dir, tmp_path_factory.mktemp(f"cache-{family}"))
    reference = load_pipeline(f"tiny-{family}", models_dir)
    denoiser_name = engine.adapter.denoiser_name
    targets = sorted(engine.adapters.targets)
    pristine = copy.deepcopy(getattr(reference, denoiser_name))  # before PEFT layers go in
    for seed, (adapter_id, _), rank, alpha in zip((1, 2), SCALES, (4, 8), (8.0, 4.0)):
        # a0 updates every layer adapters may update, a1 every other one
        chosen = targets if seed == 1 else targets[::2]
        made = peft_adapter(pristine, adapter_id, seed, rank, alpha, chosen)
        folder = tmp_path_factory.mktemp(f"{family}-{adapter_id}")
        load_into_pipeline(reference, denoiser_name, made, folder)
        engine.adapters.put(made.adapter)
    return engine, reference


def _reference_latents(setup, mask, seed, params, scales):
    engine, reference = setup
    reference.set_adapters([a for a, _ in scales], [s for _, s in scales])
    return run_ordinary(
        reference, engine.spec, make_template(), mask, PROMPT, seed, params, output_type="latent"
    )


@pytest.mark.parametrize("lora_batching", ("grouped", "stacked"))
def test_edit_with_two_adapters_equals_diffusers_with_peft(setup, lora_batching, monkeypatch):
    engine, _ = setup
    monkeypatch.setattr(engine, "lora_batching", lora_batching)
    params = make_params(engine, use_cache=False)
    result = engine.edit(make_template(), full_mask(), PROMPT, 3, params, adapters=SCALES)
    reference = _reference_latents(setup, full_mask(), 3, params, SCALES)
    base = engine.edit(make_template(), full_mask(), PROMPT, 3, params)
    assert (result.latents - reference).abs().max().item() <= TOL
    # the adapters change the result (the comparison above is not between two base runs)
    assert (base.latents - reference).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("mode", ("kv", "hidden"))
def test_cached_path_at_mask_ratio_one_equals_diffusers(setup, mode):
    engine, _ = setup
    params = make_params(engine, mode=mode, dense_above_ratio=1.0)
    cache = engine.prepare_template(make_template(), params)
    scales = (("a1", 0.5),)
    result = engine.edit(
        make_template(), full_mask(), PROMPT, 4, params, cache=cache, adapters=scales
    )
    assert result.used_cache and result.mask_ratio == 1.0
    reference = _reference_latents(setup, full_mask(), 4, params, scales)
    assert (result.latents - reference).abs().max().item() <= TOL


def _run_batch(engine, params, cache, row_adapters, masks):
    states = [
        engine.start(make_template(), mask, PROMPT, 10 + i, params, cache=cache, adapters=adapters)
        for i, (adapters, mask) in enumerate(zip(row_adapters, masks))
    ]
    while not states[0].done:
        engine.step(states, params.mode)
    return [s.latents for s in states]


@pytest.mark.parametrize(
    "attention, lora_batching",
    (("grouped", "grouped"), ("padded", "grouped"), ("grouped", "stacked"), ("padded", "stacked")),
)
def test_mixed_batch_equals_each_row_alone(setup, attention, lora_batching, monkeypatch):
    """Rows with other adapters, masks and seeds in one forward match each row alone, with the
    rows' attention grouped per request or padded into one call, and their adapters' deltas
    grouped per adapter or stacked into three operators a layer."""
    engine, _ = setup
    monkeypatch.setattr(engine, "attention", attention)
    monkeypatch.setattr(engine, "lora_batching", lora_batching)
    params = make_params(engine, mode="kv")
    cache = engine.prepare_template(make_template(), params)
    rows = [(), (("a0", 1.0),), (("a0", 0.4), ("a1", 1.5)), (("a1", -0.8),)]
    masks = [
        rect_mask((32, 40, 96, 80)),
        rect_mask((0, 0, 64, 64)),
        full_mask(),
        rect_mask((8, 8, 40, 120)),
    ]
    together = _run_batch(engine, params, cache, rows, masks)
    for i, (adapters, mask) in enumerate(zip(rows, masks)):
        states = [
            engine.start(
                make_template(), mask, PROMPT, 10 + i, params, cache=cache, adapters=adapters
            )
        ]
        while not states[0].done:
            engine.step(states, params.mode)
        assert (together[i] - states[0].latents).abs().max().item() <= TOL, f"row {i}"
    assert (together[1] - together[0]).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("lora_batching", ("grouped", "stacked"))
def test_rows_without_adapters_are_untouched_by_their_neighbours(setup, lora_batching, monkeypatch):
    """Bit for bit: grouped never touches such a row's tokens, stacked adds exact zeros to them."""
    engine, _ = setup
    monkeypatch.setattr(engine, "lora_batching", lora_batching)
    params = make_params(engine, mode="kv")
    cache = engine.prepare_template(make_template(), params)
    masks = [rect_mask((32, 40, 96, 80)), rect_mask((0, 0, 64, 64))]
    with_neighbour = _run_batch(engine, params, cache, [(), (("a0", 1.0),)], masks)
    base_only = _run_batch(engine, params, cache, [(), ()], masks)
    assert torch.equal(with_neighbour[0], base_only[0])


def test_an_edit_with_adapters_never_records_the_template_cache(setup, tmp_path):
    engine, _ = setup
    params = make_params(engine, template_seed=77)
    result = engine.edit(make_template(seed=31), full_mask(), PROMPT, 5, params, adapters=SCALES)
    assert not result.used_cache
    assert engine.lookup(make_template(seed=31), params) is None
    assert engine.lookup(make_template(seed=31), params, SCALES) is None


def test_adapters_that_do_not_fit_the_model_are_refused(setup):
    engine, _ = setup
    name, layer = next(iter(engine.adapters.targets.items()))
    wrong = LoraPair(torch.zeros(4, layer.in_features + 1), torch.zeros(layer.out_features, 4), 1.0)
    with pytest.raises(ValueError, match="trained for another model"):
        engine.adapters.put(LoraAdapter("bad", {name: wrong}))
    stray = LoraPair(torch.zeros(4, 8), torch.zeros(8, 4), 1.0)
    with pytest.raises(ValueError, match="not a layer adapters may update"):
        engine.adapters.put(LoraAdapter("bad", {"time_embedding.linear_1": stray}))
    assert "bad" not in engine.adapters
    params = make_params(engine, use_cache=False)
    with pytest.raises(KeyError, match="not loaded"):
        engine.edit(make_template(), full_mask(), PROMPT, 3, params, adapters=(("nope", 1.0),))
