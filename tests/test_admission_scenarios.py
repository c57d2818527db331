"""One table of admission scenarios, run against the real worker and the route simulation's worker.

Each scenario lists arrivals by worker iteration and expects, per job, the iteration at which it
is admitted and whether it reads its template's cache. The real path is ``EngineWorker`` with a
``TieredActivationCache`` over caches recorded by the tiny sd2 engine; its disk -> RAM reads land
between iterations (each read is let through once the iteration that started it has ended). The
simulated path is ``route_sim.SimWorker`` driven one iteration per simulated second, with reads
short enough that every read started in an iteration lands before the next one. Both must admit
alike: they share ``AdmissionRules``, ``BatchScheduler`` and ``CacheManager``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from backend.bench.route_bench import RouteBenchConfig
from backend.bench.route_sim import SharedDisk, SimJob, SimulatedCaches, SimWorker
from backend.blobs import BlobStore
from backend.cache import MemoryTemplateCache, TieredActivationCache
from backend.worker.channels import LocalInbox, LocalSink
from backend.worker.loop import EngineWorker
from tests.factories import (
    STEPS,
    make_engine,
    make_params,
    make_prepared_job,
    make_template,
    rect_mask,
)

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
ITERATIONS = 40  # more than any scenario needs to finish every job


@dataclass(frozen=True)
class Scenario:
    name: str
    ram_entries: int  # the RAM tier's budget, in entries
    max_batch: int
    on_disk: tuple[int, ...]  # templates recorded on disk before the first iteration
    arrivals: tuple[tuple[int, str, int], ...]  # (iteration, job id, template)
    expected: dict[str, tuple[int, bool]] = field(default_factory=dict)  # job -> (admitted, cached)


S = STEPS
SCENARIOS = [
    Scenario(
        "a row whose read is in flight waits while the batch runs",
        ram_entries=2,
        max_batch=4,
        on_disk=(0, 1),
        arrivals=((0, "a", 0), (2, "b", 1)),
        expected={"a": (1, True), "b": (3, True)},
    ),
    Scenario(
        "a row behind a held row takes the free slot",
        ram_entries=2,
        max_batch=4,
        on_disk=(0,),
        arrivals=((0, "a", 0), (0, "b", 7)),
        expected={"a": (1, True), "b": (0, False)},
    ),
    Scenario(
        "a second row of a template being recorded waits for the commit, then reads it",
        ram_entries=2,
        max_batch=4,
        on_disk=(),
        arrivals=((0, "a", 5), (0, "b", 5)),
        expected={"a": (0, False), "b": (S, True)},
    ),
    Scenario(
        "a row waits while every RAM slot holds an entry in use",
        ram_entries=1,
        max_batch=4,
        on_disk=(0, 1),
        arrivals=((0, "a", 0), (0, "b", 1)),
        expected={"a": (1, True), "b": (S + 2, True)},
    ),
    Scenario(
        "a prefetch on arrival never evicts an entry prefetched for an earlier row",
        ram_entries=2,
        max_batch=1,
        on_disk=(0, 1, 2),
        arrivals=((0, "a", 0), (1, "b", 1), (1, "c", 2)),
        expected={"a": (1, True), "b": (S + 1, True), "c": (2 * S + 2, True)},
    ),
]


def admissions_of_the_simulated_worker(scenario: Scenario) -> dict[str, tuple[int, bool]]:
    cfg = RouteBenchConfig(
        profiles_dir=str(PROFILES),
        num_workers=1,
        max_batch=scenario.max_batch,
        steps=STEPS,
        ram_templates=scenario.ram_entries,
        noise_cv=0.0,
    )
    disk = SharedDisk({f"tpl{t}" for t in scenario.on_disk})
    caches = SimulatedCaches(scenario.ram_entries, disk, entry_bytes=1000, read_s=0.05)
    worker = SimWorker("w00", cfg, caches)
    jobs: dict[str, SimJob] = {}
    for iteration in range(ITERATIONS):
        now = float(iteration)
        for index, (at, job_id, template) in enumerate(scenario.arrivals):
            if at == iteration:
                jobs[job_id] = SimJob(index, f"tpl{template}", 0.1, now)
                worker.receive(jobs[job_id], now)
        if worker.start_step(now):
            worker.finish_step(now + 0.5)  # a step: its commits' reads land before the next one
    assert worker.scheduler.idle, "the simulated worker did not finish every job"
    return {job_id: (int(job.admitted_at), job.cached) for job_id, job in jobs.items()}


@pytest.fixture(scope="module")
def engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("scenario-cache"))


class ReadsBetweenIterations:
    """Holds every disk -> RAM read of the tiered cache until ``land`` lets the pending ones run
    (the real read, delayed): a read started in an iteration lands before the next one."""

    def __init__(self, caches: TieredActivationCache, monkeypatch):
        self.caches, self.open = caches, threading.Event()
        load = MemoryTemplateCache.load

        def held_load(path, pin_memory=False):
            assert self.open.wait(10)
            return load(path, pin_memory)

        monkeypatch.setattr(MemoryTemplateCache, "load", staticmethod(held_load))

    def land(self) -> None:
        self.open.set()
        self.caches.wait_for_loads(10)
        self.open.clear()


def admissions_of_the_real_worker(scenario, engine, tmp_path, monkeypatch):
    params = make_params(engine, steps=STEPS)
    engine.cache_root = tmp_path / "sizing"  # every entry of these params has the same size
    entry_bytes = engine.prepare_template(make_template(seed=99), params).bytes_total
    engine.cache_root = tmp_path / "cache"
    for template in scenario.on_disk:
        engine.prepare_template(make_template(seed=40 + template), params)
    blobs, inbox, sink = BlobStore(tmp_path / "blobs"), LocalInbox(), LocalSink()
    ram_budget = int((scenario.ram_entries + 0.5) * entry_bytes)
    caches = TieredActivationCache(engine.cache_root, ram_budget, 1 << 40)
    reads = ReadsBetweenIterations(caches, monkeypatch)
    worker = EngineWorker(engine, blobs, inbox, sink, max_batch=scenario.max_batch, caches=caches)
    admitted: dict[str, int] = {}
    try:
        for iteration in range(ITERATIONS):
            for at, job_id, template in scenario.arrivals:
                if at == iteration:
                    mask = rect_mask((0, 0, 64, 64))
                    inbox.put(
                        make_prepared_job(
                            engine,
                            blobs,
                            job_id,
                            make_template(seed=40 + template),
                            mask,
                            1,
                            params,
                        )
                    )
            seen = len(sink.events)
            worker.iterate()
            for event in sink.events[seen:]:
                if event.status == "running" and event.step == 0:
                    admitted[event.job_id] = iteration
            reads.land()
            if worker.scheduler.idle and len(admitted) == len(scenario.arrivals):
                break
    finally:
        reads.open.set()
        caches.close()
    cached = {job.job_id: job.used_cache for job in sink.denoised_jobs}
    return {job_id: (admitted[job_id], cached[job_id]) for job_id in admitted}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_simulated_worker_admits_as_the_table_says(scenario):
    assert admissions_of_the_simulated_worker(scenario) == scenario.expected


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_real_worker_admits_as_the_table_says(scenario, engine, tmp_path, monkeypatch):
    assert admissions_of_the_real_worker(scenario, engine, tmp_path, monkeypatch) == (
        scenario.expected
    )
