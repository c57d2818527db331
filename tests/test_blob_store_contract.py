"""The blob-store contract (``backend.blobs.objects``), run over both back ends: a local directory
and an S3 bucket on a real S3-compatible server process (``moto_server``, tests/s3_fixtures.py),
reached through boto3 over HTTP. Each test says one promise of the interface; both back ends must
keep it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend.blobs import BlobError, BlobMissing, BlobStore, LocalObjects, ObjectStore
from backend.blobs.factory import open_blob_store, open_objects, s3_client
from backend.blobs.s3 import S3Objects
from backend.config import SettingsError, load_settings

BACKENDS = ("local", "s3")


@pytest.fixture(params=BACKENDS)
def objects(request, tmp_path) -> ObjectStore:
    if request.param == "local":
        return LocalObjects(tmp_path / "objects")
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    return S3Objects(s3_client(endpoint, "us-east-1"), bucket, "team/a/", tmp_path / "host-cache")


@pytest.fixture
def blobs(objects) -> BlobStore:
    return BlobStore(objects)


def test_put_get_exists_delete(objects):
    objects.put("uploads/a.png", b"pixels")
    assert objects.exists("uploads/a.png") and objects.get("uploads/a.png") == b"pixels"
    objects.delete("uploads/a.png")
    assert not objects.exists("uploads/a.png")
    objects.delete("uploads/a.png")  # deleting what is gone is a no-op


def test_a_missing_object_is_blob_missing_everywhere(objects):
    for read in (objects.get, objects.touch, objects.local_path):
        with pytest.raises(BlobMissing, match="does not exist"):
            read("results/never.png")
    with pytest.raises(FileNotFoundError), objects.reading("results/never.png"):
        pass
    assert objects.delete_if_unchanged("results/never.png", 0.0) is False


def test_writing_the_same_bytes_twice_is_harmless(objects, blobs):
    first = blobs.put_content("uploads", b"same bytes", ".img")
    assert blobs.put_content("uploads", b"same bytes", ".img") == first
    assert [blob.key for blob in blobs.files()] == [first]
    assert blobs.get(first) == b"same bytes"


@pytest.mark.parametrize(
    "key", ["", "../etc/passwd", "uploads/../../x", "/abs/x", "uploads//x", ".hidden/x", "a/.b", 7]
)
def test_malformed_keys_are_refused_before_anything_is_touched(objects, key):
    for call in (objects.get, objects.exists, objects.delete, objects.touch, objects.local_path):
        with pytest.raises(BlobError, match="object key"):
            call(key)
    with pytest.raises(BlobError):
        objects.put(key, b"x")


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("secrets/a.png", "blob kind must be one of"),
        ("uploads/../x", "must be 1-128 letters"),
        ("uploads/a/b", "must be 1-128 letters"),
        ("uploads", "must be 1-128 letters"),
    ],
)
def test_bad_refs_say_what_a_ref_is(blobs, ref, words):
    for call in (blobs.get, blobs.exists, blobs.delete, blobs.touch, blobs.local_path):
        with pytest.raises(BlobError, match=words):
            call(ref)


def test_listing_gives_sizes_and_modification_times_of_one_folder(objects):
    before = time.time()
    objects.put("results/a.png", b"x" * 10)
    objects.put("results/b.png", b"y" * 3)
    objects.put("thumbnails/a.webp", b"z")
    listed = {blob.key: blob for blob in objects.listing("results")}
    assert set(listed) == {"results/a.png", "results/b.png"}
    assert listed["results/a.png"].size_bytes == 10 and listed["results/b.png"].size_bytes == 3
    # S3 keeps whole seconds
    assert all(before - 1 <= blob.modified_at <= time.time() + 1 for blob in listed.values())
    assert list(objects.listing("latents")) == []


def test_touch_moves_the_modification_time_and_keeps_the_bytes(objects):
    objects.put("uploads/t.png", b"kept")
    (first,) = objects.listing("uploads")
    time.sleep(1.1)  # S3 modification times are whole seconds
    objects.touch("uploads/t.png")
    (touched,) = objects.listing("uploads")
    assert touched.modified_at > first.modified_at and objects.get("uploads/t.png") == b"kept"


def test_delete_if_unchanged_keeps_what_was_used_since_the_listing(objects):
    objects.put("uploads/old.png", b"1")
    objects.put("uploads/reused.png", b"2")
    listed = {blob.key: blob.modified_at for blob in objects.listing("uploads")}
    time.sleep(1.1)
    objects.touch("uploads/reused.png")
    assert objects.delete_if_unchanged("uploads/old.png", listed["uploads/old.png"])
    assert not objects.delete_if_unchanged("uploads/reused.png", listed["uploads/reused.png"])
    assert not objects.exists("uploads/old.png") and objects.exists("uploads/reused.png")


def test_writing_stores_on_a_clean_exit_and_nothing_on_an_error(objects):
    with objects.writing("latents/j.safetensors") as path:
        path.write_bytes(b"latents")
        assert not objects.exists("latents/j.safetensors")  # not visible before it is whole
        assert list(objects.listing("latents")) == []
    assert objects.get("latents/j.safetensors") == b"latents"
    with pytest.raises(RuntimeError), objects.writing("latents/k.safetensors") as path:
        path.write_bytes(b"half")
        raise RuntimeError("the writer died")
    assert not objects.exists("latents/k.safetensors")
    assert [blob.key for blob in objects.listing("latents")] == ["latents/j.safetensors"]


def test_reading_and_local_paths_hold_the_bytes(objects):
    objects.put("prepared/p.safetensors", b"prepared request")
    with objects.reading("prepared/p.safetensors") as path:
        assert path.read_bytes() == b"prepared request"
        assert path.name.endswith(".safetensors")  # loaders tell a format by its extension
    local = objects.local_path("prepared/p.safetensors")
    assert local.read_bytes() == b"prepared request"
    assert objects.local_path("prepared/p.safetensors") == local  # downloaded once
    objects.delete("prepared/p.safetensors")
    with pytest.raises(BlobMissing):  # a deleted object is not served from an old copy
        objects.local_path("prepared/p.safetensors")


def test_concurrent_writers_of_one_key_leave_one_whole_object(objects):
    payloads = [bytes([n]) * (256 * 1024) for n in range(8)]
    objects.put("results/race.png", payloads[0])
    seen: list[bytes] = []
    stop = threading.Event()

    def read_while_written() -> None:
        while not stop.is_set():
            seen.append(objects.get("results/race.png"))

    reader = threading.Thread(target=read_while_written)
    reader.start()
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda data: objects.put("results/race.png", data), payloads * 2))
    finally:
        stop.set()
        reader.join()
    assert seen and all(data in payloads for data in seen)  # never a mix, never a part
    assert objects.get("results/race.png") in payloads


def test_concurrent_writers_of_many_keys_all_land(objects):
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda n: objects.put(f"masks/{n}.png", str(n).encode()), range(40)))
    assert {blob.key for blob in objects.listing("masks")} == {f"masks/{n}.png" for n in range(40)}
    assert objects.get("masks/17.png") == b"17"


def test_blob_files_list_blob_kinds_only(blobs):
    blobs.put("results", "r.png", b"r")
    blobs.objects.put("gallery/not-a-blob.png", b"g")  # another folder: never swept
    assert [blob.key for blob in blobs.files()] == ["results/r.png"]


def assert_exclusive(objects: ObjectStore) -> None:
    """Four threads take ``objects.lock()``: never two inside at once."""
    inside, overlaps = [], []

    def hold() -> None:
        with objects.lock():
            inside.append(1)
            overlaps.append(len(inside))
            time.sleep(0.05)
            inside.pop()

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [1, 1, 1, 1]


def test_a_directory_lock_excludes_other_holders(tmp_path):
    assert_exclusive(LocalObjects(tmp_path / "gallery"))


def test_an_object_store_lock_is_shared_through_redis(redis_url, s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    settings = load_settings(
        {
            "MASKSERVE_BLOB_URL": f"s3://{bucket}/team",
            "MASKSERVE_S3_ENDPOINT_URL": endpoint,
            "MASKSERVE_REDIS_URL": redis_url,
            "MASKSERVE_DATA_DIR": str(tmp_path),
        }
    )
    assert_exclusive(open_objects(settings, "templates"))
    reader = S3Objects(s3_client(endpoint, ""), bucket, "team/templates/", tmp_path)
    with pytest.raises(RuntimeError, match="only reads it"):
        reader.lock()


def test_settings_pick_the_back_end(tmp_path, s3_bucket):
    endpoint, bucket = s3_bucket
    local = open_blob_store(load_settings({"MASKSERVE_DATA_DIR": str(tmp_path)}))
    assert local.objects.root == tmp_path / "blobs"
    elsewhere = load_settings({"MASKSERVE_BLOB_URL": f"file://{tmp_path}/shared"})
    assert open_blob_store(elsewhere).objects.root == tmp_path / "shared"
    remote = load_settings(
        {
            "MASKSERVE_BLOB_URL": f"s3://{bucket}/prod/eu",
            "MASKSERVE_S3_ENDPOINT_URL": endpoint,
            "MASKSERVE_DATA_DIR": str(tmp_path),
        }
    )
    store = open_blob_store(remote)
    store.put("results", "x.png", b"remote")
    answer = s3_client(endpoint, "").get_object(Bucket=bucket, Key="prod/eu/blobs/results/x.png")
    assert answer["Body"].read() == b"remote"
    assert open_objects(remote, "adapters").prefix == "prod/eu/adapters/"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://minio:9000/bucket", "use s3://bucket/prefix"),
        ("s3://Bad_Bucket/x", "not a valid S3 bucket name"),
        ("s3://bucket/a?versionId=1", "no query"),
        ("s3://bucket/../up", "'/'-separated names"),
        ("file://otherhost/dir", "a file URL names a local path"),
    ],
)
def test_a_bad_blob_url_is_a_settings_error_saying_what_to_write(url, words):
    with pytest.raises(SettingsError, match="MASKSERVE_BLOB_URL") as raised:
        load_settings({"MASKSERVE_BLOB_URL": url})
    assert words in str(raised.value)
