"""Batch affinity (``backend.dispatch.groups``) and the router's use of it: a batch's items go to
its first worker while that worker has room, then spill; pure, milliseconds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backend.dispatch.groups import BatchAffinity
from backend.dispatch.policies import ROUTING_POLICIES
from backend.dispatch.router import AFFINITY, JobRequest, RowState, load_cost_models
from tests.test_router import MODEL, PROFILES, router, worker


@pytest.fixture(scope="module")
def cost_model():
    return load_cost_models(PROFILES)[(MODEL, "cpu")]


def item(n: int, batch_id: str = "b1", template: str = "t0") -> JobRequest:
    return JobRequest(f"{batch_id}-{n}", MODEL, 0.1, 20, template, now=100.0, batch_id=batch_id)


def route(r, jobs, workers) -> list[str]:
    """Route ``jobs`` in order, counting each on its worker's view as the dispatcher does."""
    views, chosen = {w.worker_id: w for w in workers}, []
    for job in jobs:
        decision = r.choose(job, list(views.values()))
        view = views[decision.worker_id]
        row = RowState(job.job_id, job.mask_ratio, job.num_steps, job.template)
        views[decision.worker_id] = replace(view, waiting=view.waiting + (row,))
        chosen.append(decision.worker_id)
    return chosen


def test_home_is_the_first_worker_routed_to_while_it_is_a_candidate():
    affinity = BatchAffinity()
    assert affinity.home("b1", ["w0", "w1"], 0.0) is None
    affinity.routed("b1", "w1", 0.0)
    assert affinity.home("b1", ["w0", "w1"], 1.0) == "w1"
    assert affinity.home("b1", ["w0"], 1.0) is None  # full or gone: the policy chooses
    affinity.routed("b1", "w0", 1.0)  # the spill becomes the second home
    assert affinity.homes("b1") == ("w1", "w0")
    assert affinity.home("b1", ["w0", "w1"], 2.0) == "w1"  # the first home first
    assert affinity.home("b2", ["w0", "w1"], 2.0) is None


def test_jobs_in_no_batch_are_never_remembered():
    affinity = BatchAffinity()
    affinity.routed("", "w0", 0.0)
    assert affinity.home("", ["w0"], 0.0) is None and affinity.homes("") == ()


def test_batches_are_forgotten_after_their_ttl_and_beyond_the_bound():
    affinity = BatchAffinity(ttl_s=10.0, max_batches=2)
    affinity.routed("old", "w0", 0.0)
    affinity.routed("b1", "w0", 5.0)
    assert affinity.home("old", ["w0"], 9.0) == "w0"
    assert affinity.home("old", ["w0"], 10.0) is None  # 10 s after its latest item
    assert affinity.home("b1", ["w0"], 10.0) == "w0"
    affinity.routed("b2", "w1", 11.0)
    affinity.routed("b3", "w1", 12.0)  # a third batch: the least recently used goes
    assert affinity.homes("b1") == () and affinity.homes("b3") == ("w1",)
    with pytest.raises(ValueError):
        BatchAffinity(ttl_s=0)


@pytest.mark.parametrize("policy", sorted(ROUTING_POLICIES))
def test_every_policy_keeps_a_batch_on_one_worker_while_it_has_room(policy, cost_model):
    r = router(policy, cost_model)
    workers = [worker("w0", max_batch=4), worker("w1", max_batch=4), worker("w2", max_batch=4)]
    chosen = route(r, [item(n) for n in range(4)], workers)
    assert len(set(chosen)) == 1, chosen  # four slots: all four items on one worker


@pytest.mark.parametrize("policy", sorted(ROUTING_POLICIES))
def test_a_batch_spills_to_the_next_worker_only_when_its_worker_is_full(policy, cost_model):
    r = router(policy, cost_model)
    workers = [worker("w0", max_batch=3), worker("w1", max_batch=3)]
    chosen = route(r, [item(n) for n in range(5)], workers)
    first = chosen[0]
    assert chosen[:3] == [first] * 3 and first not in chosen[3:]
    assert len(set(chosen[3:])) == 1  # the spill is one worker too


def test_the_decision_names_the_affinity_and_other_jobs_are_routed_as_before():
    r = router("round_robin")
    workers = [worker("w0"), worker("w1")]
    first, second = r.choose(item(0), workers), r.choose(item(1), workers)
    assert second.worker_id == first.worker_id and second.policy == AFFINITY
    assert "its batch's worker" in second.reason
    # jobs in no batch still go round the workers
    plain = [r.choose(replace(item(n), batch_id=""), workers).worker_id for n in range(2)]
    assert sorted(plain) == ["w0", "w1"]


def test_a_batch_whose_worker_serves_another_model_is_routed_by_the_policy():
    r = router("fewest_requests")
    assert r.choose(item(0), [worker("w0")]).worker_id == "w0"
    moved = [worker("w0", model="other-model"), worker("w1")]
    assert r.choose(item(1), moved).worker_id == "w1"
