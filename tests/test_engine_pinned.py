"""Pinned (template, adapters) caches in the engine, on the tiny models, against diffusers + PEFT.

A pinned cache is recorded with an adapter set and read only by edits with exactly that set; an
edit with adapters prefers it to the base cache. Recorded with the edit's own seed, mask and prompt
it replays the ordinary pipeline with the adapters exactly (as a base cache does without them).
"""

from __future__ import annotations

import copy

import pytest

from backend.bench.synthetic_lora import load_into_pipeline, peft_adapter
from backend.cache.key import adapter_set
from backend.engine.cache_store import CacheMismatchError, CacheWriter
from backend.engine.ordinary import run_ordinary
from backend.models import load_pipeline
from tests.factories import FAMILIES, MASK, make_engine, make_params, make_template

pytestmark = [pytest.mark.model, pytest.mark.slow]

TOL = 1e-4
PROMPT = "a red chair"
ADAPTERS = (("p0", 0.8),)


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, models_dir, tmp_path_factory):
    """(engine with adapter p0 resident, reference pipeline with p0 loaded via PEFT)."""
    family = request.param
    engine = make_engine(family, models_dir, tmp_path_factory.mktemp(f"pinned-{family}"))
    reference = load_pipeline(f"tiny-{family}", models_dir)
    name = engine.adapter.denoiser_name
    pristine = copy.deepcopy(getattr(reference, name))
    made = peft_adapter(pristine, "p0", 3, 4, 8.0, sorted(engine.adapters.targets))
    load_into_pipeline(reference, name, made, tmp_path_factory.mktemp(f"{family}-p0"))
    engine.adapters.put(made.adapter)
    reference.set_adapters(["p0"], [0.8])
    return engine, reference


def test_edit_with_adapters_prefers_the_pinned_cache_and_replays_the_ordinary_pipeline(setup):
    engine, reference = setup
    params = make_params(engine, mode="kv", template_seed=9)
    base = engine.prepare_template(make_template(), params, prompt=PROMPT, mask=MASK)
    pinned = engine.prepare_template(
        make_template(), params, prompt=PROMPT, mask=MASK, adapters=ADAPTERS
    )
    assert base.key.adapters == "" and pinned.key.adapters == adapter_set(ADAPTERS)
    assert engine.lookup(make_template(), params, ADAPTERS).key == pinned.key
    assert engine.lookup(make_template(), params).key == base.key
    result = engine.edit(make_template(), MASK, PROMPT, 9, params, adapters=ADAPTERS)
    assert result.used_cache and 0 < result.mask_ratio < 0.5
    expected = run_ordinary(
        reference, engine.spec, make_template(), MASK, PROMPT, 9, params, output_type="latent"
    )
    assert (result.latents - expected).abs().max().item() <= TOL
    # the base cache holds the base model's activations: reading it with the adapter differs
    on_base = engine.edit(make_template(), MASK, PROMPT, 9, params, cache=base, adapters=ADAPTERS)
    assert (on_base.latents - expected).abs().max().item() > 10 * TOL


def test_recording_with_adapters_writes_the_pinned_key_never_the_base_one(setup):
    engine, _ = setup
    params = make_params(engine, template_seed=41)
    template = make_template(seed=41)
    pinned = engine.prepare_template(template, params, adapters=ADAPTERS)
    assert pinned.key == engine.cache_key(template, params, ADAPTERS)
    assert engine.lookup(template, params) is None
    assert engine.lookup(template, params, (("p0", 0.5),)) is None
    assert engine.lookup(template, params, ADAPTERS).key == pinned.key
    # an edit with other scales may not read it
    with pytest.raises(CacheMismatchError, match="adapters"):
        engine.edit(template, MASK, PROMPT, 1, params, cache=pinned, adapters=(("p0", 0.5),))
    with pytest.raises(CacheMismatchError, match="adapters"):
        engine.edit(template, MASK, PROMPT, 1, params, cache=pinned)


def test_a_row_whose_adapters_differ_from_its_recording_is_refused(setup, tmp_path):
    engine, _ = setup
    params = make_params(engine)
    base_key = engine.cache_key(make_template(), params)
    state = engine.start(make_template(), None, PROMPT, 1, params, record=True, adapters=ADAPTERS)
    state.writer = CacheWriter(
        tmp_path, base_key, engine.num_units, state.req.halves, engine.adapter.dtype
    )
    with pytest.raises(ValueError, match="record a pinned cache"):
        engine.step([state], params.mode)
    # an adapter that joins a recording row late is refused just the same
    state = engine.start(make_template(), None, PROMPT, 1, params, record=True)
    state.writer = CacheWriter(
        tmp_path, base_key, engine.num_units, state.req.halves, engine.adapter.dtype
    )
    engine.step([state], params.mode)
    state.adapters = ADAPTERS
    with pytest.raises(ValueError, match="record a pinned cache"):
        engine.step([state], params.mode)
    state.writer.abort()
