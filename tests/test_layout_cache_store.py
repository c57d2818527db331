"""Ragged layouts and the on-disk template cache format."""

from __future__ import annotations

import json

import pytest
import torch

from backend.engine.attention import attend, ragged_attention, replace_rows
from backend.engine.cache_store import (
    CacheCorruptError,
    CacheError,
    CacheKey,
    CacheMismatchError,
    CacheWriter,
    TemplateCache,
    lookup,
)
from backend.engine.layout import full_layout, make_layout


def _key(**overrides) -> CacheKey:
    fields = dict(
        image_sha256="ab" * 32,
        model_id="tiny-sd2-inpaint",
        model_revision="r1",
        height=256,
        width=256,
        num_steps=2,
        scheduler="EulerDiscreteScheduler",
        strength=1.0,
        template_seed=0,
        mode="kv",
    )
    fields.update(overrides)
    return CacheKey(**fields)


def test_layout_gather_scatter_round_trip():
    masks = [torch.tensor([True, False, True, False]), torch.tensor([False, False, False, True])]
    layout = make_layout(masks)
    full = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    packed = layout.gather(full)
    assert packed.shape == (3, 3)
    assert layout.offsets == (0, 2, 3)
    assert torch.equal(packed[2], full[1, 3])
    rebuilt = layout.scatter_into(torch.zeros_like(full), packed)
    assert torch.equal(rebuilt[0, 0], full[0, 0]) and torch.equal(rebuilt[0, 1], torch.zeros(3))
    assert torch.equal(
        layout.expand_rows(torch.tensor([[1.0], [2.0]])).reshape(-1), torch.tensor([1.0, 1.0, 2.0])
    )


def test_expand_rows_of_one_row_broadcasts_without_a_copy():
    layout = make_layout([torch.tensor([True, False, True, True])])
    per_row = torch.tensor([[1.0, 2.0]])
    expanded = layout.expand_rows(per_row)
    assert expanded is per_row  # one row: broadcast, nothing gathered
    packed = torch.ones(3, 2)
    assert torch.equal(packed * expanded, torch.tensor([[1.0, 2.0]] * 3))


def test_full_layout_is_identity():
    layout = full_layout(2, 5)
    full = torch.randn(2, 5, 4)
    assert layout.is_full and torch.equal(layout.gather(full).reshape(full.shape), full)


def test_ragged_attention_matches_dense_rows():
    torch.manual_seed(0)
    keys, values = torch.randn(2, 6, 2, 4), torch.randn(2, 6, 2, 4)
    queries = torch.randn(2, 6, 2, 4)
    layout = make_layout(
        [torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool), torch.ones(6, dtype=torch.bool)]
    )
    packed_q = layout.gather(queries.flatten(2)).unflatten(-1, (2, 4))
    assert layout.groups == ((0, 1), (1, 2))
    out = ragged_attention(packed_q, layout, lambda g: (keys[g[0] : g[1]], values[g[0] : g[1]]))
    dense = attend(queries, keys, values)
    assert torch.allclose(out[:3], dense[0, layout.indices[0]], atol=1e-6)
    assert torch.allclose(out[3:], dense[1], atol=1e-6)


def test_rows_with_equal_masks_form_one_group():
    mask = torch.tensor([True, False, True])
    layout = make_layout([mask, mask.clone(), torch.tensor([False, True, False])])
    assert layout.groups == ((0, 2), (2, 3))
    packed = torch.arange(5.0).reshape(5, 1)
    assert layout.group_tokens(packed, (0, 2)).shape == (2, 2, 1)


def test_replace_rows_keeps_base_untouched():
    base = torch.zeros(1, 4, 2)
    out = replace_rows(base, torch.tensor([1, 3]), torch.ones(1, 2, 2))
    assert out[0, 1].sum() == 2 and out[0, 0].sum() == 0 and base.sum() == 0


def _write(tmp_path, key, steps=2):
    writer = CacheWriter(tmp_path, key, num_units=2, halves=2, storage_dtype=torch.float32)
    for step in range(steps):
        writer.write_step(
            step,
            {(u, n): torch.full((2, 8, 4), float(step * 10 + u)) for u in range(2) for n in "kv"},
        )
    writer.write_trajectory({"latents": torch.zeros(steps + 1, 4, 2, 2)})
    return writer.commit()


