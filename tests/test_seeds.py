"""``--seeds`` as users write it, and seeds as plots name them (``backend.bench.seeds``)."""

from __future__ import annotations

import pytest

from backend.bench.seeds import parse_seeds, seed_span


@pytest.mark.parametrize(
    ("text", "seeds"),
    [
        ("", [7]),
        ("3", [3]),
        ("0,1,2", [0, 1, 2]),
        ("3-12", list(range(3, 13))),
        ("0, 5-7 ,9", [0, 5, 6, 7, 9]),
        ("4-4", [4]),
        ("2,0,1", [2, 0, 1]),
    ],
)
def test_seeds_are_integers_and_inclusive_ranges_in_the_order_written(text, seeds):
    assert parse_seeds(text, default=7) == seeds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,x", "takes integers and ranges, e.g. 0,1,2 or 3-12; got '0,x'"),
        ("1-", "takes integers and ranges"),
        ("0,,1", "takes integers and ranges"),
        ("-2", "takes integers and ranges"),
        ("12-3", "range '12-3' runs backwards: write 3-12"),
        ("1,1", "repeats a seed"),
        ("0-3,2", "repeats a seed"),
    ],
)
def test_anything_else_is_refused_saying_what_to_write(text, message):
    with pytest.raises(ValueError, match="--seeds") as err:
        parse_seeds(text, default=0)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("seeds", "span"),
    [
        ([3, 4, 5, 6], "3-6"),
        ([0, 1], "0, 1"),
        ([0, 2, 5], "0, 2, 5"),
        ([4], "4"),
        ([2, 1, 0], "2, 1, 0"),
    ],
)
def test_a_run_of_consecutive_seeds_is_shown_as_a_range(seeds, span):
    assert seed_span(seeds) == span
