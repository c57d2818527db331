"""The adapter registry's storage contract: ids, tenancy, deduplication, atomic writes, delete."""

from __future__ import annotations

import json

import pytest

from backend.adapters.store import (
    AdapterError,
    AdapterFacts,
    AdapterNotFound,
    AdapterStore,
    layer_kinds,
)

FACTS = AdapterFacts(
    family="sd2-inpaint",
    model_id="tiny-sd2-inpaint",
    source_layout="kohya",
    ranks={
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q": 4,
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": 8,
        "mid_block.attentions.0.proj_in": 4,
    },
    nbytes=1234,
)


@pytest.fixture
def store(tmp_path):
    return AdapterStore(tmp_path / "adapters")


def normalized(tmp_path, data: bytes = b"normalized adapter bytes"):
    path = tmp_path / f"n-{len(data)}.safetensors"
    path.write_bytes(data)
    return path


def test_a_record_says_what_the_adapter_is(store, tmp_path):
    record = store.add(normalized(tmp_path), FACTS, " Pixel art ", "alice")
    assert record.name == "Pixel art" and record.rank == 8 and record.num_pairs == 3
    assert record.family == "sd2-inpaint" and record.model_id == "tiny-sd2-inpaint"
    assert record.source_layout == "kohya" and record.nbytes == 1234
    assert record.targets == {
        "down_blocks.N.attentions.N.transformer_blocks.N.attn1.to_q": 2,
        "mid_block.attentions.N.proj_in": 1,
    }
    assert store.get(record.adapter_id, "alice") == record
    assert store.content_path(record).read_bytes() == b"normalized adapter bytes"


def test_layer_kinds_counts_modules_by_kind():
    kinds = layer_kinds(["single_transformer_blocks.3.attn.to_q", "x_embedder", "ff.net.0.proj"])
    assert kinds == {
        "ff.net.N.proj": 1,
        "single_transformer_blocks.N.attn.to_q": 1,
        "x_embedder": 1,
    }


def test_tenancy_fails_closed(store, tmp_path):
    record = store.add(normalized(tmp_path), FACTS, "mine", "alice")
    for owner in ("bob", ""):
        with pytest.raises(AdapterNotFound) as other:
            store.get(record.adapter_id, owner)
        assert str(other.value) == str(AdapterNotFound(record.adapter_id))
        assert store.list(owner) == []
        with pytest.raises(AdapterNotFound):
            store.delete(record.adapter_id, owner)
    # a record written without an owner belongs to nobody
    path = store.objects.root / "records" / f"{record.adapter_id}.json"
    path.write_text(json.dumps(record.to_dict() | {"owner": ""}))
    with pytest.raises(AdapterNotFound):
        store.get(record.adapter_id, "alice")


@pytest.mark.parametrize("bad", ["../../etc/passwd", "0" * 31, "A" * 32, "", None])
def test_ids_are_validated_before_any_path_is_built(store, bad):
    with pytest.raises(AdapterNotFound):
        store.get(bad, "alice")


def test_the_same_content_is_stored_once_and_deleted_with_its_last_record(store, tmp_path):
    first = store.add(normalized(tmp_path), FACTS, "one", "alice")
    second = store.add(normalized(tmp_path), FACTS, "two", "bob")
    third = store.add(normalized(tmp_path, b"other bytes"), FACTS, "three", "alice")
    assert first.sha256 == second.sha256 != third.sha256
    assert len(list((store.objects.root / "content").iterdir())) == 2
    assert [r.name for r in store.list("alice")] == ["three", "one"]  # newest first
    store.delete(first.adapter_id, "alice")
    assert store.content_path(second).exists()  # bob's record still shares it
    store.delete(second.adapter_id, "bob")
    assert not (store.objects.root / "content" / f"{first.sha256}.safetensors").exists()
    with pytest.raises(AdapterNotFound):
        store.get(first.adapter_id, "alice")
    assert [r.name for r in store.list("alice")] == ["three"]


def test_a_failed_record_write_leaves_no_record(store, tmp_path, monkeypatch):
    def fail(key, data):
        raise OSError("disk full")

    monkeypatch.setattr(store.objects, "put", fail)  # the record is the one object put
    with pytest.raises(OSError):
        store.add(normalized(tmp_path), FACTS, "x", "alice")
    assert list(store.objects.listing("records")) == []
    assert store.list("alice") == []


def test_bad_names_are_refused(store, tmp_path):
    for name, words in (("", "adapter name is empty"), ("a\nb", "control characters")):
        with pytest.raises(AdapterError, match=words):
            store.add(normalized(tmp_path), FACTS, name, "alice")
    assert store.list("alice") == []


def test_unreadable_records_are_skipped(store, tmp_path):
    record = store.add(normalized(tmp_path), FACTS, "ok", "alice")
    (store.objects.root / "records" / f"{'f' * 32}.json").write_text("{not json")
    assert [r.adapter_id for r in store.list("alice")] == [record.adapter_id]
