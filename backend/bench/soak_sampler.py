"""What a soak samples once a period: each role's processes, Redis, the data directory's disk.

Every reading is a flat ``{metric name: value}`` dict whose names are ``<group>/<name>/<kind>``
(the kinds are those of ``backend.bench.soak_verdict``):

* ``role/<role>/rss_bytes`` and ``role/<role>/open_files``: summed over the role's process and
  all its descendants (a Celery worker's pool children, a Redis the API would start), except a
  Redis server's persistence forks (``PERSISTENCE_FORKS``: a BGSAVE or AOF rewrite child lives
  for the save, shares the server's memory copy-on-write and holds copies of its descriptors, so
  counting it doubled both for one sample and read as a leak);
* ``redis/...``: ``INFO`` ``used_memory`` and the key count; keys with a TTL (``volatile``: job
  records, their event streams, hand-off markers, rate buckets) are bounded by their TTL times the
  job rate, so they are reported as a count and a mean size per key (MEMORY USAGE of a random
  sample); keys without a TTL (``persistent``: streams, the worker list, histories) can only be
  bounded by the code that writes them, so their count and exact total size are reported; what
  ``used_memory`` holds beyond both estimates is ``overhead``;
* ``disk/<part>/disk_bytes``: bytes under each part of the data directory (blobs, template cache,
  Redis AOF/RDB, logs) and in total.

The readers tolerate processes that exit between listing and reading (a role restarted by its
supervisor): they count what they could read.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import psutil
from redis import Redis

VOLATILE_SAMPLE = 64  # volatile keys whose MEMORY USAGE is read each period
SCAN_COUNT = 1000
# process titles a Redis server gives the children it forks to save (its argv[0] starts with one)
PERSISTENCE_FORKS = ("redis-rdb-bgsave", "redis-aof-rewrite", "redis-rdb-to-slaves")


def process_tree(pid: int) -> tuple[int, int, int]:
    """``(rss bytes, open file descriptors, processes)`` of ``pid`` and its descendants but Redis
    persistence forks; zeros when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
        members = [root, *(p for p in root.children(recursive=True) if not _persistence_fork(p))]
    except psutil.Error:
        return 0, 0, 0
    rss = fds = count = 0
    for process in members:
        try:
            with process.oneshot():
                rss += process.memory_info().rss
                fds += process.num_fds()
            count += 1
        except psutil.Error:  # exited meanwhile
            continue
    return rss, fds, count


def _persistence_fork(process: psutil.Process) -> bool:
    """Whether ``process`` is a Redis server's save child (by its title); False when it is gone."""
    try:
        command = process.cmdline()
    except psutil.Error:
        return False
    return bool(command) and command[0].startswith(PERSISTENCE_FORKS)


def sample_roles(pids: dict[str, int]) -> dict[str, float]:
    """The process readings of every role (role name -> its top process id)."""
    reading: dict[str, float] = {}
    for role, pid in sorted(pids.items()):
        rss, fds, count = process_tree(pid)
        reading[f"role/{role}/rss_bytes"] = rss
        reading[f"role/{role}/open_files"] = fds
        reading[f"role/{role}/processes"] = count
    return reading


def sample_redis(client: Redis, rng: random.Random) -> dict[str, float]:
    """Redis memory and keys, split into volatile (TTL) and persistent keys (see the module)."""
    used = int(client.info("memory")["used_memory"])
    keys = list(client.scan_iter(count=SCAN_COUNT))
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.pttl(key)
        ttls = pipe.execute()
    # -2: expired since the scan; -1: no TTL
    persistent = [k for k, ttl in zip(keys, ttls) if ttl == -1]
    volatile = [k for k, ttl in zip(keys, ttls) if ttl >= 0]
    persistent_bytes = sum(_memory_usage(client, persistent))
    sampled = _memory_usage(client, rng.sample(volatile, min(VOLATILE_SAMPLE, len(volatile))))
    per_key = sum(sampled) / len(sampled) if sampled else 0.0
    return {
        "redis/all/redis_memory_bytes": used,
        "redis/all/redis_keys": len(persistent) + len(volatile),
        "redis/persistent/redis_keys": len(persistent),
        "redis/persistent/redis_memory_bytes": persistent_bytes,
        "redis/volatile/redis_keys": len(volatile),
        "redis/volatile/bytes_per_job": per_key,
        "redis/overhead/redis_memory_bytes": used - persistent_bytes - per_key * len(volatile),
    }


def _memory_usage(client: Redis, keys: list) -> list[int]:
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.memory_usage(key, samples=0)
        return [size for size in pipe.execute() if size is not None]


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 when absent); files removed while walking are
    skipped."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def disk_parts(data_dir: Path, cache_dir: Path) -> dict[str, Path]:
    """The parts of a data directory a soak watches, by name."""
    return {
        "blobs": data_dir / "blobs",
        "template_cache": cache_dir,
        "redis": data_dir / "redis",
        "logs": data_dir / "logs",
    }


def sample_disk(parts: dict[str, Path], data_dir: Path) -> dict[str, float]:
    """Bytes under each part and under the whole data directory (models excluded: built once)."""
    reading: dict[str, float] = {f"disk/{n}/disk_bytes": dir_bytes(p) for n, p in parts.items()}
    models = data_dir / "models"
    reading["disk/total/disk_bytes"] = dir_bytes(data_dir) - dir_bytes(models)
    return reading


ROLE_COMMANDS = ("api", "dispatcher", "worker", "cpu-worker")


def find_role_pids() -> dict[str, int]:
    """Roles running on this machine (``maskserve <role>`` or ``python -m backend.cli <role>``),
    for a soak of a stack it did not start: role name (``<role>-<n>`` in pid order) -> pid.
    A role's own children (Celery's pool) are left to ``process_tree``."""
    found: list[tuple[str, int]] = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = process.info.get("cmdline") or []
        for index, word in enumerate(command[:-1]):
            if word == "backend.cli" or os.path.basename(word) == "maskserve":
                if command[index + 1] in ROLE_COMMANDS:
                    found.append((command[index + 1], process.info["pid"]))
                break
    pids: set[int] = {pid for _, pid in found}
    roles: dict[str, int] = {}
    for role, pid in sorted(found, key=lambda item: item[1]):
        if _parent_pid(pid) in pids:  # a pool child of a role: counted in its parent's tree
            continue
        roles[f"{role}-{sum(name.startswith(role + '-') for name in roles)}"] = pid
    return roles


def _parent_pid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None
