"""A measured machine's step shape (``backend.bench.step_shape``): read off a worker bench's report,
given as factors, refused when it is not a shape; and the route simulation pricing steps by it."""

from __future__ import annotations

import json
import math

import pytest

from backend.bench.step_shape import checked, load_shape, measured_shape, shape_factor


def run(shape: dict[int, float], scale: float = 2.0) -> dict:
    """One ``bench worker-deadlines`` result as the report keeps it (the clock's end state)."""
    return {"clock_scale_end": scale, "clock_shape_end": {str(n): f for n, f in shape.items()}}


def test_a_shape_factor_is_its_row_count_s_and_the_last_one_beyond():
    assert shape_factor((), 5) == 1.0  # no shape: the profile itself
    assert shape_factor((1.0, 1.2, 1.5), 2) == 1.2
    assert shape_factor((1.0, 1.2, 1.5), 3) == 1.5
    assert shape_factor((1.0, 1.2, 1.5), 8) == 1.5


def test_the_measured_shape_is_each_run_s_growth_over_its_one_row_median_over_runs():
    report = {
        "results": [
            run({1: 0.8, 2: 0.96, 4: 1.2}, scale=3.0),  # growth 1.2 at 2 rows, 1.5 at 4
            run({1: 1.0, 2: 1.4, 4: 1.7}, scale=0.5),  # 1.4 and 1.7: the scale cancels
            run({1: 1.0, 2: 1.1, 4: 1.3}),  # 1.1 and 1.3
            {"clock_scale_end": 1.0, "clock_shape_end": {}},  # fifo learns nothing: left out
        ]
    }
    shape = measured_shape(report)
    # 3 rows: no run learnt it, so it takes the count below's
    assert shape == pytest.approx((1.0, 1.2, 1.2, 1.5))


def test_a_report_without_a_clock_or_a_one_row_reference_is_refused():
    with pytest.raises(ValueError, match="bench worker-deadlines"):
        measured_shape({"results": [{"clock_shape_end": {}}]})
    with pytest.raises(ValueError, match="one row"):
        measured_shape({"results": [run({2: 1.0, 3: 1.2})]})


@pytest.mark.parametrize("bad", [(1.0, 0.0), (1.0, -1.2), (math.nan,), (1.0, math.inf)])
def test_factors_that_are_not_positive_numbers_are_refused_naming_the_row_count(bad):
    rows = next(i for i, f in enumerate(bad, start=1) if not (math.isfinite(f) and f > 0))
    with pytest.raises(ValueError, match=f"factor of {rows} rows must be positive"):
        checked(bad)


def test_the_option_takes_a_report_or_factors_and_says_what_to_give(tmp_path):
    assert load_shape("") == ()
    assert load_shape("1,1.25,1.5") == (1.0, 1.25, 1.5)
    path = tmp_path / "worker.json"
    path.write_text(json.dumps({"results": [run({1: 1.0, 2: 1.3})]}))
    assert load_shape(str(path)) == pytest.approx((1.0, 1.3))
    with pytest.raises(ValueError, match="factors like 1,1.1,1.2"):
        load_shape("1,fast")
    with pytest.raises(ValueError, match="cannot read a JSON report"):
        load_shape(str(tmp_path / "missing.json"))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read a JSON report"):
        load_shape(str(path))
    for other in ([1, 2], {"results": [{"clock_shape_end": {"1": 0.0, "2": 1.0}}]}):
        path.write_text(json.dumps(other))  # a list; a clock with a zero shape
        with pytest.raises(ValueError, match="not a `bench worker-deadlines` report"):
            load_shape(str(path))


def test_the_command_refuses_a_bad_shape_with_a_message(tmp_path, capsys):
    from backend.cli import main

    code = main(["bench", "route-deadlines", "--step-shape", "1,0", "--json", str(tmp_path / "x")])
    assert code != 0
    assert "factor of 2 rows must be positive" in capsys.readouterr().err
