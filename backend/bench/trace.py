"""Synthetic request traces for serving benchmarks (pure: numpy only, seeded).

Arrivals are Poisson (exponential gaps, optionally alternating calm and busy periods), or a
two-state Markov-modulated Poisson process (``mmpp_trace``: rare bursts at a multiple of the mean
rate, as ROCK saw in production); templates follow a Zipf popularity (a few hot templates, a long
tail); mask ratios follow a Beta distribution with the requested mean (FlashPS reports a mean of
0.11 in its production trace and 0.19 in the public one), clipped to [0.02, 0.9]. Service classes
(``service_classes``: interactive or batch) are drawn apart from the arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MASK_RATIO_MEANS = {"production": 0.11, "public": 0.19}


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float  # seconds after the start of the run
    template: int  # template index, 0 = most popular
    mask_ratio: float
    seed: int


def zipf_weights(num_templates: int, exponent: float) -> np.ndarray:
    ranks = np.arange(1, num_templates + 1, dtype=np.float64)
    weights = ranks**-exponent
    return weights / weights.sum()


def mask_ratios(
    rng: np.random.Generator, count: int, mean: float, concentration: float = 6.0
) -> np.ndarray:
    """Beta(a, b) draws with mean ``mean``; ``concentration`` = a + b (smaller: more spread)."""
    if not 0.0 < mean < 1.0:
        raise ValueError(f"mean mask ratio must be in (0, 1), got {mean}")
    alpha, beta = mean * concentration, (1.0 - mean) * concentration
    return np.clip(rng.beta(alpha, beta, size=count), 0.02, 0.9)


def poisson_trace(
    rps: float,
    duration_s: float,
    num_templates: int,
    mask_mean: float,
    seed: int = 0,
    zipf_exponent: float = 1.1,
    burst_factor: float = 1.0,
) -> list[TraceRequest]:
    """Requests arriving over ``duration_s`` at ``rps`` on average.

    ``burst_factor`` > 1 alternates calm and busy periods (rate / f and rate * f, 2 s each, same
    mean over a cycle only approximately), to exercise queueing."""
    if rps <= 0 or duration_s <= 0:
        raise ValueError("rps and duration must be positive")
    rng = np.random.default_rng(seed)
    arrivals, now = [], 0.0
    while True:
        rate = rps
        if burst_factor > 1.0:
            rate = rps * (burst_factor if int(now // 2.0) % 2 else 1.0 / burst_factor)
        now += rng.exponential(1.0 / rate)
        if now >= duration_s:
            break
        arrivals.append(now)
    return _requests(rng, arrivals, num_templates, mask_mean, zipf_exponent)


def mmpp_trace(
    rps: float,
    duration_s: float,
    num_templates: int,
    mask_mean: float,
    seed: int = 0,
    zipf_exponent: float = 1.1,
    burst_factor: float = 10.0,
    burst_share: float = 0.05,
    burst_s: float = 3.0,
) -> list[TraceRequest]:
    """A two-state Markov-modulated Poisson trace with long-run mean rate ``rps``.

    The busy state runs at ``burst_factor`` x ``rps`` and holds ``burst_share`` of the time in
    stays of ``burst_s`` on average (exponential); the calm state's rate is what keeps the mean:
    ``rps * (1 - share * factor) / (1 - share)``. Invariant: ``share * factor < 1``."""
    if rps <= 0 or duration_s <= 0:
        raise ValueError("rps and duration must be positive")
    if not (0 < burst_share < 1 and burst_factor >= 1 and burst_share * burst_factor < 1):
        raise ValueError(
            f"burst share x factor must stay under 1 (got {burst_share} x {burst_factor})"
        )
    rng = np.random.default_rng(seed)
    rates = (rps * (1 - burst_share * burst_factor) / (1 - burst_share), rps * burst_factor)
    dwell = (burst_s * (1 - burst_share) / burst_share, burst_s)
    arrivals, now, state = [], 0.0, 0
    while now < duration_s:
        until = min(duration_s, now + rng.exponential(dwell[state]))
        while True:  # Poisson arrivals within this stay (memoryless: restart at its end)
            now += rng.exponential(1.0 / rates[state])
            if now >= until:
                break
            arrivals.append(now)
        now, state = until, 1 - state
    return _requests(rng, arrivals, num_templates, mask_mean, zipf_exponent)


def counted_trace(
    rps: float,
    duration_s: float,
    num_templates: int,
    mask_mean: float,
    seed: int = 0,
    zipf_exponent: float = 1.1,
    burst_factor: float = 1.0,
    burst_share: float = 0.0,
    burst_s: float = 3.0,
) -> list[TraceRequest]:
    """Exactly ``round(rps * duration_s)`` requests: a Poisson process (``burst_factor`` 1 or
    ``burst_share`` 0) or ``mmpp_trace``'s two-state MMPP, conditioned on its count, so that it
    offers exactly the intended rate. The modulating states come from their own seeded stream, so
    the bursts fall at the same times whatever the rate; given the count, the arrivals are
    uniform in the process's operational time (its integrated rate), mapped back to seconds."""
    if rps <= 0 or duration_s <= 0:
        raise ValueError("rps and duration must be positive")
    # (start, end, relative rate) of each stay; one calm stay without bursts
    stays = [(0.0, duration_s, 1.0)]
    if burst_factor > 1.0 and burst_share > 0.0:
        if not (burst_share < 1 and burst_share * burst_factor < 1):
            raise ValueError(
                f"burst share x factor must stay under 1 (got {burst_share} x {burst_factor})"
            )
        states = np.random.default_rng([seed, 41])
        rates = ((1 - burst_share * burst_factor) / (1 - burst_share), burst_factor)
        dwell = (burst_s * (1 - burst_share) / burst_share, burst_s)
        stays, now, state = [], 0.0, 0
        while now < duration_s:
            until = min(duration_s, now + states.exponential(dwell[state]))
            stays.append((now, until, rates[state]))
            now, state = until, 1 - state
    ends = np.cumsum([(b - a) * r for a, b, r in stays])  # operational time at each stay's end
    rng = np.random.default_rng(seed)
    ops = np.sort(rng.uniform(0.0, ends[-1], size=int(round(rps * duration_s))))
    arrivals = []
    for u in ops:
        k = min(int(np.searchsorted(ends, u, side="right")), len(stays) - 1)
        a, b, r = stays[k]
        arrivals.append(min(b, a + (u - (ends[k] - (b - a) * r)) / r))
    return _requests(rng, arrivals, num_templates, mask_mean, zipf_exponent)


def service_classes(count: int, interactive_share: float, seed: int = 0) -> list[str]:
    """A service class per request, ``interactive`` with probability ``interactive_share`` (else
    ``batch``), drawn from its own seeded stream: the same arrivals get the same classes."""
    if not 0.0 <= interactive_share <= 1.0:
        raise ValueError(f"interactive share must be in [0, 1], got {interactive_share}")
    draws = np.random.default_rng([seed, 31]).random(count)
    return ["interactive" if d < interactive_share else "batch" for d in draws]


def _requests(
    rng: np.random.Generator,
    arrivals: list[float],
    num_templates: int,
    mask_mean: float,
    zipf_exponent: float,
) -> list[TraceRequest]:
    """Requests at ``arrivals``: a Zipf template, a Beta mask ratio and a seed each."""
    templates = rng.choice(
        num_templates, size=len(arrivals), p=zipf_weights(num_templates, zipf_exponent)
    )
    ratios = mask_ratios(rng, len(arrivals), mask_mean)
    seeds = rng.integers(0, 2**31 - 1, size=len(arrivals))
    return [
        TraceRequest(i, float(a), int(t), float(r), int(s))
        for i, (a, t, r, s) in enumerate(zip(arrivals, templates, ratios, seeds))
    ]
