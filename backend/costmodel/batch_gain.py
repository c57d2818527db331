"""Whether one more row should join a running batch: the step-cost test behind joining only when
batching pays (pure: seconds in, a yes or no out).

A row that joins a running batch of ``n`` rows lengthens every step the batch runs by
``d = (step with it) - (step without it)``; if it waits instead, it starts once the batch has
ended. For ``n + 1`` rows with equal steps left (``R``), joining sums their finish times to
``(n + 1) R c(n + 1)`` and waiting to ``(n + 1) R c(n) + R c(1)``, where ``c(k)`` is the step time
of ``k`` rows. Joining lowers the sum (the mean latency) exactly when

    (n + 1) d < c(1):

the time the row adds to every row's step, its own included, is less than its own step alone.
For a single running row the test is the same whatever the two rows' steps left, as long as the
joining row has at least as many (a fresh row joining a batch under way): ``c(2) < 1.5 c(1)``.

On a device whose step barely grows with its rows (a GPU running these models is bound by
launching kernels), ``d`` is near 0 and rows always join. On a CPU, where a step of two rows costs
about two steps of one, ``d`` is about ``c(1)`` and a row waits: the rows run one after another,
which for the same arithmetic finishes the first sooner and none later.

Invariants: an empty batch always takes the row; a step that does not grow (``d <= 0``) always
takes it; the answer depends on the rows' costs only, not on their steps left.
"""

from __future__ import annotations


def joining_pays(batch_s: float, joined_s: float, alone_s: float, batch_rows: int) -> bool:
    """Whether a row whose step alone costs ``alone_s`` should join a running batch of
    ``batch_rows`` rows stepping in ``batch_s`` seconds, whose step with it costs ``joined_s``
    (module docstring)."""
    if batch_rows < 0:
        raise ValueError(f"batch_rows must be >= 0, got {batch_rows}")
    if batch_rows == 0:
        return True
    return (batch_rows + 1) * (joined_s - batch_s) < alone_s
