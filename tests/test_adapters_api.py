"""``/v1/adapters`` end to end on a real Redis: the API stages the upload and sends the ingest task
through Celery; a CPU-worker thread takes it off the broker's queue and runs the task body (one test
runs a real ``maskserve cpu-worker`` process instead). Also the client and the CLI."""

from __future__ import annotations

import argparse
import base64
import json
import threading
import time

import pytest
import uvicorn
from fastapi.testclient import TestClient
from redis import Redis

from backend.adapters.cli import add_adapter_parser
from backend.adapters.ingest import run_ingest_task
from backend.api.app import create_app
from backend.blobs import BlobStore
from backend.client import MaskServeClient, MaskServeError
from backend.protocol.keys import ADAPTER_INGEST_TASK
from backend.services.redis_server import free_port
from tests.adapter_factory import make_adapter_file
from tests.api_factory import KEY, OTHER_KEY, make_settings
from tests.test_celery_tasks import engine, stack  # noqa: F401 (fixtures)

pytestmark = pytest.mark.model
MODEL = "tiny-sd2-inpaint"


class CpuWorkerThread:
    """Takes ingest tasks off the Celery pre queue (kombu's Redis list) and runs the task body."""

    def __init__(self, settings, client: Redis):
        self.settings, self.client = settings, client
        self.blobs = BlobStore(settings.paths.data_dir / "blobs")
        self.stop, self.tasks = threading.Event(), []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            popped = self.client.brpop([self.settings.celery.pre_queue], timeout=1)
            if popped is None:
                continue
            message = json.loads(popped[1])
            self.tasks.append(message["headers"]["task"])
            args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            run_ingest_task(self.client, self.blobs, args[0])


@pytest.fixture
def settings(redis_url, tmp_path):
    settings = make_settings(redis_url, tmp_path, models=(MODEL, "tiny-flux-fill"))
    return settings.model_copy(
        update={
            "engine": settings.engine.model_copy(update={"model_id": MODEL}),
            "adapters": settings.adapters.model_copy(
                update={"ingest_timeout_s": 20.0, "max_mb": 1.0, "max_rank": 8}
            ),
        }
    )


@pytest.fixture
def worker(settings, redis_client):
    worker = CpuWorkerThread(settings, redis_client)
    worker.thread.start()
    yield worker
    worker.stop.set()
    worker.thread.join(timeout=5)


@pytest.fixture
def client(settings, redis_client):
    app = create_app(settings, redis_client=redis_client)
    with TestClient(app, headers={"X-API-Key": KEY}) as test_client:
        yield test_client


def upload(client, data: bytes, **form):
    return client.post(
        "/v1/adapters", data=form, files={"file": ("pixel-art.safetensors", data, "application/x")}
    )


def nothing_stored(settings) -> bool:
    folders = (
        settings.paths.resolved_adapters_dir() / "records",
        settings.paths.resolved_adapters_dir() / "content",
        settings.paths.data_dir / "blobs" / "uploads",
    )
    return not any(folder.exists() and list(folder.iterdir()) for folder in folders)


def test_upload_list_inspect_delete(client, worker, settings, tmp_path):
    data = make_adapter_file(MODEL, tmp_path / "a.safetensors", rank=4, layout="kohya").read_bytes()
    created = upload(client, data)
    assert created.status_code == 201, created.text
    record = created.json()
    assert worker.tasks == [ADAPTER_INGEST_TASK]
    assert record["name"] == "pixel-art" and record["model_id"] == MODEL
    assert record["family"] == "sd2-inpaint" and record["source_layout"] == "kohya"
    assert record["rank"] == 4 and record["num_pairs"] == len(record["ranks"]) == 48
    assert sum(record["targets"].values()) == 48 and "owner" not in record
    listed = client.get("/v1/adapters").json()["adapters"]
    assert [a["adapter_id"] for a in listed] == [record["adapter_id"]] and "ranks" not in listed[0]
    assert client.get(record["url"]).json() == record
    # another key sees none of it
    other = {"X-API-Key": OTHER_KEY}
    assert client.get("/v1/adapters", headers=other).json() == {"adapters": []}
    assert client.get(record["url"], headers=other).status_code == 404
    assert client.delete(record["url"], headers=other).status_code == 404
    # the same file again is stored once; the staged blobs are gone
    again = upload(client, data, name="again").json()
    assert again["sha256"] == record["sha256"]
    assert len(list((settings.paths.resolved_adapters_dir() / "content").iterdir())) == 1
    assert list((settings.paths.data_dir / "blobs" / "uploads").iterdir()) == []
    assert client.delete(record["url"]).status_code == 204
    assert client.delete(again["url"]).status_code == 204
    gone = client.get(record["url"])
    assert gone.status_code == 404 and "no adapter with id" in gone.json()["error"]
    assert nothing_stored(settings)


