"""The one Hypothesis configuration of the property suites (tests/test_properties_*.py).

Reproducible: ``derandomize=True`` draws the same examples on every run and machine, and no
example database is read or written, so CI never replays a failure it found on another run.
No deadline: a slow shared machine must not turn a correct run into a failure. ``examples(n)``
sizes each property to its cost, so the whole property suite runs in well under a minute on two
cores.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def examples(count: int) -> settings:
    """Settings for one property: ``count`` examples, derandomized, no database, no deadline."""
    return settings(
        max_examples=count,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
