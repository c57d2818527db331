"""The template gallery's storage layer (real files, real images)."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
from PIL import Image

from templates_store.samples import sample_template
from templates_store.store import (
    MAX_NAME_CHARS,
    MAX_TAGS,
    TemplateError,
    TemplateNotFound,
    TemplateStore,
)

OWNER = "key:owner-a"
OTHER = "key:owner-b"


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture
def store(tmp_path):
    return TemplateStore(tmp_path / "gallery", max_pixels=512 * 512, max_bytes=2 * 2**20)


def test_add_stores_png_thumbnail_and_record(store):
    image = sample_template(96, 64, seed=1)
    record = store.add(
        encoded(image, "JPEG"), "  Living room  ", OWNER, ["Interior", "sofa", "interior", ""]
    )
    assert (
        len(record.id) == 32
        and record.name == "Living room"
        and record.tags == ("interior", "sofa")
    )
    assert (record.width, record.height) == (96, 64)
    stored = store.image_path(record.id, OWNER)
    assert stored.suffix == ".png" and stored.stat().st_size == record.bytes
    assert Image.open(stored).format == "PNG" and Image.open(stored).size == (96, 64)
    thumb = Image.open(store.thumbnail_path(record.id, OWNER))
    assert thumb.format == "WEBP" and max(thumb.size) <= 256
    assert store.get(record.id, OWNER) == record
    assert not list(store.objects.root.rglob(".tmp.*"))  # atomic writes leave no temp files


def test_same_pixels_share_one_content_file_until_the_last_delete(store):
    image = sample_template(64, 64, seed=2)
    first = store.add(encoded(image, "PNG"), "a", OWNER, [])
    second = store.add(encoded(image, "BMP"), "b", OWNER, [])  # same pixels, another format
    assert first.id != second.id and first.sha256 == second.sha256
    assert store.image_path(first.id, OWNER) == store.image_path(second.id, OWNER)
    store.delete(first.id, OWNER)
    assert store.image_path(second.id, OWNER).exists()
    with pytest.raises(TemplateNotFound):
        store.get(first.id, OWNER)
    store.delete(second.id, OWNER)
    assert not list((store.objects.root / "content").iterdir()) and not list(
        (store.objects.root / "thumbs").iterdir()
    )


def test_list_searches_names_filters_tags_newest_first(store):
    records = []
    for i, (name, tags) in enumerate(
        [
            ("Kitchen day", ["interior"]),
            ("Garden", ["outdoor"]),
            ("kitchen night", ["interior", "night"]),
        ]
    ):
        records.append(store.add(encoded(sample_template(32, 32, seed=i)), name, OWNER, tags))
        time.sleep(0.002)
    assert [r.name for r in store.list(OWNER)] == ["kitchen night", "Garden", "Kitchen day"]
    assert [r.name for r in store.list(OWNER, query="KITCHEN")] == ["kitchen night", "Kitchen day"]
    assert [r.name for r in store.list(OWNER, tag="Night")] == ["kitchen night"]
    assert [r.name for r in store.list(OWNER, query="day", tag="interior")] == ["Kitchen day"]
    assert store.list(OWNER, query="nothing like this") == []


def test_unreadable_record_is_skipped(store):
    record = store.add(encoded(sample_template(32, 32)), "ok", OWNER, [])
    (store.objects.root / "records" / ("f" * 32 + ".json")).write_text("{not json")
    assert [r.id for r in store.list(OWNER)] == [record.id]


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("x" * (MAX_NAME_CHARS + 1), "limit"),
        ("two\nlines", "control characters"),
    ],
)
def test_bad_names_are_refused(store, name, message):
    with pytest.raises(TemplateError, match=message):
        store.add(encoded(sample_template(32, 32)), name, OWNER, [])


@pytest.mark.parametrize(
    "tags, message",
    [
        (["has space"], "not allowed"),
        (["../etc"], "not allowed"),
        (["x" * 40], "not allowed"),
        ([f"t{i}" for i in range(MAX_TAGS + 1)], "limit"),
    ],
)
def test_bad_tags_are_refused(store, tags, message):
    with pytest.raises(TemplateError, match=message):
        store.add(encoded(sample_template(32, 32)), "ok", OWNER, tags)


def test_names_are_display_strings_never_paths(store):
    record = store.add(encoded(sample_template(32, 32)), "../../etc/passwd", OWNER, [])
    assert record.name == "../../etc/passwd"
    assert {p.parent.name for p in store.objects.root.rglob("*") if p.is_file()} <= {
        "content",
        "thumbs",
        "records",
        "gallery",
    }


def test_image_problems_carry_a_code(store):
    with pytest.raises(TemplateError, match="not an image") as err:
        store.add(b"hello, not an image", "x", OWNER, [])
    assert err.value.code == "unsupported_format"
    gif = encoded(Image.new("P", (8, 8)), "GIF")
    with pytest.raises(TemplateError, match="GIF") as err:
        store.add(gif, "x", OWNER, [])
    assert err.value.code == "unsupported_format"
    with pytest.raises(TemplateError, match="limit") as err:
        store.add(encoded(Image.new("RGB", (600, 600))), "big", OWNER, [])
    assert err.value.code == "too_large"
    noise = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    small_store = TemplateStore(store.objects.root, max_pixels=4096 * 4096, max_bytes=100_000)
    with pytest.raises(TemplateError, match="MiB") as err:
        small_store.add(encoded(Image.fromarray(noise)), "heavy", OWNER, [])
    assert err.value.code == "too_large"
    with pytest.raises(TemplateError, match="empty") as err:
        store.add(b"", "x", OWNER, [])
    assert err.value.code == "invalid"
    assert store.list(OWNER) == []


@pytest.mark.parametrize("bad_id", ["../records/x", "nope", "A" * 32, "", "0" * 31 + "/"])
def test_malformed_or_unknown_ids_are_not_found(store, bad_id):
    for call in (store.get, store.delete, store.image_path, store.thumbnail_path):
        with pytest.raises(TemplateNotFound):
            call(bad_id, OWNER)
    with pytest.raises(TemplateNotFound):
        store.get("0" * 32, OWNER)


def test_record_json_round_trips(store):
    record = store.add(encoded(sample_template(40, 30)), "Ünïcödé name ✓", OWNER, ["é-tag"])
    on_disk = json.loads((store.objects.root / "records" / f"{record.id}.json").read_text())
    assert on_disk["tags"] == ["é-tag"] and store.get(record.id, OWNER) == record


def test_each_owner_sees_only_its_records_over_shared_content(store):
    image = sample_template(48, 48, seed=9)
    mine = store.add(encoded(image, "PNG"), "mine", OWNER, ["shared"])
    theirs = store.add(encoded(image, "BMP"), "theirs", OTHER, ["shared"])  # the same pixels
    assert mine.sha256 == theirs.sha256  # one content file ...
    assert [r.id for r in store.list(OWNER)] == [mine.id]  # ... but each sees its own record only
    assert [r.id for r in store.list(OTHER, tag="shared")] == [theirs.id]
    for call in (store.get, store.delete, store.image_path, store.thumbnail_path):
        with pytest.raises(TemplateNotFound) as refused:
            call(mine.id, OTHER)
        # word for word what an id that never existed gives: the id is not confirmed
        assert str(refused.value) == str(TemplateNotFound(mine.id))
    store.delete(theirs.id, OTHER)  # the other owner's delete keeps the content mine still uses
    assert store.image_path(mine.id, OWNER).exists()


def test_a_record_without_an_owner_is_nobodys(store):
    record = store.add(encoded(sample_template(32, 32)), "legacy", OWNER, [])
    path = store.objects.root / "records" / f"{record.id}.json"
    data = json.loads(path.read_text())
    del data["owner"]  # written before records had owners
    path.write_text(json.dumps(data))
    assert store.list(OWNER) == [] and store.list("") == []
    for owner in (OWNER, ""):
        with pytest.raises(TemplateNotFound):
            store.get(record.id, owner)
