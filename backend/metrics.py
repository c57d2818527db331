"""Prometheus metrics for every service, read from the pure stats objects at scrape time.

Services keep their counters in plain dataclasses (unit-tested without Prometheus); a
``SnapshotCollector`` turns a ``snapshot() -> dict`` into metric families when Prometheus scrapes:
a number ``{"steps": 5}`` becomes ``<prefix>_steps 5``; one level of nesting
``{"jobs": {"done": 2}}`` becomes ``<prefix>_jobs{key="done"} 2``. Names ending in ``_total`` are
exported as counters, everything else as gauges.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(prefix: str, key: str) -> str:
    return _INVALID.sub("_", f"{prefix}_{key}")


class SnapshotCollector(Collector):
    def __init__(self, prefix: str, snapshot: Callable[[], dict]):
        self.prefix, self.snapshot = prefix, snapshot

    def collect(self) -> Iterator:
        for key, value in self.snapshot().items():
            name = _metric_name(self.prefix, key)
            counter = name.endswith("_total")
            family_type = CounterMetricFamily if counter else GaugeMetricFamily
            family_name = name[: -len("_total")] if counter else name
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


def make_registry(collectors: dict[str, Callable[[], dict]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    for prefix, snapshot in collectors.items():
        registry.register(SnapshotCollector(prefix, snapshot))
    return registry


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "127.0.0.1"):
    """Expose ``/metrics`` on ``host:port`` (port 0: do not serve; returns None) from a daemon
    thread; returns the HTTP server. ``host`` is ``settings.metrics_host``: loopback unless the
    operator chose otherwise (the library's own default is every interface)."""
    if not port:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
