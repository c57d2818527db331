"""The engine worker when a step runs out of device memory, on the tiny sd2 model on the CPU: the
engine's step raises ``torch.OutOfMemoryError`` for forwards of more than K rows. The worker lives;
with K >= 1 every row finishes with the result of a run without the fault (batched == one at a
time); with K = 0 the rows fail with a reason users can act on (a recording's writer aborted) and
later jobs run; the shape's cap falls and rises again; the metrics count it all."""

from __future__ import annotations

import pytest
import torch

from tests.factories import make_engine, make_params, make_prepared_job, make_template, rect_mask
from tests.test_worker import TOL, final_latents, make_worker, run_until_idle

STEPS = 3
SHAPE = "kv:128x128"
ERROR = "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 79 GiB"
JOBS = (
    (7, (32, 40, 96, 80), 1),
    (11, (8, 8, 56, 40), 2),
    (7, (64, 64, 120, 120), 3),
    (11, (0, 0, 64, 64), 4),
)


@pytest.fixture(scope="module")
def engine(models_dir, tmp_path_factory):
    return make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("oom-cache"))


class OutOfMemoryAbove:
    """The engine's step, raising ``torch.OutOfMemoryError`` for more than ``limit`` rows (before
    the forward, as the allocator does); ``calls``: the rows of every call."""

    def __init__(self, engine, limit: int):
        self.step, self.limit, self.calls = engine.step, limit, []

    def __call__(self, states, mode, **kwargs):
        self.calls.append(len(states))
        if len(states) > self.limit:
            raise torch.OutOfMemoryError(ERROR)
        return self.step(states, mode, **kwargs)


def put_jobs(engine, inbox, blobs, jobs=JOBS, prefix="j"):
    params = make_params(engine, steps=STEPS)
    for index, (template, box, seed) in enumerate(jobs):
        inbox.put(
            make_prepared_job(
                engine,
                blobs,
                f"{prefix}{index}",
                make_template(template),
                rect_mask(box),
                seed,
                params,
            )
        )


def run_jobs(engine, tmp_path, fault=None, monkeypatch=None):
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, with_cache=False)
    if fault is not None:
        monkeypatch.setattr(engine, "step", fault)
    put_jobs(engine, inbox, blobs)
    run_until_idle(worker)
    return worker, sink, blobs


# (K, the cap after the first step: the largest half of the four rows that fitted)
@pytest.mark.parametrize("limit, cap", [(1, 1), (2, 2), (3, 2)])
def test_rows_that_fit_still_advance_and_end_as_without_the_fault(
    engine, tmp_path, monkeypatch, limit, cap
):
    _, clean_sink, clean_blobs = run_jobs(engine, tmp_path / "clean")
    fault = OutOfMemoryAbove(engine, limit)
    worker, sink, blobs = run_jobs(engine, tmp_path / "fault", fault, monkeypatch)

    assert [e for e in sink.events if e.status == "failed"] == []
    assert sorted(j.job_id for j in sink.denoised_jobs) == [f"j{i}" for i in range(len(JOBS))]
    for job in sink.denoised_jobs:
        difference = final_latents(blobs, sink, job.job_id) - final_latents(
            clean_blobs, clean_sink, job.job_id
        )
        assert difference.abs().max().item() <= TOL
    # the first step ran out of memory: the four rows were retried in halves (and halves of
    # those while they did not fit), then every forward kept within the cap
    stats = worker.stats.snapshot()
    assert stats["oom_failed_rows_total"] == 0 and stats["oom_errors_total"] >= 1
    assert stats["oom_errors_total"] == sum(1 for rows in fault.calls if rows > limit)
    assert stats["oom_retried_rows_total"] == sum(rows for rows in fault.calls if rows > limit)
    assert stats["batch_cap"] == cap and worker.batch_caps.in_force() == {SHAPE: cap}
    later = (STEPS - 1) * (len(JOBS) // cap)  # the later steps' forwards, each of the cap's rows
    assert fault.calls[0] == len(JOBS) and fault.calls[-later:] == [cap] * later


def test_a_row_that_does_not_fit_alone_fails_with_the_reason_and_later_jobs_run(
    engine, tmp_path, monkeypatch
):
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, with_cache=False)
    fault = OutOfMemoryAbove(engine, 0)
    monkeypatch.setattr(engine, "step", fault)
    put_jobs(engine, inbox, blobs, JOBS[:2])
    run_until_idle(worker)

    failed = [e for e in sink.events if e.status == "failed"]
    assert sorted(e.job_id for e in failed) == ["j0", "j1"]
    for event in failed:
        assert "ran out of memory" in event.message and "128x128 px" in event.message
        assert f"{STEPS} steps" in event.message and "smaller image" in event.message
    assert fault.calls == [2, 1, 1]  # nothing was given back: a lone row is not run again
    assert sorted(inbox.acked) == ["j0", "j1"]
    stats = worker.stats.snapshot()
    assert (
        stats["oom_errors_total"],
        stats["oom_retried_rows_total"],
        stats["oom_failed_rows_total"],
    ) == (3, 2, 2)
    assert stats["jobs"] == {"failed": 2}

    fault.limit = len(JOBS)  # the memory is back: the same worker serves the next job
    put_jobs(engine, inbox, blobs, JOBS[2:3], prefix="later")
    run_until_idle(worker)
    assert [j.job_id for j in sink.denoised_jobs] == ["later0"]


