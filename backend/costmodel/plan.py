"""Bubble-free loading plan: which units read cached activations (FlashPS Algorithm 1, exact).

Pipeline model (FlashPS): unit caches are copied host->device one after another on a side stream
while the compute stream runs the units in order. With ``comp = load = 0`` before unit 0::

    cached unit i:  load += L_i;  comp = max(load, comp) + Cw_i   # wait for its copy, then compute
    dense unit i:                 comp = comp + Cwo_i            # needs no copy

and the pipeline latency is ``comp`` after the last unit. The paper picks each unit greedily;
``solve_plan`` returns the exact optimum over all ``2**N`` choices.

Exactness: every latency is evaluated in exact integer arithmetic (each float cost is a binary
fraction, so all costs are scaled to integers by one common power of two) and rounded to float once
at the end. Ties are therefore true ties, independent of summation order, and ``solve_plan``,
``brute_force_plan``, ``simulate_plan`` and ``greedy_plan`` all agree bit for bit.

Tie rule (shared by ``solve_plan`` and ``brute_force_plan``): among feasible plans, minimise
``(latency, -num_cached, choices)`` where ``choices`` compare lexicographically with *cached*
ranking before *dense* at the first unit where two plans differ. Equal latency therefore prefers
more cached units (fewer FLOPs) and, after that, caching earlier units.

Feasibility: units belong to contiguous stacks. With ``monotone_within_stack`` (the ``kv`` cache
mode) once a unit of a stack is cached every later unit of that stack is cached too, because
dense-after-sparse needs hidden rows of unmasked tokens that a sparse unit no longer produces;
the constraint resets at each new stack. Dense-everywhere is always feasible.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

# brute force enumerates 2**N plans; past this it is far too slow to be a useful oracle
BRUTE_FORCE_MAX_UNITS = 16

_Exact = tuple[int, int, int]  # (Cw, Cwo, L) of one unit, scaled to integers


@dataclass(frozen=True)
class UnitCost:
    """Seconds of one unit. Invariant: all finite and >= 0 (mark an unusable cache with a load
    larger than the whole dense pipeline; the planner then never picks it)."""

    compute_cached_s: float  # Cw: compute with cache (masked tokens only)
    compute_dense_s: float  # Cwo: compute without cache (all tokens)
    load_s: float  # L: host->device copy of this unit's cache (0 when already resident)

    def __post_init__(self) -> None:
        for name in ("compute_cached_s", "compute_dense_s", "load_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"UnitCost.{name} must be finite and >= 0, got {value}")


@dataclass(frozen=True)
class LoadingPlan:
    """Invariant: ``num_cached == sum(use_cache)`` and
    ``latency_s == simulate_plan(costs, use_cache)``."""

    use_cache: tuple[bool, ...]
    latency_s: float  # comp_N of the chosen plan
    num_cached: int


@dataclass(frozen=True)
class _State:
    """A partial plan over units [0, k) in exact integer time. ``bits`` holds its choices, unit 0
    as the most significant bit (1 = cached): it is both the back-pointer chain and, for plans of
    equal length, the lexicographic tie key (a larger ``bits`` caches earlier)."""

    comp: int
    load: int
    num_cached: int
    bits: int
    stack_used: bool  # kv mode: a unit of the current stack is cached, so the rest must be too


def _exact(costs: Sequence[UnitCost]) -> tuple[list[_Exact], int]:
    """Costs as integers in units of ``2**-shift`` seconds, exactly (floats are binary
    fractions)."""
    ratios = [
        [v.as_integer_ratio() for v in (c.compute_cached_s, c.compute_dense_s, c.load_s)]
        for c in costs
    ]
    shift = max((den.bit_length() - 1 for unit in ratios for _, den in unit), default=0)
    scaled = [tuple(num << (shift - den.bit_length() + 1) for num, den in unit) for unit in ratios]
    return scaled, shift  # type: ignore[return-value]


def _seconds(value: int, shift: int) -> float:
    return value / (1 << shift)  # int / int is correctly rounded in Python, even for huge ints


def _step(comp: int, load: int, cost: _Exact, cached: bool) -> tuple[int, int]:
    """One recurrence step (the only place it is written down)."""
    if cached:
        load = load + cost[2]
        return max(load, comp) + cost[0], load
    return comp + cost[1], load


def _simulate_exact(costs: Sequence[_Exact], use_cache: Sequence[bool]) -> int:
    comp = load = 0
    for cost, cached in zip(costs, use_cache):
        comp, load = _step(comp, load, cost, bool(cached))
    return comp


def simulate_plan(costs: Sequence[UnitCost], use_cache: Sequence[bool]) -> float:
    """Latency (comp_N) of one choice list under the recurrence, exact then rounded; 0.0 for no
    units."""
    if len(costs) != len(use_cache):
        raise ValueError(f"{len(use_cache)} choices for {len(costs)} units")
    exact, shift = _exact(costs)
    return _seconds(_simulate_exact(exact, use_cache), shift)


def _check_stacks(num_units: int, stack_ids: Sequence[int] | None) -> list[int]:
    """Stack id per unit (None: one stack). Raises ValueError unless each stack is one contiguous
    run."""
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


def _dominates(a: _State, b: _State) -> bool:
    """a is at least as good as b for every completion, tie rule included.

    Why this is safe: the recurrence is monotone in (comp, load), so a's latency <= b's for the
    same suffix; on equal latency a has at least as many cached units and, if as many, a
    lexicographically preferred prefix. A free stack (not ``stack_used``) admits every suffix a
    used one does.
    """
    return (
        a.comp <= b.comp
        and a.load <= b.load
        and a.stack_used <= b.stack_used
        and (a.num_cached, a.bits) >= (b.num_cached, b.bits)
    )


def _prune(states: list[_State]) -> list[_State]:
    """Undominated ``states``. Sorting puts every dominator before what it dominates (each of its
    sort keys is <=), so one pass suffices and kept states are never evicted."""
    states.sort(key=lambda s: (s.comp, s.load, s.stack_used, -s.num_cached, -s.bits))
    kept: list[_State] = []
    for s in states:
        if not any(_dominates(k, s) for k in kept):
            kept.append(s)
    return kept


def _expand(frontier: list[_State], cost: _Exact, new_stack: bool, monotone: bool) -> list[_State]:
    out = []
    for s in frontier:
        forced = monotone and s.stack_used and not new_stack
        for cached in (True,) if forced else (True, False):
            comp, load = _step(s.comp, s.load, cost, cached)
            used = cached or (s.stack_used and not new_stack)
            out.append(_State(comp, load, s.num_cached + cached, (s.bits << 1) | cached, used))
    return out


def _decode(bits: int, num_units: int) -> tuple[bool, ...]:
    return tuple(bool((bits >> (num_units - 1 - i)) & 1) for i in range(num_units))


# A suffix of choices maps a start state (comp, load) to the final latency max(comp + a, load + b):
# the recurrence is max-plus linear. A suffix that caches nothing has b = _never(...), a value so
# negative that load + b never wins. A suffix frontier keeps the Pareto-minimal (a, b) pairs sorted
# by a ascending (so b strictly descending), plus a - b per pair for bisection.
_Frontier = tuple[list[int], list[int], list[int]]


def _suffix_frontier(pairs: list[tuple[int, int]]) -> _Frontier:
    pairs.sort()
    a_s: list[int] = []
    b_s: list[int] = []
    for a, b in pairs:
        if not b_s or b < b_s[-1]:
            a_s.append(a)
            b_s.append(b)
    return a_s, b_s, [a - b for a, b in zip(a_s, b_s)]


def _prepend(front: _Frontier, cost: _Exact, cached: bool) -> list[tuple[int, int]]:
    """(a, b) of ``unit + suffix`` for every suffix in ``front`` (substitute one recurrence
    step)."""
    cw, cwo, load = cost
    if not cached:
        return [(a + cwo, b) for a, b in zip(front[0], front[1])]
    return [(a + cw, load + max(a + cw, b)) for a, b in zip(front[0], front[1])]


def _suffix_frontiers(
    costs: Sequence[_Exact], ids: list[int], monotone: bool
) -> tuple[list[_Frontier], list[_Frontier]]:
    """Per layer k: best suffixes over units [k, N) when unit k is free, and when it is forced to
    be cached (kv mode, an earlier unit of its stack is cached). Index N is the empty suffix."""
    n = len(costs)
    never = -1 - 2 * sum(sum(c) for c in costs)  # below -(any comp or load) reachable
    empty: _Frontier = ([0], [never], [-never])
    free: list[_Frontier] = [empty] * (n + 1)
    forced: list[_Frontier] = [empty] * (n + 1)
    for k in range(n - 1, -1, -1):
        same_next = monotone and k + 1 < n and ids[k + 1] == ids[k]
        cached = _prepend(forced[k + 1] if same_next else free[k + 1], costs[k], True)
        forced[k] = _suffix_frontier(list(cached))
        free[k] = _suffix_frontier(cached + _prepend(free[k + 1], costs[k], False))
    return free, forced


def _best_completion(front: _Frontier, comp: int, load: int) -> int:
    """min over suffixes of max(comp + a, load + b). comp + a rises and load + b falls along the
    frontier, so the minimum sits where they cross, found by bisection on a - b."""
    a_s, b_s, diffs = front
    j = bisect.bisect_left(diffs, load - comp)
    return min(max(comp + a_s[i], load + b_s[i]) for i in (j - 1, j) if 0 <= i < len(a_s))


def solve_plan(
    costs: Sequence[UnitCost],
    stack_ids: Sequence[int] | None = None,
    monotone_within_stack: bool = False,
) -> LoadingPlan:
    """Exact optimum under the tie rule (module docstring); equals ``brute_force_plan``.

    ``stack_ids`` gives each unit's stack (contiguous runs; None = a single stack); it only
    matters with ``monotone_within_stack``.

    Two passes. Backward: suffix frontiers give the optimum and, for any partial plan, its best
    reachable latency. Forward: partial plans are extended unit by unit and kept only if (1) they
    can still reach the optimum and (2) no kept plan dominates them (``_dominates``). (2) alone
    would keep every (comp, load, tie-key) trade-off; (1) cuts that to optimal prefixes, so the
    frontier stays small (N = 60 takes milliseconds).
    """
    ids = _check_stacks(len(costs), stack_ids)
    exact, shift = _exact(costs)
    free, forced = _suffix_frontiers(exact, ids, monotone_within_stack)
    optimum = _best_completion(free[0], 0, 0)
    frontier = [_State(0, 0, 0, 0, False)]
    for i, cost in enumerate(exact):
        new_stack = i == 0 or ids[i] != ids[i - 1]
        candidates = []
        for s in _expand(frontier, cost, new_stack, monotone_within_stack):
            held = (
                monotone_within_stack
                and s.stack_used
                and i + 1 < len(exact)
                and ids[i + 1] == ids[i]
            )
            if _best_completion(forced[i + 1] if held else free[i + 1], s.comp, s.load) == optimum:
                candidates.append(s)
        frontier = _prune(candidates)
    best = min(frontier, key=lambda s: (s.comp, -s.num_cached, -s.bits))
    assert best.comp == optimum  # the backward and forward passes share one exact arithmetic
    return LoadingPlan(_decode(best.bits, len(costs)), _seconds(best.comp, shift), best.num_cached)


def _feasible(choices: Sequence[bool], ids: Sequence[int]) -> bool:
    """kv-mode rule: no dense unit after a cached unit of the same stack."""
    for i in range(1, len(choices)):
        if ids[i] == ids[i - 1] and choices[i - 1] and not choices[i]:
            return False
    return True


def brute_force_plan(
    costs: Sequence[UnitCost],
    stack_ids: Sequence[int] | None = None,
    monotone_within_stack: bool = False,
) -> LoadingPlan:
    """Reference oracle: enumerate every feasible plan and minimise ``(latency, -num_cached,
    choices)`` with cached ranking first. Only for tests and N <= BRUTE_FORCE_MAX_UNITS."""
    if len(costs) > BRUTE_FORCE_MAX_UNITS:
        raise ValueError(
            f"brute force is limited to {BRUTE_FORCE_MAX_UNITS} units, got {len(costs)}"
        )
    ids = _check_stacks(len(costs), stack_ids)
    exact, shift = _exact(costs)
    best_key: tuple[int, int, tuple[bool, ...]] | None = None
    best_choices: tuple[bool, ...] = ()
    for choices in itertools.product((True, False), repeat=len(costs)):
        if monotone_within_stack and not _feasible(choices, ids):
            continue
        # tuple(not c) ranks True (cached) before False at the first difference
        key = (_simulate_exact(exact, choices), -sum(choices), tuple(not c for c in choices))
        if best_key is None or key < best_key:
            best_key, best_choices = key, choices
    assert best_key is not None  # dense-everywhere is always feasible
    return LoadingPlan(tuple(best_choices), _seconds(best_key[0], shift), sum(best_choices))


def greedy_plan(
    costs: Sequence[UnitCost],
    stack_ids: Sequence[int] | None = None,
    monotone_within_stack: bool = False,
) -> LoadingPlan:
    """The paper's greedy rule, kept as a baseline: each unit takes whichever choice finishes it
    sooner given the choices so far (cache on a tie). Units forced by the kv constraint skip the
    decision. Never better than ``solve_plan``; can be worse (an early load delays later ones).
    """
    ids = _check_stacks(len(costs), stack_ids)
    exact, shift = _exact(costs)
    comp = load = 0
    choices: list[bool] = []
    for i, cost in enumerate(exact):
        forced = monotone_within_stack and i > 0 and ids[i] == ids[i - 1] and choices[-1]
        with_cache, without = _step(comp, load, cost, True), _step(comp, load, cost, False)
        cached = forced or with_cache[0] <= without[0]
        comp, load = with_cache if cached else without
        choices.append(cached)
    return LoadingPlan(tuple(choices), _seconds(comp, shift), sum(choices))
