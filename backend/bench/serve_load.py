"""The client side of `maskserve bench serve`: replays a trace to a stack through REST only.

``Replay.run`` submits each request at its arrival time (open loop: arrivals never wait for
results), follows every job to a terminal state from one polling thread (the caller's job list,
one request per poll, so the client stays light next to the stack it measures), waits up to
``drain_s`` after the last arrival, and returns one ``ServeRecord`` per request. Requests are
built before the replay starts (``RequestBank``: masks encoded once, the same bytes for every
arm), so building them never delays an arrival.

Invariant: every request of the trace gets exactly one record; one the API refused is
``refused`` with its reason, one still open when the drain ends is ``unfinished``.
"""

from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
from PIL import Image
from tqdm import tqdm

from backend.bench.serve_stats import ServeRecord
from backend.bench.trace import TraceRequest
from backend.client import TERMINAL, MaskServeClient, MaskServeError
from backend.imaging.masks import synthetic_mask

POLL_S = 0.25
MAX_OPEN_LISTED = 500  # the job list's largest page: a replay never has more requests than this
# Prompts cycled by request: rows of one batch carry different conditioning, as real traffic does
PROMPTS = (
    "a red leather armchair",
    "a bowl of green apples",
    "a blue ceramic vase with flowers",
    "a sleeping grey cat",
    "a yellow umbrella",
    "a stack of old books",
)


@dataclass(frozen=True)
class Workload:
    """What every request of a run shares (the same in every arm, except ``use_cache``)."""

    model_id: str
    size: int
    steps: int
    use_cache: bool = True


def mask_kind(seed: int) -> str:
    """Irregular masks, as painted: blobs and brush strokes in equal shares."""
    return "stroke" if seed % 2 else "blob"


def request_mask(request: TraceRequest, size: int) -> np.ndarray:
    return synthetic_mask(size, size, request.mask_ratio, request.seed, mask_kind(request.seed))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class RequestBank:
    """Each request's mask PNG and prompt, made once per (trace, index) and shared by every arm."""

    def __init__(self, size: int):
        self.size = size
        self._masks: dict[tuple[str, int], bytes] = {}

    def mask_png(self, trace: str, request: TraceRequest) -> bytes:
        key = (trace, request.index)
        if key not in self._masks:
            mask = request_mask(request, self.size)
            self._masks[key] = png_bytes(Image.fromarray(mask.astype(np.uint8) * 255))
        return self._masks[key]

    def prepare(self, trace: str, requests: list[TraceRequest]) -> None:
        for request in requests:
            self.mask_png(trace, request)


class Replay:
    """One trace replayed to one arm's stack."""

    def __init__(
        self,
        client: MaskServeClient,
        workload: Workload,
        template_ids: list[str],
        bank: RequestBank,
        arm: str,
        progress: bool = True,
    ):
        self.client, self.workload, self.template_ids = client, workload, template_ids
        self.bank, self.arm, self.progress = bank, arm, progress
        self._open: dict[str, ServeRecord] = {}
        self._lock = threading.Lock()
        self._start = 0.0

    def run(self, trace: str, requests: list[TraceRequest], drain_s: float) -> list[ServeRecord]:
        if len(requests) > MAX_OPEN_LISTED:
            raise ValueError(f"a replay holds at most {MAX_OPEN_LISTED} requests")
        self.bank.prepare(trace, requests)
        records = [self._record(trace, r) for r in requests]
        stop = threading.Event()
        poller = threading.Thread(target=self._poll, args=(stop, len(requests)), daemon=True)
        self._start = time.monotonic()
        poller.start()
        bar = tqdm(total=len(requests), desc=f"{self.arm} {trace}", disable=not self.progress)
        try:
            for request, record in zip(requests, records):
                time.sleep(max(0.0, self._start + request.arrival_s - time.monotonic()))
                self._submit(trace, request, record)
                bar.update(1)
            deadline = time.monotonic() + drain_s
            while self._open_count() and time.monotonic() < deadline:
                time.sleep(POLL_S)
        finally:
            stop.set()
            poller.join()
            bar.close()
        for record in records:
            if record.status in ("queued", "submitted"):
                record.status, record.message = "unfinished", f"not done {drain_s:g} s after"
        return records

    def _record(self, trace: str, request: TraceRequest) -> ServeRecord:
        return ServeRecord(
            arm=self.arm,
            trace=trace,
            index=request.index,
            arrival_s=request.arrival_s,
            template=request.template,
            mask_ratio=request.mask_ratio,
            mask_kind=mask_kind(request.seed),
            seed=request.seed,
        )

    def _submit(self, trace: str, request: TraceRequest, record: ServeRecord) -> None:
        record.submitted_s = time.monotonic() - self._start
        try:
            accepted = self.client.submit(
                self.bank.mask_png(trace, request),
                PROMPTS[request.index % len(PROMPTS)],
                template_id=self.template_ids[request.template % len(self.template_ids)],
                model=self.workload.model_id,
                steps=self.workload.steps,
                resolution=self.workload.size,
                seed=request.seed,
                use_cache=self.workload.use_cache,
            )
        except (MaskServeError, httpx.TransportError) as exc:
            record.status, record.message = "refused", str(exc)
            return
        record.job_id, record.status = accepted["job_id"], "submitted"
        with self._lock:
            self._open[record.job_id] = record

    def _open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def _poll(self, stop: threading.Event, listed: int) -> None:
        while not stop.wait(POLL_S):
            try:
                jobs = self.client.jobs(limit=min(MAX_OPEN_LISTED, max(1, listed)))
            except (MaskServeError, httpx.TransportError):
                continue  # asked again next turn; the drain deadline bounds the wait
            now = time.monotonic() - self._start
            for job in jobs:
                if job.get("status") in TERMINAL:
                    with self._lock:
                        record = self._open.pop(job["job_id"], None)
                    if record is not None:
                        finish(record, job, now)


def finish(record: ServeRecord, job: dict, now_s: float) -> None:
    """Fill ``record`` from the job's terminal state, seen at ``now_s`` into the replay."""
    timings = {k: float(v) for k, v in (job.get("timings") or {}).items() if _is_number(v)}
    record.status, record.message = job["status"], job.get("message", "")
    record.finished_s, record.timings = now_s, timings
    record.worker_id = job.get("worker_id") or ""
    record.client_latency_s = now_s - record.submitted_s
    if record.status == "done":
        record.latency_s = timings.get("total_s", record.client_latency_s)
        # the server's clock, not the poll's quarter-second grid, dates the finish
        record.finished_s = record.submitted_s + record.latency_s


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def wait_done(client: MaskServeClient, job_id: str, timeout_s: float) -> dict:
    """Poll one job until it is terminal; RuntimeError unless it ends done."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(job_id)
        if job["status"] in TERMINAL:
            if job["status"] != "done":
                raise RuntimeError(f"job {job_id} ended {job['status']}: {job.get('message')}")
            return job
        time.sleep(POLL_S)
    raise RuntimeError(f"job {job_id} not done within {timeout_s:g} s")