def test_memory_is_asked_back_in_order_and_a_lone_row_runs_again_once_it_was(
    engine, tmp_path, monkeypatch
):
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, with_cache=False)
    asked: list[tuple[str, int]] = []

    def releaser(name: str, freed: int):
        def release(nbytes: int) -> int:
            asked.append((name, nbytes))
            return freed

        return release

    worker.memory.register(releaser("graphs", 1 << 20))
    worker.memory.register(releaser("device tier", 1 << 20))
    fault = OutOfMemoryAbove(engine, 0)
    monkeypatch.setattr(engine, "step", fault)
    put_jobs(engine, inbox, blobs, JOBS[:1])
    run_until_idle(worker)

    assert sink.statuses("j0")[-1] == "failed"
    assert fault.calls == [1, 1]  # run again once after memory was given back, then failed
    assert asked == [("graphs", 2 << 20), ("device tier", 1 << 20)] * 2
    assert worker.stats.snapshot()["oom_retried_rows_total"] == 1


def test_the_cap_holds_new_rows_of_the_shape_and_rises_again_after_clean_steps(
    engine, tmp_path, monkeypatch
):
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, with_cache=False)
    worker.batch_caps.recover_steps = 2
    fault = OutOfMemoryAbove(engine, 1)
    monkeypatch.setattr(engine, "step", fault)
    params = make_params(engine, steps=6)
    for job_id, seed in (("a", 1), ("b", 2)):
        inbox.put(
            make_prepared_job(
                engine, blobs, job_id, make_template(7), rect_mask((0, 0, 64, 64)), seed, params
            )
        )
    worker.iterate()  # both rows join; two rows run out of memory, one alone fits
    assert worker.batch_caps.in_force() == {SHAPE: 1} and fault.calls == [2, 1, 1]
    inbox.put(
        make_prepared_job(
            engine, blobs, "c", make_template(11), rect_mask((0, 0, 64, 64)), 3, params
        )
    )
    caps = []
    for _ in range(4):
        worker.iterate()
        caps.append(worker.batch_caps.limit(SHAPE))
        assert "c" not in worker.scheduler.running  # two rows of its shape run, its cap is 1
    # two clean steps of one row a forward raise the cap to 2; two rows run out of memory again
    assert caps == [1, 2, 1, 1] and fault.calls[3:] == [1, 1, 1, 1, 2, 1, 1, 1, 1]
    run_until_idle(worker)
    assert sorted(j.job_id for j in sink.denoised_jobs) == ["a", "b", "c"]


def test_a_recording_that_runs_out_of_memory_is_aborted_and_recorded_again_later(
    engine, tmp_path, monkeypatch
):
    engine.cache_root = tmp_path / "cache"
    worker, inbox, sink, blobs = make_worker(engine, tmp_path)
    params = make_params(engine, steps=STEPS)
    template, box = make_template(seed=23), rect_mask((0, 0, 64, 64))
    fault = OutOfMemoryAbove(engine, 0)
    monkeypatch.setattr(engine, "step", fault)
    inbox.put(make_prepared_job(engine, blobs, "records", template, box, 1, params))
    run_until_idle(worker)
    assert sink.statuses("records")[-1] == "failed" and worker.jobs == {}
    assert engine.lookup(template, params) is None  # the writer was aborted, nothing half-written

    fault.limit = 8
    for job_id, seed in (("records-again", 2), ("reads", 3)):
        inbox.put(make_prepared_job(engine, blobs, job_id, template, box, seed, params))
        run_until_idle(worker)
    assert [(j.job_id, j.used_cache) for j in sink.denoised_jobs] == [
        ("records-again", False),
        ("reads", True),
    ]


def test_rows_whose_state_moved_before_running_out_are_failed_not_stepped_twice(
    engine, tmp_path, monkeypatch
):
    worker, inbox, sink, blobs = make_worker(engine, tmp_path, with_cache=False)
    calls = []
    real_step = engine.step

    def runs_out_after_stepping(states, mode, **kwargs):
        calls.append(len(states))
        real_step(states, mode, **kwargs)
        raise torch.OutOfMemoryError(ERROR)

    monkeypatch.setattr(engine, "step", runs_out_after_stepping)
    put_jobs(engine, inbox, blobs, JOBS[:2])
    run_until_idle(worker)
    assert calls == [2]
    assert sorted(e.job_id for e in sink.events if e.status == "failed") == ["j0", "j1"]
    stats = worker.stats.snapshot()
    assert (stats["oom_retried_rows_total"], stats["oom_failed_rows_total"]) == (0, 2)
