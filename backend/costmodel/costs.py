"""Cost profile of one model on one device: seconds per unit as fitted lines over FLOPs and bytes.

A profile turns a batch (rows with their masks and templates) into the per-unit ``UnitCost`` list
that ``plan.solve_plan`` optimises. Two measured lines cover every unit:

    compute seconds = compute.slope * FLOPs of the unit's work + compute.intercept
    load seconds    = load.slope * bytes copied host->device + load.intercept

Invariants: predicted seconds are clamped at 0 (a fitted intercept may be slightly negative, time
may not); in a batch the compute intercept is paid once per unit (one kernel sequence runs all
rows) and a template's cache is copied once per unit however many rows share it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from backend.costmodel.plan import UnitCost

FORMAT_VERSION = 1
MODES = ("kv", "hidden")


@dataclass(frozen=True)
class LinearModel:
    """y = slope * x + intercept, with the fit's coefficient of determination ``r2`` (<= 1)."""

    slope: float
    intercept: float
    r2: float

    def predict(self, x: float) -> float:
        return self.slope * x + self.intercept


STEP_REST_UNKNOWN = LinearModel(0.0, 0.0, 0.0)  # a step's time outside the units, not measured


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> LinearModel:
    """Ordinary least squares of ys on xs. Needs >= 2 points and two distinct xs.

    Centred closed form: FLOP counts (~1e12) next to seconds (~1e-3) make the normal equations of
    an uncentred design matrix badly conditioned; centring keeps the fit exact on exact data.
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"xs and ys must be 1-D and equally long, got {x.shape} and {y.shape}")
    if x.size < 2 or not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("a linear fit needs at least 2 finite points")
    dx, dy = x - x.mean(), y - y.mean()
    sxx = float(dx @ dx)
    if sxx == 0.0:
        raise ValueError("a linear fit needs at least two distinct x values")
    slope = float(dx @ dy) / sxx
    intercept = float(y.mean() - slope * x.mean())
    ss_res = float(np.sum((y - (slope * x + intercept)) ** 2))
    ss_tot = float(dy @ dy)
    # constant ys are explained perfectly by a flat line; avoid 0/0
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return LinearModel(slope, intercept, min(r2, 1.0))


@dataclass(frozen=True)
class UnitShape:
    """Work of one transformer unit (block) over one token grid. ``stack_id`` groups units into
    contiguous stacks; ``cache_bytes_per_token`` is what the cache of this unit holds per image
    token (kv: K and V; hidden: the hidden row), 0 for a unit without a cache."""

    name: str
    stack_id: int
    num_tokens: int
    hidden_dim: int
    num_text_tokens: int = 0
    ffn_mult: float = 4.0
    cache_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        _check_int(self.stack_id, "stack_id", minimum=None)
        _check_int(self.num_tokens, "num_tokens", minimum=1)
        _check_int(self.hidden_dim, "hidden_dim", minimum=1)
        _check_int(self.num_text_tokens, "num_text_tokens", minimum=0)
        _check_int(self.cache_bytes_per_token, "cache_bytes_per_token", minimum=0)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("UnitShape.name must be a non-empty string")
        if (
            isinstance(self.ffn_mult, bool)
            or not isinstance(self.ffn_mult, (int, float))
            or not math.isfinite(self.ffn_mult)
            or self.ffn_mult <= 0
        ):
            raise ValueError(f"UnitShape.ffn_mult must be a positive number, got {self.ffn_mult!r}")

    @property
    def cache_bytes(self) -> int:
        """Bytes of one template's cache for this unit (every token: masks differ per request)."""
        return self.cache_bytes_per_token * self.num_tokens