def test_cache_round_trip_reads_one_tensor(tmp_path):
    cache = _write(tmp_path, _key())
    assert cache.num_steps == 2 and cache.num_units == 2
    assert torch.equal(cache.step_tensor(1, 1, "v"), torch.full((2, 8, 4), 11.0))
    assert cache.unit_bytes(0) == 2 * (2 * 8 * 4 * 4)
    again = lookup(tmp_path, _key())
    assert again is not None and again.key == _key()
    assert lookup(tmp_path, _key(height=512)) is None
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "temp dirs must not linger"


def test_cache_key_mismatch_names_the_field(tmp_path):
    cache = _write(tmp_path, _key())
    with pytest.raises(CacheMismatchError, match="model_id"):
        TemplateCache.open(cache.path, _key(model_id="tiny-flux-fill"))
    with pytest.raises(CacheMismatchError, match="height"):
        TemplateCache.open(cache.path, _key(height=512))


def test_corrupted_cache_file_is_reported(tmp_path):
    cache = _write(tmp_path, _key())
    step_file = cache.path / "step_001.safetensors"
    data = bytearray(step_file.read_bytes())
    data[-3] ^= 0xFF
    step_file.write_bytes(bytes(data))
    reopened = TemplateCache.open(cache.path, _key())
    assert torch.equal(reopened.step_tensor(0, 0, "k"), torch.full((2, 8, 4), 0.0))
    with pytest.raises(CacheCorruptError, match="checksum"):
        reopened.step_tensor(1, 0, "k")


def test_missing_file_and_bad_manifest(tmp_path):
    cache = _write(tmp_path, _key())
    (cache.path / "step_000.safetensors").unlink()
    with pytest.raises(CacheCorruptError, match="missing"):
        TemplateCache.open(cache.path).step_tensor(0, 0, "k")
    (cache.path / "manifest.json").write_text("{not json")
    with pytest.raises(CacheCorruptError, match="JSON"):
        TemplateCache.open(cache.path)
    manifest = {"format_version": 99}
    (cache.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheMismatchError, match="format"):
        TemplateCache.open(cache.path)


def test_steps_must_be_written_in_order(tmp_path):
    writer = CacheWriter(tmp_path, _key(), num_units=1, halves=1, storage_dtype=torch.float32)
    with pytest.raises(ValueError, match="in order"):
        writer.write_step(1, {})
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_an_incomplete_recording_is_refused_and_nothing_is_published(tmp_path):
    """A step that lacks a unit's K (a forward that skipped it) must not become a cache that edits
    then fail on: commit refuses it and leaves no entry."""
    writer = CacheWriter(tmp_path, _key(), num_units=2, halves=2, storage_dtype=torch.float32)
    writer.write_step(0, {(u, n): torch.zeros(2, 8, 4) for u in range(2) for n in "kv"})
    writer.write_step(
        1,
        {
            (1, "k"): torch.zeros(2, 8, 4),
            (0, "v"): torch.zeros(2, 8, 4),
            (1, "v"): torch.zeros(2, 8, 4),
        },
    )
    writer.write_trajectory({"latents": torch.zeros(3, 4, 2, 2)})
    with pytest.raises(CacheError, match="step 1 lacks u000.k"):
        writer.commit()
    writer.abort()
    assert lookup(tmp_path, _key()) is None


def test_flux_rotary_as_complex_multiply_matches_diffusers():
    from diffusers.models.embeddings import FluxPosEmbed, apply_rotary_emb

    from backend.engine.flux import _rotate, _rotations

    ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(6.0), indexing="ij"), -1
    ).reshape(-1, 3)
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])(ids)
    x = torch.randn(2, ids.shape[0], 3, 16)  # (rows, tokens, heads, head_dim)
    expected = apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    assert torch.allclose(_rotate(x, _rotations(cos, sin)), expected, atol=1e-6)
    packed = x[0, [1, 5, 7]]  # packed tokens (total, heads, head_dim) with their own rotations
    assert torch.allclose(
        _rotate(packed, _rotations(cos, sin)[[1, 5, 7]]), expected[0, [1, 5, 7]], atol=1e-6
    )