@pytest.mark.parametrize(
    ("case", "status", "words"),
    [
        ("garbage", 415, "not a readable .safetensors"),
        ("truncated", 415, "truncated"),
        ("other_family", 422, "this adapter is for SD 1.x/2.x (sd2-inpaint), the model is Flux"),
        ("rank", 422, "limit of 8"),
        ("too_large", 413, "limit of 1 MB"),
        ("unknown_model", 422, "unknown model"),
        ("bad_name", 422, "adapter name is empty"),
    ],
)
def test_bad_uploads_get_a_clear_4xx_and_store_nothing(
    client, worker, settings, tmp_path, case, status, words
):
    good = make_adapter_file(MODEL, tmp_path / "a.safetensors", rank=2).read_bytes()
    form: dict = {}
    data = good
    if case == "garbage":
        data = b"\x89PNG not an adapter"
    elif case == "truncated":
        data = good[: len(good) // 2]
    elif case == "other_family":
        form = {"model": "tiny-flux-fill"}
    elif case == "rank":
        data = make_adapter_file(MODEL, tmp_path / "r.safetensors", rank=16).read_bytes()
    elif case == "too_large":
        data = good + b"\0" * (2**20)
    elif case == "unknown_model":
        form = {"model": "no-such-model"}
    elif case == "bad_name":
        form = {"name": "   "}
    response = upload(client, data, **form)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]
    assert nothing_stored(settings)


def test_no_cpu_worker_answers_503_and_nothing_is_stored(client, settings, tmp_path):
    short = settings.adapters.model_copy(update={"ingest_timeout_s": 1.0})
    client.app.state.adapter_service.settings = settings.model_copy(update={"adapters": short})
    data = make_adapter_file(MODEL, tmp_path / "a.safetensors", rank=2).read_bytes()
    response = upload(client, data)
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert "no CPU worker answered within 1 s" in response.json()["error"]
    assert nothing_stored(settings)


@pytest.fixture
def served(client):
    """The test app served over HTTP by uvicorn in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(client.app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_client_and_cli(served, worker, settings, tmp_path, capsys):
    folder = tmp_path / "adapters"
    make_adapter_file(MODEL, folder / "one.safetensors", seed=1, rank=2)
    make_adapter_file(MODEL, folder / "two.safetensors", seed=2, rank=2, layout="kohya")
    (folder / "notes.txt").write_text("not an adapter")
    with MaskServeClient(served, KEY) as api:
        record = api.upload_adapter(folder / "one.safetensors", name="One")
        assert api.get_adapter(record["adapter_id"])["name"] == "One"
        assert [a["name"] for a in api.list_adapters()] == ["One"]
        api.delete_adapter(record["adapter_id"])
        with pytest.raises(MaskServeError) as missing:
            api.get_adapter(record["adapter_id"])
        assert missing.value.status == 404

    parser = argparse.ArgumentParser()
    add_adapter_parser(parser.add_subparsers(dest="command"))

    def cli(*argv) -> int:
        args = parser.parse_args(["adapters", *argv, "--url", served, "--api-key", KEY])
        return args.func(args, settings)

    assert cli("add", str(folder)) == 0
    added = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [a["name"] for a in added] == ["one", "two"]
    assert [a["source_layout"] for a in added] == ["peft", "kohya"]
    assert cli("list") == 0 and len(capsys.readouterr().out.splitlines()) == 2
    assert cli("show", added[0]["adapter_id"]) == 0
    assert json.loads(capsys.readouterr().out)["rank"] == 2
    assert cli("rm", added[0]["adapter_id"]) == 0
    assert cli("rm", added[0]["adapter_id"]) == 2
    assert "no adapter with id" in capsys.readouterr().err
    (folder / "bad.safetensors").write_bytes(b"nope")
    assert cli("add", str(folder / "bad.safetensors")) == 2
    assert "not a readable .safetensors" in capsys.readouterr().err


def test_a_real_cpu_worker_ingests_an_upload(stack, tmp_path):  # noqa: F811 (a fixture)
    """The Celery task as `maskserve cpu-worker` runs it (test_celery_tasks' stack)."""
    settings, _celery, _jobstate, client = stack
    keyed = settings.api.model_copy(update={"api_keys": (KEY,)})
    app = create_app(settings.model_copy(update={"api": keyed}), redis_client=client)
    data = make_adapter_file(MODEL, tmp_path / "a.safetensors", rank=2).read_bytes()
    with TestClient(app, headers={"X-API-Key": KEY}) as api:
        response = upload(api, data)
    assert response.status_code == 201, (response.text, (tmp_path / "cpu-worker.log").read_text())
    assert response.json()["num_pairs"] == 48
