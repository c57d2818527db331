"""Prometheus metrics for every service, read from the pure stats objects at scrape time.

Services keep their counters in plain dataclasses (unit-tested without Prometheus); a
``SnapshotCollector`` turns a ``snapshot() -> dict`` into metric families when Prometheus scrapes:
a number ``{"steps": 5}`` becomes ``<prefix>_steps 5``; one level of nesting
``{"jobs": {"done": 2}}`` becomes ``<prefix>_jobs{key="done"} 2``. A key the stats object declares
a counter (its ``COUNTERS``: a count that only grows, such as steps or jobs by status) or one ending
in ``_total`` is exported as a counter (``# TYPE <prefix>_<key> counter``, the sample named
``<prefix>_<key>_total``); every other key as a gauge.

The job latency histogram (``maskserve_job_latency_seconds{model, status, kind}``: seconds from a
job's submission to its terminal status) is observed in Redis by the one Lua script that applies
that status (``job_latency_lua``, run by ``backend.jobstate``): a terminal status is applied once
per job whichever process writes it (the CPU worker's post-processing, a failure anywhere, a
cancel), so each job is counted exactly once, and the counts of every process add up in one place.
``JobLatencyCollector`` exposes them (the API's ``/metrics``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection, Iterator, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from backend.protocol.keys import NAMESPACE
from backend.protocol.wire import to_text

log = logging.getLogger(__name__)
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(prefix: str, key: str) -> str:
    return _INVALID.sub("_", f"{prefix}_{key}")


class SnapshotCollector(Collector):
    """``snapshot()``'s numbers as metric families; ``counters``: the keys that only grow."""

    def __init__(
        self, prefix: str, snapshot: Callable[[], dict], counters: Collection[str] = frozenset()
    ):
        self.prefix, self.snapshot, self.counters = prefix, snapshot, frozenset(counters)

    def collect(self) -> Iterator:
        for key, value in self.snapshot().items():
            name = _metric_name(self.prefix, key)
            counter = key in self.counters or name.endswith("_total")
            family_type = CounterMetricFamily if counter else GaugeMetricFamily
            family_name = name.removesuffix("_total") if counter else name
            if isinstance(value, dict):
                family = family_type(family_name, f"{key} by key", labels=["key"])
                for label, number in value.items():
                    if isinstance(number, (int, float)):
                        family.add_metric([str(label)], float(number))
                yield family
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                family = family_type(family_name, key)
                family.add_metric([], float(value))
                yield family


def make_registry(
    collectors: dict[str, Callable[[], dict]],
    counters: Mapping[str, Collection[str]] | None = None,
) -> CollectorRegistry:
    """A registry of one ``SnapshotCollector`` per prefix; ``counters``: prefix -> the keys of its
    snapshot that are counters (the stats class's ``COUNTERS``)."""
    registry = CollectorRegistry()
    for prefix, snapshot in collectors.items():
        registry.register(SnapshotCollector(prefix, snapshot, (counters or {}).get(prefix, ())))
    return registry


# ----- job latency: submission to terminal status ------------------------------------------------
JOB_LATENCY = "maskserve_job_latency_seconds"
JOB_LATENCY_KEY = f"{NAMESPACE}:stats:job_latency"  # hash: '<labels json>|<le, sum or count>'
# upper bounds in seconds: a tiny model's edit (0.1 s) to a queued full-size one (10 min)
JOB_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_LATENCY_LABELS = ("model", "status", "kind")


