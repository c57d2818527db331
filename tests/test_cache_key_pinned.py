"""Pinned (template, adapters) cache keys: the adapter set and scales are part of the key, and a
base key is what it was before pinned caches existed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from backend.cache.key import adapter_set, lookup_keys, pinned_key
from tests.factories import cache_key


def test_pinned_keys_differ_by_adapters_and_scales():
    base = cache_key(3)
    variants = [
        base,
        pinned_key(base, (("a", 1.0),)),
        pinned_key(base, (("a", 0.5),)),
        pinned_key(base, (("b", 1.0),)),
        pinned_key(base, (("a", 1.0), ("b", 1.0))),
    ]
    assert len({key.digest() for key in variants}) == len(variants)
    assert all(key.adapters for key in variants[1:])
    assert "adapters" in "; ".join(variants[1].mismatches(variants[2]))


def test_adapter_sets_are_canonical():
    assert adapter_set((("b", 1.0), ("a", 0.5))) == adapter_set((("a", 0.5), ("b", 1.0)))
    # a repeated id's scales add up, as the engine applies them
    assert adapter_set((("a", 0.25), ("a", 0.25))) == adapter_set((("a", 0.5),))
    # scales that add up to nothing leave the base model
    assert adapter_set((("a", 0.0),)) == adapter_set((("a", 1.0), ("a", -1.0))) == ""
    assert pinned_key(cache_key(1), (("a", 0.0),)) == cache_key(1)


def test_base_key_digest_is_unchanged_by_the_adapters_field():
    key = cache_key(5)
    fields = asdict(key)
    del fields["adapters"]
    before = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    assert key.digest() == before


def test_lookup_keys_put_the_pinned_cache_first():
    base = cache_key(2)
    pinned = pinned_key(base, (("a", 1.0),))
    assert lookup_keys(base, (("a", 1.0),)) == (pinned, base)
    assert lookup_keys(pinned, (("a", 1.0),)) == (pinned, base)
    assert lookup_keys(base, ()) == (base,)
    assert lookup_keys(pinned, ()) == (base,)
