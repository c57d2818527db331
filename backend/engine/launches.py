"""Operators a call launches, counted on the CPU with ``torch.profiler``.

On a device bound by launching operators a step costs about one host dispatch per operator that
does work. Counted: the outermost aten operators of the call (an operator's own sub-operators are
its implementation, dispatched by it), except those that only make views or metadata, and those
that may copy but did not (``reshape`` of a contiguous tensor, ``to`` its own dtype, ``contiguous``
of a contiguous tensor): such an operator counts only when something under it did work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

# operators that make a view or read metadata, launching nothing
VIEWS = frozenset(
    f"aten::{name}"
    for name in (
        "alias",
        "as_strided",
        "chunk",
        "detach",
        "empty",
        "expand",
        "flatten",
        "lift_fresh",
        "narrow",
        "permute",
        "result_type",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unflatten",
        "unsqueeze",
        "view",
        "view_as_complex",
        "view_as_real",
        "_unsafe_view",
        "_reshape_alias",
        "dropout",  # in inference, the identity
    )
)
# operators that copy only when they must: counted when an operator under them did work
MAY_COPY = frozenset(f"aten::{name}" for name in ("reshape", "contiguous", "to", "type_as"))


def _does_work(event) -> bool:
    if event.name in VIEWS:
        return False
    if event.name in MAY_COPY:
        return any(_does_work(child) for child in event.cpu_children)
    return True


def launched_operators(run: Callable[[], object]) -> Counter[str]:
    """The operators one call of ``run`` launches, by name."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    outermost = [
        event
        for event in prof.events()
        if event.name.startswith("aten::")
        and not (event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::"))
    ]
    return Counter(event.name for event in outermost if _does_work(event))


def count_launches(run: Callable[[], object]) -> int:
    """How many operators one call of ``run`` launches."""
    return sum(launched_operators(run).values())