def job_latency_lua(job_hash: str, status: str, terminal: str) -> str:
    """Lua counting a job's latency (``updated_at`` of its terminal event minus ``created_at``)
    in ``JOB_LATENCY_KEY`` when ``terminal`` (a Lua condition) holds; ``job_hash`` and ``status``
    are the script's expressions for the job's hash key and its new status. Part of the script that
    applies the status (``backend.jobstate``), so it runs once per job, atomically with it (the
    stats hash is a fixed key: one Redis, no cluster)."""
    bounds = json.dumps([str(bound) for bound in JOB_LATENCY_BUCKETS])
    return f"""
if {terminal} then
  local created = tonumber(redis.call('HGET', {job_hash}, 'created_at') or '')
  local ended = tonumber(redis.call('HGET', {job_hash}, 'updated_at') or '')
  if created and ended and created > 0 then
    local seconds = math.max(0, ended - created)
    local labels = cjson.encode({{redis.call('HGET', {job_hash}, 'model_id') or '', {status},
                                  redis.call('HGET', {job_hash}, 'kind') or ''}})
    redis.call('HINCRBY', '{JOB_LATENCY_KEY}', labels .. '|count', 1)
    redis.call('HINCRBYFLOAT', '{JOB_LATENCY_KEY}', labels .. '|sum', seconds)
    for _, bound in ipairs(cjson.decode('{bounds}')) do
      if seconds <= tonumber(bound) then
        redis.call('HINCRBY', '{JOB_LATENCY_KEY}', labels .. '|' .. bound, 1)
      end
    end
  end
end
"""


def job_latency_counts(client) -> dict[tuple[str, ...], dict[str, float]]:
    """(model, status, kind) -> {"count", "sum", "<bound>": jobs at most that long} from Redis."""
    series: dict[tuple[str, ...], dict[str, float]] = {}
    for field_name, value in client.hgetall(JOB_LATENCY_KEY).items():
        labels, _, part = to_text(field_name).rpartition("|")
        try:
            key = tuple(str(label) for label in json.loads(labels))
        except ValueError:
            continue
        if len(key) == len(_LATENCY_LABELS):
            series.setdefault(key, {})[part] = float(to_text(value))
    return series


class JobLatencyCollector(Collector):
    """``maskserve_job_latency_seconds{model, status, kind}``, a histogram read from Redis at
    scrape time (cluster-wide: every API process shows the same counts; scrape one)."""

    def __init__(self, client):
        self.client = client

    def collect(self) -> Iterator:
        family = HistogramMetricFamily(
            JOB_LATENCY,
            "Seconds from a job's submission to its terminal status (done, failed, cancelled)",
            labels=list(_LATENCY_LABELS),
        )
        try:
            series = job_latency_counts(self.client)
        except Exception as exc:  # Redis down: the other metrics are still served
            log.warning("job latency not collected: %s", exc)
            series = {}
        for labels, parts in sorted(series.items()):
            buckets = [(str(bound), parts.get(str(bound), 0.0)) for bound in JOB_LATENCY_BUCKETS]
            buckets.append(("+Inf", parts.get("count", 0.0)))
            family.add_metric(list(labels), buckets, parts.get("sum", 0.0))
        yield family


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "127.0.0.1", fallback=False):
    """Expose ``/metrics`` on ``host:port`` from a daemon thread; returns the HTTP server, or None
    when nothing is served: port 0, or a port that cannot be bound (logged as an error: the process
    keeps doing its work without metrics). ``fallback``: port 0 or a port that cannot be bound
    gives a free port instead (``maskserve up``'s own). ``host`` is ``settings.metrics_host``:
    loopback unless the operator chose otherwise (the library's own default is every interface).
    The log names the address truly bound."""
    if not port and not fallback:
        return None
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if not fallback:
            log.error("metrics not served: cannot listen on %s:%d (%s)", host, port, exc)
            return None
        log.warning("metrics port %d on %s unavailable (%s): a free one instead", port, host, exc)
        server, _thread = start_http_server(0, addr=host, registry=registry)
    bound_host, bound_port = server.server_address[:2]
    log.info(
        "metrics on http://%s:%d/metrics",
        bound_host,
        bound_port,
        extra={"fields": {"metrics_host": bound_host, "metrics_port": bound_port}},
    )
    return server
