"""Adapter tiers and late joining as bookkeeping (no torch): budgets, eviction, pins, joins."""

from __future__ import annotations

import pytest

from backend.worker.adapter_book import (
    DEVICE,
    DISK,
    HOST,
    LOADING,
    AdapterBook,
    RowJoins,
    join_deadline,
)

MB = 1 << 20


def loaded_on_device(book: AdapterBook, sha: str, nbytes: int) -> list[str]:
    assert book.start_load(sha)
    book.loaded(sha, nbytes)
    return book.on_device(sha, nbytes)


def test_an_adapter_moves_disk_loading_host_device():
    book = AdapterBook(device_bytes=10 * MB, host_bytes=10 * MB)
    assert book.where("a") == DISK
    assert book.start_load("a") and book.where("a") == LOADING
    assert not book.start_load("a")  # one load at a time
    assert book.loaded("a", MB) == [] and book.where("a") == HOST
    assert book.on_device("a", MB) == [] and book.where("a") == DEVICE
    assert book.counters.disk_loads == 1 and book.counters.disk_bytes == MB
    assert book.counters.device_loads == 1


def test_a_failed_load_goes_back_to_disk():
    book = AdapterBook(MB, MB)
    book.start_load("a")
    book.load_failed("a")
    assert book.where("a") == DISK and book.start_load("a")


def test_device_budget_evicts_unpinned_least_recently_used():
    book = AdapterBook(device_bytes=3 * MB, host_bytes=100 * MB, policy="lru")
    for sha in "abc":
        loaded_on_device(book, sha, MB)
    book.pin("a")
    book.asked("b")  # b used more recently than c
    assert loaded_on_device(book, "d", MB) == ["c"]
    assert book.where("c") == HOST  # tiers are inclusive: the host copy stays
    assert book.counters.evictions[DEVICE] == 1


def test_pinned_adapters_are_never_evicted_even_over_budget():
    book = AdapterBook(device_bytes=2 * MB, host_bytes=100 * MB)
    for sha in "ab":
        loaded_on_device(book, sha, MB)
        book.pin(sha)
    assert loaded_on_device(book, "c", MB) == []
    assert book.device.used == 3 * MB
    book.unpin("a")
    assert set(loaded_on_device(book, "d", MB)) == {"a", "c"}
    assert set(book.device.sizes) == {"b", "d"}


def test_pins_count_rows():
    book = AdapterBook(device_bytes=MB, host_bytes=100 * MB)
    loaded_on_device(book, "a", MB)
    book.pin("a")
    book.pin("a")
    book.unpin("a")
    assert loaded_on_device(book, "b", MB) == []  # one row still runs with a
    book.unpin("a")
    assert set(loaded_on_device(book, "c", MB)) == {"a", "b"}


def test_an_adapter_larger_than_the_budget_is_kept_alone():
    book = AdapterBook(device_bytes=MB, host_bytes=MB)
    loaded_on_device(book, "small", MB // 2)
    assert loaded_on_device(book, "huge", 4 * MB) == ["small"]
    assert book.where("huge") == DEVICE


def test_lfu_keeps_the_popular_head_where_lru_would_evict_it():
    def run(policy: str) -> str:
        book = AdapterBook(device_bytes=2 * MB, host_bytes=100 * MB, policy=policy)
        loaded_on_device(book, "popular", MB)
        for _ in range(10):
            book.asked("popular")
        loaded_on_device(book, "tail1", MB)
        loaded_on_device(book, "tail2", MB)
        return book.where("popular")

    assert run("lfu") == DEVICE
    assert run("lru") == HOST


def test_hits_are_counted_by_tier():
    book = AdapterBook(10 * MB, 10 * MB)
    assert book.asked("a") == DISK
    loaded_on_device(book, "a", MB)
    book.start_load("b")
    assert book.asked("b") == LOADING
    book.loaded("b", MB)
    assert book.asked("b") == HOST
    assert book.asked("a") == DEVICE
    assert book.counters.hits == {DEVICE: 1, HOST: 1, DISK: 2}


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        AdapterBook(MB, MB, policy="random")


@pytest.mark.parametrize(
    ("steps", "share", "deadline"), [(20, 0.2, 4), (3, 0.2, 1), (10, 0.0, 0), (5, 1.0, 5)]
)
def test_join_deadline_rounds_up(steps, share, deadline):
    assert join_deadline(steps, share) == deadline


def test_a_row_joins_what_is_ready_and_waits_only_at_its_deadline():
    row = RowJoins({"a": 1.0, "b": 0.5}, deadline=2)
    assert row.plan(0, on_device=set()) == ([], [])
    ready, waits = row.plan(1, on_device={"a"})
    assert (ready, waits) == (["a"], [])
    row.join(ready, 1)
    assert row.active() == (("a", 1.0),)
    assert row.plan(2, on_device=set()) == ([], ["b"])
    row.join(["b"], 2)
    assert row.joined == {"a": 1, "b": 2} and row.missing() == []
    assert row.active() == (("a", 1.0), ("b", 0.5))


def test_a_joined_adapter_keeps_its_first_step():
    row = RowJoins({"a": 1.0}, deadline=3)
    row.join(["a"], 1)
    row.join(["a"], 2)
    assert row.joined == {"a": 1}
