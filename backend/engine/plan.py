"""Bubble-free loading plan: which units read cached activations (FlashPS Algorithm 1, exact).

Pipeline model (FlashPS): unit caches are copied host->device one after another on a side stream
while the compute stream runs the units in order. With ``comp = load = 0`` before unit 0::

    cached unit i:  load += L_i;  comp = max(load, comp) + Cw_i   # wait for its copy, then compute
    dense unit i:                 comp = comp + Cwo_i            # needs no copy

and the pipeline latency is ``comp`` after the last unit. The paper picks each unit greedily;
``solve_plan`` returns the exact optimum over all ``2**N`` choices with a dynamic programme over
Pareto frontiers of partial plans.

Tie rule (shared by ``solve_plan`` and ``brute_force_plan``): among feasible plans, minimise
``(latency, -num_cached, choices)`` where ``choices`` compare lexicographically with *cached*
ranking before *dense* at the first unit where two plans differ. Equal latency therefore prefers
more cached units (fewer FLOPs, less power) and, after that, caching earlier units.

Feasibility: units belong to contiguous stacks. With ``monotone_within_stack`` (the ``kv`` cache
mode) once a unit of a stack is cached every later unit of that stack is cached too, because
dense-after-sparse needs hidden rows of unmasked tokens that a sparse unit no longer produces;
the constraint resets at each new stack. Dense-everywhere is always feasible.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

# brute force enumerates 2**N plans; past this it is far too slow to be a useful oracle
BRUTE_FORCE_MAX_UNITS = 16


@dataclass(frozen=True)
class UnitCost:
    """Seconds of one unit. Invariant: all >= 0; ``compute_dense_s`` finite; ``inf`` in
    ``compute_cached_s`` or ``load_s`` means "the cache of this unit cannot be used"."""

    compute_cached_s: float  # Cw: compute with cache (masked tokens only)
    compute_dense_s: float  # Cwo: compute without cache (all tokens)
    load_s: float  # L: host->device copy of this unit's cache (0 when already resident)

    def __post_init__(self) -> None:
        for name in ("compute_cached_s", "compute_dense_s", "load_s"):
            value = getattr(self, name)
            if math.isnan(value) or value < 0:
                raise ValueError(f"UnitCost.{name} must be >= 0, got {value}")
        if math.isinf(self.compute_dense_s):
            raise ValueError("UnitCost.compute_dense_s must be finite (dense is the fallback)")


@dataclass(frozen=True)
class LoadingPlan:
    """Invariant: ``num_cached == sum(use_cache)`` and ``latency_s == simulate_plan(costs, use_cache)``."""

    use_cache: tuple[bool, ...]
    latency_s: float  # comp_N of the chosen plan
    num_cached: int


@dataclass(frozen=True)
class _State:
    """A partial plan over units [0, k). ``bits`` holds its choices, unit 0 as the most significant
    bit (1 = cached), so it is both the back-pointer chain and the lexicographic tie key."""

    comp: float
    load: float
    num_cached: int
    bits: int
    stack_used: bool  # kv mode: a unit of the current stack is cached, so the rest must be too


def simulate_plan(costs: Sequence[UnitCost], use_cache: Sequence[bool]) -> float:
    """Latency (comp_N) of one choice list under the pipeline recurrence; 0.0 for no units."""
    if len(costs) != len(use_cache):
        raise ValueError(f"{len(use_cache)} choices for {len(costs)} units")
    comp = load = 0.0
    for cost, cached in zip(costs, use_cache):
        comp, load = _step(comp, load, cost, bool(cached))
    return comp


def _step(comp: float, load: float, cost: UnitCost, cached: bool) -> tuple[float, float]:
    # The one place the recurrence is evaluated: solve_plan, brute force and simulate_plan must
    # produce bit-identical floats so that exact ties are seen as ties by all of them.
    if cached:
        load = load + cost.load_s
        return max(load, comp) + cost.compute_cached_s, load
    return comp + cost.compute_dense_s, load


def _check_stacks(num_units: int, stack_ids: Sequence[int] | None) -> list[int]:
    """Stack id per unit (None: one stack). Raises ValueError unless each stack is one contiguous run."""
    if stack_ids is None:
        return [0] * num_units
    ids = list(stack_ids)
    if len(ids) != num_units:
        raise ValueError(f"{len(ids)} stack ids for {num_units} units")
    seen: set[int] = set()
    for i, sid in enumerate(ids):
        if i > 0 and sid == ids[i - 1]:
            continue
        if sid in seen:
            raise ValueError(f"stack ids must be contiguous: stack {sid} reappears at unit {i}")
        seen.add(sid)
    return ids


def _allowed(state: _State, new_stack: bool, monotone: bool) -> tuple[bool, ...]:
    """Choices open to the next unit (True = cached)."""
    if monotone and state.stack_used and not new_stack:
        return (True,)
    return (True, False)


def _dominates(a: _State, b: _State) -> bool:
    """a is at least as good as b for every completion, tie rule included.

    Why this is safe: the recurrence is monotone in (comp, load) (float + and max are monotone),
    so a's latency <= b's for the same suffix; on equal latency a has at least as many cached units
    and, if as many, a lexicographically preferred prefix. A free stack (not ``stack_used``)
    admits every suffix a used one does.
    """
    return (a.comp <= b.comp and a.load <= b.load and a.stack_used <= b.stack_used
            and (a.num_cached, a.bits) >= (b.num_cached, b.bits))


def _prune(states: list[_State]) -> list[_State]:
    """Pareto frontier of ``states``. Sorting puts every dominator before what it dominates
    (each of its sort keys is <=), so one pass suffices and kept states are never evicted."""
    states.sort(key=lambda s: (s.comp, s.load, s.stack_used, -s.num_cached, -s.bits))
    kept: list[_State] = []
    for s in states:
        if not any(_dominates(k, s) for k in kept):
            kept.append(s)
    return kept


def _expand(frontier: list[_State], cost: UnitCost, new_stack: bool, monotone: bool) -> list[_State]:
    out = []
    for s in frontier:
        for cached in _allowed(s, new_stack, monotone):
            comp, load = _step(s.comp, s.load, cost, cached)
            used = cached or (s.stack_used and not new_stack)
            out.append(_State(comp, load, s.num_cached + cached, (s.bits << 1) | cached, used))
    return out


def _decode(bits: int, num_units: int) -> tuple[bool, ...]:
    return tuple(bool((bits >> (num_units - 1 - i)) & 1) for i in range(num_units))


def solve_plan(costs: Sequence[UnitCost], stack_ids: Sequence[int] | None = None,
               monotone_within_stack: bool = False) -> LoadingPlan:
    """Exact optimum under the tie rule (module docstring), equal to ``brute_force_plan``.

    ``stack_ids`` gives each unit's stack (contiguous runs; None = a single stack); it only
    matters with ``monotone_within_stack``. Cost: N layers of a frontier that stays small in
    practice (it is bounded by the distinct (comp, load) trade-offs, not by 2**N).
    """
    ids = _check_stacks(len(costs), stack_ids)
    frontier = [_State(0.0, 0.0, 0, 0, False)]
    for i, cost in enumerate(costs):
        new_stack = i == 0 or ids[i] != ids[i - 1]
        frontier = _prune(_expand(frontier, cost, new_stack, monotone_within_stack))
    best = min(frontier, key=lambda s: (s.comp, -s.num_cached, -s.bits))
    return LoadingPlan(_decode(best.bits, len(costs)), best.comp, best.num_cached)


def _feasible(choices: Sequence[bool], ids: Sequence[int]) -> bool:
    """kv-mode rule: no dense unit after a cached unit of the same stack."""
    for i in range(1, len(choices)):
        if ids[i] == ids[i - 1] and choices[i - 1] and not choices[i]:
            return False
    return True


def brute_force_plan(costs: Sequence[UnitCost], stack_ids: Sequence[int] | None = None,
                     monotone_within_stack: bool = False) -> LoadingPlan:
    """Reference oracle: enumerate every feasible plan, minimise ``(latency, -num_cached, choices)``
    with cached ranking first. Only for tests and N <= BRUTE_FORCE_MAX_UNITS."""
    if len(costs) > BRUTE_FORCE_MAX_UNITS:
        raise ValueError(f"brute force is limited to {BRUTE_FORCE_MAX_UNITS} units, got {len(costs)}")
    ids = _check_stacks(len(costs), stack_ids)
    best_key, best_choices = None, ()
    for choices in itertools.product((True, False), repeat=len(costs)):
        if monotone_within_stack and not _feasible(choices, ids):
            continue
        # tuple(not c) ranks True (cached) before False at the first difference
        key = (simulate_plan(costs, choices), -sum(choices), tuple(not c for c in choices))
        if best_key is None or key < best_key:
            best_key, best_choices = key, choices
    assert best_key is not None  # dense-everywhere is always feasible
    return LoadingPlan(tuple(best_choices), best_key[0], sum(best_choices))


def greedy_plan(costs: Sequence[UnitCost], stack_ids: Sequence[int] | None = None,
                monotone_within_stack: bool = False) -> LoadingPlan:
    """The paper's greedy rule, kept as a baseline: each unit takes whichever choice finishes it
    sooner given the choices so far (cache on a tie). Units forced by the kv constraint skip the
    decision. Never better than ``solve_plan``; can be worse (a cheap early load delays later ones).
    """
    ids = _check_stacks(len(costs), stack_ids)
    comp = load = 0.0
    choices: list[bool] = []
    for i, cost in enumerate(costs):
        forced = monotone_within_stack and i > 0 and ids[i] == ids[i - 1] and choices[-1]
        with_cache = _step(comp, load, cost, True)
        without = _step(comp, load, cost, False)
        cached = forced or with_cache[0] <= without[0]
        comp, load = with_cache if cached else without
        choices.append(cached)
    return LoadingPlan(tuple(choices), comp, sum(choices))
