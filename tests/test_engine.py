"""Mask-aware engine on the real tiny models of all three families, both cache modes (CPU)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from backend.engine.cache_store import CacheCorruptError, CacheMismatchError
from backend.engine.ordinary import run_ordinary
from backend.imaging.masks import MaskError
from backend.models import UnknownModelError, resolve_model
from tests.factories import (
    FAMILIES,
    SIZE,
    full_mask,
    make_engine,
    make_params,
    make_template,
    rect_mask,
)

TOL = 1e-4
MODES = ("kv", "hidden")
MASK = rect_mask((32, 40, 96, 80))
PROMPT = "a blue vase"


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, models_dir, tmp_path_factory):
    return make_engine(request.param, models_dir, tmp_path_factory.mktemp(f"cache-{request.param}"))


def _ordinary_latents(engine, mask, seed, params, prompt=PROMPT):
    return run_ordinary(
        engine.pipe, engine.spec, make_template(), mask, prompt, seed, params, output_type="latent"
    )


def test_all_masked_equals_ordinary_pipeline(engine):
    params = make_params(engine, use_cache=False)
    result = engine.edit(make_template(), full_mask(), PROMPT, 3, params)
    reference = _ordinary_latents(engine, full_mask(), 3, params)
    assert not result.used_cache
    assert (result.latents - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_through_cached_path_equals_ordinary(engine, mode):
    params = make_params(engine, mode=mode, dense_above_ratio=1.0)
    cache = engine.prepare_template(make_template(), params)
    result = engine.edit(make_template(), full_mask(), PROMPT, 3, params, cache=cache)
    assert result.used_cache and result.mask_ratio == 1.0
    reference = _ordinary_latents(engine, full_mask(), 3, params)
    assert (result.latents - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_exact_replay_reproduces_ordinary_pipeline(engine, mode):
    params = make_params(engine, mode=mode, template_seed=9)
    cache = engine.prepare_template(make_template(), params, prompt=PROMPT, mask=MASK)
    result = engine.edit(make_template(), MASK, PROMPT, 9, params, cache=cache)
    assert result.used_cache and 0 < result.mask_ratio < 0.5
    reference = _ordinary_latents(engine, MASK, 9, params)
    assert (result.latents - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_other_mask_keeps_template_outside(engine, mode):
    params = make_params(engine, mode=mode)
    cache = engine.prepare_template(make_template(), params)
    other = rect_mask((8, 8, 56, 40))
    result = engine.edit(make_template(), other, "a green lamp", 21, params, cache=cache)
    assert result.used_cache
    outside = np.asarray(other) == 0
    assert np.array_equal(np.asarray(result.image)[outside], np.asarray(make_template())[outside])
    inside = ~outside
    assert not np.array_equal(np.asarray(result.image)[inside], np.asarray(make_template())[inside])
    # unmasked latents follow the template's recorded trajectory exactly
    final = cache.trajectory("latents")[-1:]
    kept = ~_fresh(engine, result, other)
    assert torch.equal(torch.where(kept, result.latents, 0), torch.where(kept, final, 0))


def _fresh(engine, result, mask):
    params = make_params(engine)
    state = engine.start(make_template(), mask, PROMPT, 0, params)
    return state.fresh.expand_as(result.latents)


def test_cache_changes_the_result_only_where_expected(engine):
    """A cache recorded for another prompt is really read: the edit differs from a dense edit."""
    params = make_params(engine, mode="kv")
    cache = engine.prepare_template(make_template(), params, prompt="a stone wall")
    cached = engine.edit(make_template(), MASK, PROMPT, 4, params, cache=cache)
    dense = engine.edit(make_template(), MASK, PROMPT, 4, make_params(engine, use_cache=False))
    assert cached.used_cache and not dense.used_cache
    assert (cached.latents - dense.latents).abs().max().item() > 1e-3


def test_same_inputs_give_identical_bytes(engine):
    params = make_params(engine)
    cache = engine.prepare_template(make_template(), params)
    first = engine.edit(make_template(), MASK, PROMPT, 11, params, cache=cache)
    second = engine.edit(make_template(), MASK, PROMPT, 11, params, cache=cache)
    assert _png(first.image) == _png(second.image)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("attention", ("grouped", "padded"))
@pytest.mark.parametrize("mode", MODES)
def test_batched_rows_equal_one_at_a_time(engine, mode, attention, monkeypatch):
    """Rows with different templates, masks (so different token counts), seeds and steps in one
    forward match running each alone, with each request's attention apart or all padded into one
    call; the third row reads no cache (it computes every token beside rows that read theirs)."""
    monkeypatch.setattr(engine, "attention", attention)
    params = make_params(engine, mode=mode)
    templates = [make_template(7), make_template(8), make_template(9)]
    caches = [engine.prepare_template(t, params) for t in templates[:2]] + [None]
    masks = [MASK, rect_mask((0, 0, 48, 128)), rect_mask((96, 96, 128, 120))]
    inputs = list(zip(templates, masks, (PROMPT, "a cat", "a dog"), (1, 2, 3), caches))

    def new_state(i):
        template, mask, prompt, seed, cache = inputs[i]
        return engine.start(template, mask, prompt, seed, params, cache=cache)

    alone = [new_state(i) for i in range(3)]
    for state in alone:
        while not state.done:
            engine.step([state], mode)
    batched = [new_state(i) for i in range(3)]
    engine.step([batched[0]], mode)  # row 0 runs one step ahead of the others from here on
    engine.step(batched[:2], mode)  # two rows that read their caches, then all three
    while not all(s.done for s in batched):
        engine.step([s for s in batched if not s.done], mode)
    for solo, together in zip(alone, batched):
        assert (solo.latents - together.latents).abs().max().item() <= TOL


def test_first_edit_records_then_second_uses_cache(engine, tmp_path):
    from backend.engine.editor import MaskAwareEngine

    fresh_engine = MaskAwareEngine(engine.pipe, engine.spec, tmp_path)
    params = make_params(fresh_engine)
    first = fresh_engine.edit(make_template(3), MASK, PROMPT, 1, params)
    second = fresh_engine.edit(make_template(3), MASK, PROMPT, 1, params)
    assert not first.used_cache and second.used_cache
    assert fresh_engine.lookup(make_template(3), params) is not None


def test_empty_mask_is_rejected(engine):
    with pytest.raises(MaskError, match="empty"):
        engine.edit(make_template(), rect_mask((0, 0, 0, 0)), PROMPT, 0, make_params(engine))


def test_mask_of_wrong_size_is_rejected(engine):
    with pytest.raises(MaskError, match="size"):
        engine.edit(
            make_template(),
            rect_mask((0, 0, 10, 10), size=SIZE // 2),
            PROMPT,
            0,
            make_params(engine),
        )


def test_bad_size_and_mode_are_rejected(engine):
    with pytest.raises(ValueError, match="multiples"):
        engine.edit(make_template(), MASK, PROMPT, 0, make_params(engine, size=(100, 100)))
    with pytest.raises(ValueError, match="cache mode"):
        engine.edit(make_template(), MASK, PROMPT, 0, make_params(engine, mode="weird"))


def test_unknown_model_is_rejected():
    with pytest.raises(UnknownModelError, match="tiny-sd2-inpaint"):
        resolve_model("tiny-sd9-inpaint")


def test_cache_of_other_resolution_or_model_is_rejected(engine):
    params = make_params(engine)
    cache = engine.prepare_template(make_template(), params)
    with pytest.raises(CacheMismatchError, match="height"):
        engine.edit(
            make_template(),
            MASK,
            PROMPT,
            0,
            make_params(engine, size=(2 * SIZE, 2 * SIZE)),
            cache=cache,
        )
    with pytest.raises(CacheMismatchError, match="num_steps"):
        engine.edit(make_template(), MASK, PROMPT, 0, make_params(engine, steps=2), cache=cache)


def test_cache_of_another_model_is_rejected(engine, models_dir, tmp_path):
    other_family = next(f for f in FAMILIES if f != engine.spec.family)
    other = make_engine(other_family, models_dir, tmp_path)
    cache = other.prepare_template(
        make_template(), make_params(other, guidance=engine.spec.default_guidance)
    )
    with pytest.raises(CacheMismatchError, match="model_id"):
        engine.edit(make_template(), MASK, PROMPT, 0, make_params(engine), cache=cache)


def test_corrupted_cache_file_is_a_clear_error(engine, tmp_path):
    from backend.engine.editor import MaskAwareEngine

    isolated = MaskAwareEngine(engine.pipe, engine.spec, tmp_path)
    params = make_params(isolated)
    cache = isolated.prepare_template(make_template(), params)
    victim = cache.path / "step_001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-16] + b"\0" * 16)
    reopened = isolated.lookup(make_template(), params)
    with pytest.raises(CacheCorruptError, match="checksum"):
        isolated.edit(make_template(), MASK, PROMPT, 0, params, cache=reopened)


def test_mask_above_dense_ratio_runs_dense(engine):
    params = make_params(engine, dense_above_ratio=0.1)
    cache = engine.prepare_template(make_template(), params)
    result = engine.edit(make_template(), MASK, PROMPT, 2, params, cache=cache)
    assert not result.used_cache and result.mask_ratio > 0.1


def test_margin_grows_the_computed_region(engine):
    plain = engine.edit(make_template(), MASK, PROMPT, 2, make_params(engine, use_cache=False))
    grown = engine.edit(
        make_template(), MASK, PROMPT, 2, make_params(engine, use_cache=False, mask_margin=1)
    )
    assert grown.mask_ratio > plain.mask_ratio


def test_feathered_paste_back_keeps_far_pixels(engine):
    params = make_params(engine, feather_px=4.0)
    cache = engine.prepare_template(make_template(), params)
    result = engine.edit(make_template(), MASK, PROMPT, 2, params, cache=cache)
    far_outside = np.ones((SIZE, SIZE), dtype=bool)
    far_outside[40 - 8 : 80 + 8, 32 - 8 : 96 + 8] = False
    assert np.array_equal(
        np.asarray(result.image)[far_outside], np.asarray(make_template())[far_outside]
    )
    border = np.zeros((SIZE, SIZE), dtype=bool)  # just outside the mask: the feather blends in
    border[36:40, 32:96] = True
    assert not np.array_equal(np.asarray(result.image)[border], np.asarray(make_template())[border])


def test_the_feather_ring_is_computed_fresh_not_read_from_the_cache(engine):
    plain = engine.edit(make_template(), MASK, PROMPT, 2, make_params(engine, use_cache=False))
    feathered = engine.edit(
        make_template(), MASK, PROMPT, 2, make_params(engine, use_cache=False, feather_px=8.0)
    )
    assert feathered.mask_ratio > plain.mask_ratio


def test_installed_engine_keeps_one_copy_of_every_weight(engine):
    """Fused projections are views of one storage: the denoiser's unique storages hold exactly the
    bytes of its state dict (no storage holds a second copy), and self-attention q/k/v share one."""
    denoiser = engine.adapter.denoiser
    tensors = list(denoiser.state_dict().values())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert sum(storages.values()) == sum(t.numel() * t.element_size() for t in tensors)
    shared = [
        (m.to_q.weight, m.to_v.weight)
        for m in denoiser.modules()
        if hasattr(m, "to_q") and not getattr(m, "is_cross_attention", False)
    ]
    assert shared and all(
        q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() for q, v in shared
    )


def test_padded_attention_runs_one_call_per_layer_for_the_whole_batch(engine, monkeypatch):
    """Three requests with different masks: grouped attention calls once per request and layer,
    padded once per layer (the operators a step launches do not grow with its requests)."""
    from backend.engine import attention, flux

    calls, original = [], attention.attend

    def counted(query, key, value):
        calls.append(query.shape[0])
        return original(query, key, value)

    params = make_params(engine, mode="kv")
    templates = [make_template(7), make_template(8), make_template(9)]
    caches = [engine.prepare_template(t, params) for t in templates]
    masks = [MASK, rect_mask((0, 0, 48, 128)), rect_mask((96, 96, 128, 120))]
    monkeypatch.setattr(attention, "attend", counted)
    monkeypatch.setattr(flux, "attend", counted)
    per_mode = {}
    for choice in ("grouped", "padded"):
        monkeypatch.setattr(engine, "attention", choice)
        states = [
            engine.start(t, m, PROMPT, 1, params, cache=c)
            for t, m, c in zip(templates, masks, caches)
        ]
        calls.clear()
        engine.step(states, "kv")
        per_mode[choice] = list(calls)
    assert len(per_mode["grouped"]) == 3 * len(per_mode["padded"]) > 0
    # every padded call holds every row of the batch (the CFG halves of each request)
    assert set(per_mode["padded"]) == {sum(s.req.halves for s in states)}


def test_a_step_that_fails_while_stepping_leaves_its_rows_as_they_were(engine):
    """Out of memory after the forward (here: reading the template's trajectory) changes no row:
    the worker can run the same step again."""
    params = make_params(engine)
    cache = engine.prepare_template(make_template(), params)
    state = engine.start(make_template(), MASK, PROMPT, 1, params, cache=cache)
    engine.step([state], params.mode)
    before = (state.step, state.latents.clone(), state.req.scheduler.step_index)

    class Exhausted:
        def __getitem__(self, _):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    trajectory, state.trajectory = state.trajectory, Exhausted()
    with pytest.raises(torch.OutOfMemoryError):
        engine.step([state], params.mode)
    state.trajectory = trajectory
    assert (state.step, state.req.scheduler.step_index) == (before[0], before[2])
    assert torch.equal(state.latents, before[1])
    engine.step([state], params.mode)
    assert state.step == before[0] + 1
