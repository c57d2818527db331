"""The route simulation with LoRA adapters: mask_aware with and without its adapter term.

``python -m backend.bench.route_adapters [--duration S] [--json PATH]`` runs the route simulation
(``backend.bench.route_bench``: 8 workers x batch 8, small-flux-fill's CPU profile, 200 templates)
with 200 adapters (Zipf 1.1 popularity, 0-3 per request, ranks 8-64 at 4 MiB per rank, 1 GiB device
and 4 GiB host tier per worker, LFU) and compares ``mask_aware`` against the same policy shown no
adapters (``mask_aware_no_adapters``) and ``fewest_requests``, per scenario of registry read rate
and join share K, at 0.5 and 0.8 of the measured capacity. Reported per run: mean and P95 latency,
the share of adapter requests found on the device / in host RAM when their row was admitted,
registry reads, rows that blocked at their join deadline and the seconds steps waited for
adapters. (Not wired into ``maskserve bench route``: its flags live in ``backend.bench.commands``.)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from backend.bench.route_bench import ADAPTER_BLIND, RouteBenchConfig, run_route_bench

# (name, overrides): the shipped rates, a slow registry (network storage, or a GPU whose steps are
# several times shorter than this CPU profile's), and each again with K = 0 (an ordinary server:
# adapters before the first step)
SCENARIOS: tuple[tuple[str, dict[str, float]], ...] = (
    ("read 1 GB/s, K 0.2", {}),
    ("read 1 GB/s, K 0", {"adapter_join_by": 0.0}),
    ("read 0.1 GB/s, K 0.2", {"adapter_read_gbps": 0.1}),
    ("read 0.1 GB/s, K 0", {"adapter_read_gbps": 0.1, "adapter_join_by": 0.0}),
)
POLICIES = ("mask_aware", ADAPTER_BLIND, "fewest_requests")


def adapter_row(scenario: str, r: dict) -> dict:
    c = r["cache"]
    asks = max(1, c["adapter_hits_device"] + c["adapter_hits_host"] + c["adapter_hits_disk"])
    return {
        "scenario": scenario,
        "load": r["load"],
        "rps": r["rps"],
        "policy": r["policy"],
        "avg_latency_s": r["avg_latency_s"],
        "p95_latency_s": r["p95_latency_s"],
        "device_hit": c["adapter_hits_device"] / asks,
        "host_hit": c["adapter_hits_host"] / asks,
        "reads": c["adapter_reads"],
        "rows_blocked": c["adapter_rows_blocked"] / max(1, c["adapter_rows"]),
        "block_s": c["adapter_block_s"],
    }


def table(rows: list[dict]) -> str:
    head = (
        "| scenario | load (req/s) | policy | mean s | P95 s | device hit | host hit | reads "
        "| rows blocked | steps waited s |"
    )
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['load']:g} ({r['rps']:.2f}) | {r['policy']} "
            f"| {r['avg_latency_s']:.2f} | {r['p95_latency_s']:.2f} | {r['device_hit']:.1%} "
            f"| {r['host_hit']:.1%} | {r['reads']} | {r['rows_blocked']:.1%} | {r['block_s']:.1f} |"
        )
    return "\n".join(lines)


def run(duration_s: float = 600.0, seed: int = 0, profiles_dir: str = "profiles") -> list[dict]:
    base = RouteBenchConfig(
        profiles_dir=profiles_dir,
        policies=POLICIES,
        loads=(0.5, 0.8),
        duration_s=duration_s,
        num_adapters=200,
        seed=seed,
    )
    rows = []
    for name, overrides in SCENARIOS:
        report = run_route_bench(replace(base, **overrides))
        rows += [adapter_row(name, r) for r in report["results"]]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profiles-dir", default="profiles")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    rows = run(args.duration, args.seed, args.profiles_dir)
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