def _check_int(value: object, name: str, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"UnitShape.{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"UnitShape.{name} must be >= {minimum}, got {value}")


def unit_flops(shape: UnitShape, num_masked_tokens: int, dense: bool) -> float:
    """FLOPs (2 per multiply-add) of one row through one unit.

    Queries are the masked image tokens (all ``num_tokens`` when ``dense``); keys/values span every
    image token plus the text tokens. Per query: Q, K, V and output projections (8 d^2), attention
    scores and weighted sum against all keys (4 (N + T) d), FFN (4 m d^2). The text tokens' K/V
    projections (4 T d^2) are paid either way (prompts differ per request, so they are never
    cached). Invariants: monotone in ``num_masked_tokens``; equal to dense at ``num_tokens``.
    """
    n, d, t = shape.num_tokens, shape.hidden_dim, shape.num_text_tokens
    queries = n if dense else num_masked_tokens
    if (
        isinstance(queries, bool)
        or not isinstance(queries, (int, np.integer))
        or not 0 <= queries <= n
    ):
        raise ValueError(
            f"{shape.name}: masked tokens must be an integer in [0, {n}], got {queries!r}"
        )
    per_query = 8.0 * d * d + 4.0 * (n + t) * d + 4.0 * shape.ffn_mult * d * d
    return float(queries) * per_query + 4.0 * t * d * d


def tokens_for_ratio(num_tokens: int, ratio: float) -> int:
    """Masked tokens for a masked fraction, rounded up (a painted area computes at least one
    token); the tolerance keeps k/N ratios that float arithmetic nudged up at exactly k."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"masked ratio must be in [0, 1], got {ratio}")
    return min(num_tokens, max(0, math.ceil(ratio * num_tokens - 1e-9)))


def ideal_speedup(units: Sequence[UnitShape], masked_ratio: float) -> float:
    """Dense FLOPs / cached FLOPs over all units: the speedup if time were proportional to FLOPs."""
    dense = sum(unit_flops(u, u.num_tokens, dense=True) for u in units)
    cached = sum(
        unit_flops(u, tokens_for_ratio(u.num_tokens, masked_ratio), dense=False) for u in units
    )
    if cached == 0.0:
        return math.inf if dense > 0 else 1.0
    return dense / cached


@dataclass(frozen=True)
class RowWork:
    """One row of a batch. ``masked`` is either one masked-token ratio for every unit, or masked
    tokens per stack id (a mapping, or a sequence indexed by stack id). ``needs_load``: the
    template's cache is not yet on the device."""

    masked: float | Mapping[int, int] | Sequence[int]
    template_id: str
    needs_load: bool = True

    def masked_tokens(self, unit: UnitShape) -> int:
        if isinstance(self.masked, (int, float)) and not isinstance(self.masked, bool):
            return tokens_for_ratio(unit.num_tokens, float(self.masked))
        try:
            count = self.masked[unit.stack_id]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            raise ValueError(
                f"row of template {self.template_id!r} gives no masked tokens for "
                f"stack {unit.stack_id} (unit {unit.name})"
            ) from None
        if (
            isinstance(count, bool)
            or not isinstance(count, (int, np.integer))
            or not 0 <= count <= unit.num_tokens
        ):
            raise ValueError(
                f"unit {unit.name}: masked tokens must be an integer in "
                f"[0, {unit.num_tokens}], got {count!r}"
            )
        return int(count)


def _seconds(model: LinearModel, x: float) -> float:
    return max(0.0, model.predict(x))


def batch_unit_costs(profile: CostProfile, rows: Sequence[RowWork]) -> list[UnitCost]:
    """Per-unit costs of running ``rows`` as one batch.

    Compute: FLOPs summed over rows, mapped through the line once (one intercept per unit).
    Load: one copy per distinct template that some row needs loaded, per unit; a row that masks
    every token of a unit reads no cache there, so it adds no copy for that unit.
    """
    if not rows:
        raise ValueError("a batch needs at least one row")
    out = []
    for unit in profile.units:
        masked = [row.masked_tokens(unit) for row in rows]
        cached_flops = sum(unit_flops(unit, m, dense=False) for m in masked)
        dense_flops = len(rows) * unit_flops(unit, unit.num_tokens, dense=True)
        templates = {
            row.template_id
            for row, m in zip(rows, masked)
            if row.needs_load and m < unit.num_tokens
        }
        load_s = 0.0
        if unit.cache_bytes > 0:
            load_s = len(templates) * _seconds(profile.load, unit.cache_bytes)
        out.append(
            UnitCost(
                _seconds(profile.compute, cached_flops),
                _seconds(profile.compute, dense_flops),
                load_s,
            )
        )
    return out


FLAT_R2 = 0.2  # below it, a compute line says more about overhead than about work


@dataclass
class CostProfile:
    """Fitted cost lines of one model on one device in one cache mode, with its unit shapes.
    Invariant (checked by ``from_json``): ``format_version == FORMAT_VERSION``, ``mode`` in
    MODES."""

    format_version: int
    model_id: str
    device: str
    mode: str  # "kv" | "hidden"
    compute: LinearModel  # seconds vs FLOPs of a unit (fit over cached and dense samples together)
    load: LinearModel  # seconds vs bytes
    units: list[UnitShape]
    # seconds of a step outside the units (convolutions, embeddings, the scheduler) vs the rows
    # in the batch; a profile written before it was measured reads as 0 (``STEP_REST_UNKNOWN``)
    step_rest: LinearModel = field(default_factory=lambda: STEP_REST_UNKNOWN)

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"cost profile format_version must be {FORMAT_VERSION}, got {self.format_version!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"cost profile mode must be one of {MODES}, got {self.mode!r}")

    @property
    def stack_ids(self) -> list[int]:
        return [u.stack_id for u in self.units]

    @property
    def compute_is_flat(self) -> bool:
        """Unit time does not follow the work: it falls as FLOPs grow, or FLOPs explain less than
        ``FLAT_R2`` of it. Then units are bound by kernel launches or host overhead at the
        profiled size, and skipping compute saves no time there."""
        return self.compute.slope <= 0 or self.compute.r2 < FLAT_R2

    def unit_costs(self, rows: Sequence[RowWork]) -> list[UnitCost]:
        return batch_unit_costs(self, rows)

    def rest_seconds(self, num_rows: int) -> float:
        """Seconds of a step of ``num_rows`` rows spent outside the units."""
        return _seconds(self.step_rest, num_rows)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        """Parse and validate; ValueError names the offending field and what to do."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"cost profile is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("cost profile must be a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise ValueError(
                f"cost profile format_version {version!r} is not supported (expected "
                f"{FORMAT_VERSION}): re-run the profiler for this model and device"
            )
        optional = {"step_rest"}  # absent from profiles measured before it was
        required = {f.name for f in fields(cls)} - optional
        _check_keys({k: v for k, v in data.items() if k not in optional}, required, "cost profile")
        for key in ("model_id", "device"):
            if not isinstance(data[key], str) or not data[key]:
                raise ValueError(f"cost profile field {key!r} must be a non-empty string")
        if data["mode"] not in MODES:
            raise ValueError(
                f"cost profile field 'mode' must be one of {MODES}, got {data['mode']!r}"
            )
        if not isinstance(data["units"], list):
            raise ValueError("cost profile field 'units' must be a list")
        return cls(
            FORMAT_VERSION,
            data["model_id"],
            data["device"],
            data["mode"],
            _parse_line(data["compute"], "compute"),
            _parse_line(data["load"], "load"),
            [_parse_unit(u, i) for i, u in enumerate(data["units"])],
            _parse_line(data["step_rest"], "step_rest")
            if "step_rest" in data
            else STEP_REST_UNKNOWN,
        )


def _check_keys(obj: object, expected: set[str], where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be a JSON object")
    missing, unknown = expected - obj.keys(), obj.keys() - expected
    if missing:
        raise ValueError(f"{where} is missing field(s): {', '.join(sorted(missing))}")
    if unknown:
        raise ValueError(f"{where} has unknown field(s): {', '.join(sorted(unknown))}")


def _parse_line(obj: object, where: str) -> LinearModel:
    _check_keys(obj, {"slope", "intercept", "r2"}, f"cost profile field {where!r}")
    assert isinstance(obj, dict)
    for key, value in obj.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(
                f"cost profile field '{where}.{key}' must be a finite number, got {value!r}"
            )
    return LinearModel(float(obj["slope"]), float(obj["intercept"]), float(obj["r2"]))


def _parse_unit(obj: object, index: int) -> UnitShape:
    _check_keys(obj, {f.name for f in fields(UnitShape)}, f"cost profile unit {index}")
    assert isinstance(obj, dict)
    try:
        return UnitShape(**obj)
    except ValueError as exc:
        raise ValueError(f"cost profile unit {index}: {exc}") from None


def build_profile(
    model_id: str,
    device: str,
    mode: str,
    units: Sequence[UnitShape],
    compute_samples: Sequence[tuple[float, float]],
    load_samples: Sequence[tuple[float, float]],
    rest_samples: Sequence[tuple[float, float]] = (),
) -> CostProfile:
    """Profile from measurements: (FLOPs, seconds) of cached and dense unit runs together,
    (bytes, seconds) of host->device copies and (rows, seconds) of steps outside the units (at
    least two row counts; none: unknown, 0)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    compute = fit_linear(*zip(*compute_samples)) if compute_samples else None
    load = fit_linear(*zip(*load_samples)) if load_samples else None
    if compute is None or load is None:
        raise ValueError("a profile needs compute and load samples")
    rest = fit_linear(*zip(*rest_samples)) if rest_samples else STEP_REST_UNKNOWN
    return CostProfile(FORMAT_VERSION, model_id, device, mode, compute, load, list(units), rest)
