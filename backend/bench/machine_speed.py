"""How this machine's speed drifts: the figures ``machine_drift`` needs (``cv``, ``tau_s``), read
off a fixed piece of work timed over and over on one thread.

``python -m backend.bench.machine_speed --seconds 180 --json F``: a 256 x 256 float32 matmul
loop (one torch thread, as the engine worker runs on this CPU) is timed in samples of about
``sample_s``; ``drift_of`` turns the samples into the drift's figures (pure):

* the samples are averaged into windows of ``window_s`` (per-step jitter, which the simulation
  prices apart as ``noise_cv``, averages out within a window; the drift does not);
* ``cv``: the coefficient of variation of the window means;
* ``tau_s``: the lag at which the autocorrelation of the log window means first falls below
  exp(-1) (an Ornstein-Uhlenbeck process's correlation time); ``None`` when it never does within
  a third of the run (the run is too short to tell);
* ``autocorrelation``: lag (s) -> correlation, for the report.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np


def drift_of(times_s: list[float], seconds: list[float], window_s: float = 0.5) -> dict:
    """The drift figures (module docstring) of samples that took ``seconds``, each ending at
    ``times_s`` (seconds from the start, ascending)."""
    if len(times_s) != len(seconds) or len(seconds) < 2:
        raise ValueError("need two or more samples, one time per sample")
    _, window_of = np.unique(np.floor(np.asarray(times_s) / window_s), return_inverse=True)
    values = np.asarray(seconds, dtype=float)
    windows = np.bincount(window_of, weights=values) / np.bincount(window_of)
    logs = np.log(windows / windows.mean())
    lags = range(1, max(2, len(windows) // 3))
    correlation = {lag * window_s: _autocorrelation(logs, lag) for lag in lags}
    below = [lag for lag, c in correlation.items() if c < math.exp(-1.0)]
    return {
        "windows": len(windows),
        "window_s": window_s,
        "cv": float(windows.std() / windows.mean()),
        "tau_s": below[0] if below else None,
        "sample_cv": float(values.std() / values.mean()),
        "autocorrelation": {f"{lag:g}": round(c, 4) for lag, c in correlation.items()},
    }


def _autocorrelation(series: np.ndarray, lag: int) -> float:
    head, tail = series[:-lag], series[lag:]
    if head.std() == 0 or tail.std() == 0:
        return 0.0
    return float(np.corrcoef(head, tail)[0, 1])


def sample(seconds: float, sample_s: float = 0.02) -> tuple[list[float], list[float]]:
    """Time the matmul loop for ``seconds``: (end of each sample, its seconds)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    t = time.perf_counter()
    for _ in range(20):  # one product's time sizes a sample to about ``sample_s``
        a @ a
    reps = max(1, round(sample_s * 20 / (time.perf_counter() - t)))
    started = time.perf_counter()
    ends, took = [], []
    while (now := time.perf_counter()) - started < seconds:
        for _ in range(reps):
            a @ a
        end = time.perf_counter()
        ends.append(end - started)
        took.append(end - now)
    return ends, took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--window-s", type=float, default=0.5)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    ends, took = sample(args.seconds)
    report = drift_of(ends, took, args.window_s) | {"seconds": args.seconds}
    tau = report["tau_s"]
    print(
        f"{report['windows']} windows of {args.window_s:g} s: drift cv {report['cv']:.3f}, "
        f"correlation time {'longer than a third of the run' if tau is None else f'{tau:g} s'}; "
        f"per-sample cv {report['sample_cv']:.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
