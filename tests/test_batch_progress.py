"""Batch bookkeeping, pure: how masks and prompts pair into items, and a batch's progress and status
from its items' events (``backend.api.batch_items``, ``backend.api.batch_progress``)."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from backend.api.batch_items import PairingError, pair_items
from backend.api.batch_progress import (
    BATCH_STATES,
    BatchTracker,
    ItemProgress,
    batch_status,
    summary,
)
from backend.protocol import JOB_STATES


@pytest.mark.parametrize(
    "masks, prompts, shared, items",
    [
        (3, 0, False, [(0, None), (1, None), (2, None)]),
        (0, 2, True, [(None, 0), (None, 1)]),
        (1, 3, False, [(0, 0), (0, 1), (0, 2)]),
        (3, 1, False, [(0, 0), (1, 0), (2, 0)]),
        (2, 2, False, [(0, 0), (1, 1)]),
        (1, 1, False, [(0, 0)]),
    ],
)
def test_masks_and_prompts_pair_into_items(masks, prompts, shared, items):
    assert pair_items(masks, prompts, shared) == items


@pytest.mark.parametrize(
    "masks, prompts, shared, said",
    [
        (2, 3, False, "2 masks and 3 prompts cannot be paired"),
        (0, 0, True, "needs masks"),
        (0, 2, False, "no mask"),
        (-1, 0, False, "negative"),
    ],
)
def test_counts_that_cannot_pair_say_why(masks, prompts, shared, said):
    with pytest.raises(PairingError, match=said):
        pair_items(masks, prompts, shared)


def test_an_items_progress_follows_its_steps_and_a_finished_item_stays_finished():
    item = ItemProgress(0, "j0")
    assert item.progress == 0.0 and not item.finished
    running = item.after({"status": "running", "step": 3, "num_steps": 4})
    assert running.progress == 0.75
    post = running.after({"status": "postprocessing"})
    assert post.step == 3 and post.progress == 0.0  # denoised: no step count to show
    failed = post.after({"status": "failed", "message": "boom"})
    assert failed.finished and failed.progress == 1.0 and failed.message == "boom"
    assert failed.after({"status": "done"}) == failed  # the first terminal status is final
    requeued = running.after({"status": "waiting", "message": "worker stopped"})
    assert requeued.step == 0 and requeued.progress == 0.0


@pytest.mark.parametrize(
    "statuses, status",
    [
        ([], "queued"),
        (["queued", "queued"], "queued"),
        (["queued", "preprocessing"], "running"),
        (["done", "queued"], "running"),
        (["done", "done"], "done"),
        (["done", "failed"], "partial"),
        (["done", "expired"], "partial"),
        (["failed", "cancelled"], "failed"),
        (["cancelled", "expired"], "cancelled"),
    ],
)
def test_the_batch_status_from_its_items(statuses, status):
    assert batch_status(statuses) == status


def test_a_tracker_changes_only_the_item_an_event_names():
    tracker = BatchTracker([ItemProgress(i, f"j{i}") for i in range(3)])
    assert tracker.apply("other", {"status": "done"}) is None
    changed = tracker.apply("j1", {"status": "running", "step": 1, "num_steps": 2})
    assert changed.index == 1 and [item.status for item in tracker.items] == [
        "queued",
        "running",
        "queued",
    ]
    assert tracker.index("j2") == 2 and not tracker.finished
    assert tracker.summary()["progress"] == pytest.approx(0.5 / 3, abs=1e-4)


EVENTS = st.tuples(
    st.integers(0, 3),
    st.sampled_from(JOB_STATES),
    st.integers(0, 8),
    st.integers(0, 8),
)


@given(st.lists(EVENTS, max_size=40))
@example([(i, "running", 8, 8) for i in range(4)])  # every item at its last step: not finished
def test_progress_stays_in_bounds_and_is_whole_exactly_when_every_item_finished(events):
    tracker = BatchTracker([ItemProgress(i, f"j{i}") for i in range(4)])
    for index, status, step, num_steps in events:
        tracker.apply(f"j{index}", {"status": status, "step": step, "num_steps": num_steps})
        shown = summary(tracker.items)
        assert 0.0 <= shown["progress"] <= 1.0 and shown["status"] in BATCH_STATES
        assert (shown["progress"] == 1.0) == tracker.finished == (shown["finished"] == 4)
        assert sum(shown["counts"].values()) == 4
