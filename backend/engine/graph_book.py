"""Which step graphs the engine may compile: its book of them, with a memory bound.

A compiled step keeps a graph per signature (the model's forward, the step's rows and token
buckets, its cache mode and cached units, its inputs' shapes, the compile mode) and, replayed from
CUDA graphs, its memory. The book admits a signature the first time it is seen while those it
holds stay within ``max_shapes`` and their measured bytes below ``max_bytes``; a step whose
signature it does not admit runs eagerly (the same forward functions, nothing compiled for it).
Plain Python, no torch: the engine measures a new graph's bytes and reports them
(``record_bytes``).

A signature whose compilation failed (``fail``) is never admitted again: its steps run eagerly
instead of failing.

Invariants: ``len(shapes) <= max_shapes``; no signature is admitted once the recorded bytes reach
``max_bytes`` (0: no byte bound); a failed signature is never in ``shapes``; ``clear`` (after the
graphs were released under memory pressure) empties ``shapes``, and signatures not failed are
then admitted afresh.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class GraphBook:
    max_shapes: int = 64
    max_bytes: int = 0
    shapes: dict[Hashable, int] = field(default_factory=dict)  # shape -> its recorded bytes
    refused: int = 0  # steps that ran eagerly because their signature was not admitted
    failed: set[Hashable] = field(default_factory=set)  # signatures whose compilation failed

    def __post_init__(self) -> None:
        if self.max_shapes < 0 or self.max_bytes < 0:
            raise ValueError("a graph book's bounds are counts and bytes, 0 or more")

    @property
    def bytes(self) -> int:
        return sum(self.shapes.values())

    def admits(self, shape: Hashable) -> bool:
        """Whether a step of signature ``shape`` runs compiled (a new one is admitted if there is
        room)."""
        if shape in self.shapes:
            return True
        room = (
            shape not in self.failed
            and len(self.shapes) < self.max_shapes
            and (self.max_bytes == 0 or self.bytes < self.max_bytes)
        )
        if room:
            self.shapes[shape] = 0
        else:
            self.refused += 1
        return room

    def record_bytes(self, shape: Hashable, nbytes: int) -> None:
        """The memory ``shape``'s graph took when it was made (measured by the engine)."""
        if shape in self.shapes:
            self.shapes[shape] = max(0, int(nbytes))

    def fail(self, shape: Hashable) -> None:
        """``shape``'s graph could not be compiled: forget it and never admit it again."""
        self.shapes.pop(shape, None)
        self.failed.add(shape)

    def clear(self) -> int:
        """Forget every signature (their graphs were released); the bytes they held."""
        held = self.bytes
        self.shapes.clear()
        return held

    def snapshot(self) -> dict[str, int]:
        """``compiled_graphs``, ``compiled_graph_bytes``, ``uncompilable_step_shapes`` (gauges),
        ``uncompiled_steps_total``."""
        return {
            "compiled_graphs": len(self.shapes),
            "uncompilable_step_shapes": len(self.failed),
            "compiled_graph_bytes": self.bytes,
            "uncompiled_steps_total": self.refused,
        }
