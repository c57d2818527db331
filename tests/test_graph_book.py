"""The graph book's rule (pure): which step graphs the engine may compile, within a count and
a byte bound, and what it reports."""

from __future__ import annotations

import pytest

from backend.engine.graph_book import GraphBook


def test_signatures_are_admitted_while_there_is_room():
    book = GraphBook(max_shapes=2)
    assert book.admits("a") and book.admits("b") and book.admits("a")
    assert not book.admits("c")  # full: it runs eagerly
    assert book.refused == 1 and set(book.shapes) == {"a", "b"}


def test_the_byte_bound_stops_new_signatures_not_known_ones():
    book = GraphBook(max_bytes=100)
    assert book.admits("a")
    book.record_bytes("a", 60)
    assert book.admits("b")  # 60 < 100: room
    book.record_bytes("b", 50)
    assert not book.admits("c") and book.admits("a") and book.admits("b")
    assert book.snapshot() == {
        "compiled_graphs": 2,
        "uncompilable_step_shapes": 0,
        "compiled_graph_bytes": 110,
        "uncompiled_steps_total": 1,
    }


def test_clearing_gives_back_what_was_recorded_and_admits_afresh():
    book = GraphBook(max_shapes=1)
    book.admits("a")
    book.record_bytes("a", 7)
    book.record_bytes("unknown", 5)  # never admitted: not held
    assert book.clear() == 7 and book.shapes == {}
    assert book.admits("b")


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="0 or more"):
        GraphBook(max_shapes=-1)


def test_a_signature_that_failed_to_compile_is_never_admitted_again():
    book = GraphBook()
    assert book.admits("a")
    book.fail("a")
    assert "a" not in book.shapes and not book.admits("a") and book.refused == 1
    book.clear()  # graphs released under memory pressure: a failed one still fails
    assert not book.admits("a") and book.admits("b")
    assert book.snapshot()["uncompilable_step_shapes"] == 1
