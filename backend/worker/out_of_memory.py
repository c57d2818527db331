"""Device out-of-memory in a step, the pure rules (no torch, no I/O): how a forward that ran out
of memory is retried, when a row fails, how far a shape's batch is capped afterwards, and who is
asked to give memory back. The engine worker (``backend.worker.loop.EngineWorker``) only reacts.

* Retry: a forward of n rows that ran out of memory is run again as two halves (``halves``: the
  first has ceil(n/2) rows), each retried the same way, after memory was given back: the
  ``MemoryReleasers`` in their order, then the device allocator's cached blocks. So rows that fit
  still advance in this step. A lone row is run again once when that release freed something;
  a lone row that runs out of memory otherwise fails, with ``oom_reason`` (``after_oom``).
* A retry runs a step again: it is safe only while the failed call left every row's state as it
  was. A row whose step count or recording moved in a failed call is failed with the rows of its
  forward, never stepped twice.
* Cap (``BatchCaps``): after a step in which a forward of a shape (the rows' group key: cache
  mode and resolution) ran out of memory, that shape's cap is the largest forward of it that
  succeeded in that step, at least 1. A shape's rows run in forwards of at most its cap, and the
  scheduler admits no row of the shape while as many of its rows run as its cap (running rows
  stay: they step in several forwards). Every ``recover_steps`` steps of the shape in a row
  without running out of memory raise the cap by one; a cap that reaches ``max_batch`` is lifted.
  Caps never rise above ``max_batch`` and never fall below 1.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# steps of a shape without running out of memory before its cap rises by one: slow, so that a
# worker near its memory's edge runs out again at most once every this many steps
RECOVER_STEPS = 50
# what a release asks for when the error does not say what the allocator tried to get: all
EVERY_BYTE = 1 << 62
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")

# gives back up to ``nbytes`` of device memory, returns the bytes it freed (an object's
# ``release``, the template cache's ``release_device_bytes``)
Releaser = Callable[[int], int]


def halves(rows: Sequence[T]) -> tuple[list[T], list[T]]:
    """``rows`` in two, the first half the larger by at most one."""
    middle = (len(rows) + 1) // 2
    return list(rows[:middle]), list(rows[middle:])


OomAction = Literal["split", "retry", "fail"]


def after_oom(rows: int, freed_bytes: int, retried_alone: bool) -> OomAction:
    """What follows a forward of ``rows`` rows that ran out of memory, once ``freed_bytes`` were
    given back: several rows split in halves; a lone row runs again once if memory was freed
    (``retried_alone``: it already did), else fails."""
    if rows > 1:
        return "split"
    return "retry" if freed_bytes > 0 and not retried_alone else "fail"


def bytes_wanted(error_message: str) -> int:
    """The bytes to ask the releasers for: what the allocator tried to get, as the error says
    ("Tried to allocate 2.00 GiB"), else ``EVERY_BYTE``. Each retry that runs out again asks
    again, so asking for only the failed allocation converges while keeping the rest cached."""
    match = _TRIED.search(error_message)
    if match is None:
        return EVERY_BYTE
    return max(1, int(float(match.group(1)) * _UNITS[match.group(2)]))


def oom_reason(height: int, width: int, num_steps: int) -> str:
    """A row's user-facing reason when it failed for running out of device memory."""
    return (
        f"the GPU ran out of memory for this edit ({width}x{height} px, {num_steps} steps): try "
        "a smaller image or fewer variations at once"
    )


class MemoryReleasers:
    """Who gives device memory back when a step runs out of it, asked in registration order, each
    for what is still wanted, until that much is freed. A releaser that raises is logged and
    skipped: giving memory back must never take the worker down."""

    def __init__(self) -> None:
        self._releasers: list[Releaser] = []

    def register(self, releaser: Releaser) -> None:
        self._releasers.append(releaser)

    def release(self, nbytes: int) -> int:
        """Ask the releasers for ``nbytes`` in all; the bytes they freed."""
        freed = 0
        for releaser in self._releasers:
            if freed >= nbytes:
                break
            try:
                freed += max(0, int(releaser(nbytes - freed)))
            except Exception:
                log.exception("a memory releaser failed: the next one is asked")
        return freed


@dataclass
class StepOutcome:
    """How the forwards of one shape went in one step: the largest that succeeded (rows) and
    whether any ran out of memory."""

    largest_ok: int = 0
    ran_out: bool = False

    def succeeded(self, rows: int) -> None:
        self.largest_ok = max(self.largest_ok, rows)


@dataclass
class ShapeCap:
    rows: int  # the most rows of the shape in one forward, and running at admission
    clean_steps: int = 0  # steps of the shape since the cap last moved, none out of memory


@dataclass
class BatchCaps:
    """Each shape's batch cap after running out of memory (module docstring). Shapes absent from
    ``caps`` run up to ``max_batch`` rows."""

    max_batch: int
    recover_steps: int = RECOVER_STEPS
    caps: dict[str, ShapeCap] = field(default_factory=dict)

    def limit(self, shape: str) -> int:
        cap = self.caps.get(shape)
        return self.max_batch if cap is None else cap.rows

    def split(self, shape: str, rows: Sequence[T]) -> list[list[T]]:
        """``rows`` of ``shape`` as the forwards that run them: consecutive runs of at most its
        cap (one forward when uncapped)."""
        size = self.limit(shape)
        return [list(rows[start : start + size]) for start in range(0, len(rows), size)]

    def after_step(self, shape: str, outcome: StepOutcome) -> None:
        """Lower the shape's cap to the largest forward that succeeded when one ran out of memory;
        else count a clean step towards raising it."""
        if outcome.ran_out:
            self.caps[shape] = ShapeCap(max(1, min(outcome.largest_ok, self.limit(shape))))
            return
        cap = self.caps.get(shape)
        if cap is None:
            return
        cap.clean_steps += 1
        if cap.clean_steps >= self.recover_steps:
            cap.rows, cap.clean_steps = cap.rows + 1, 0
            if cap.rows >= self.max_batch:
                del self.caps[shape]

    def in_force(self) -> dict[str, int]:
        """Shape -> its cap, for the shapes capped now."""
        return {shape: cap.rows for shape, cap in self.caps.items()}

    def lowest(self) -> int:
        """The lowest cap in force (``max_batch`` when none is)."""
        return min((cap.rows for cap in self.caps.values()), default=self.max_batch)
