"""Resident memory of each role of `maskserve up`, each constructed in a fresh process.

``python -m backend.bench.role_memory --model small-flux-fill --label after --json FILE`` starts
every role in its own subprocess the way its command builds it (engine worker: ``build_worker``
in continuous and in inline batching; CPU worker: a Celery child after the warm-up that loads its
CPU stages; dispatcher: ``Dispatcher`` with its router; API: ``create_app`` without and with the
studio), reads ``VmRSS`` (and the peak, ``VmHWM``) from ``/proc/self/status`` once construction
returned, and records the median of ``--repeats`` processes under ``--label`` in FILE (other
labels in FILE are kept, so one file holds a before and an after). It prints the table of every
label in FILE.

``--repo DIR`` measures another checkout of MaskServe (e.g. an older commit in a git worktree):
the children import ``backend`` from DIR, and this file itself imports nothing of ``backend`` at
module level, so only what the roles' own construction names has to exist there
(``build_worker``, ``make_celery`` with its ``warm-stages`` thread, ``Dispatcher``,
``create_app``). The model is built by DIR's own code, under a models directory of the run.

One embedded Redis server (``backend.services.redis_server``) serves every child: the dispatcher
creates its consumer group when built; the other roles only hold clients.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROLES = (
    "engine-worker",
    "engine-worker-inline",
    "cpu-worker",
    "dispatcher",
    "api",
    "api+studio",
)
RESULT_PREFIX = "ROLE-MEMORY "  # marks the child's result line on its stdout
MIB = 1 << 20
WARM_THREAD = "warm-stages"  # the thread a Celery child builds its CPU stages in


# ----- child side: runs inside the measured checkout ------------------------------------------
def _settings():
    from backend.config import load_settings

    return load_settings()


def _engine_worker() -> object:
    from redis import Redis

    from backend.worker.service import build_worker

    settings = _settings()
    return build_worker(settings, Redis.from_url(settings.redis.url))


def _cpu_worker() -> object:
    """A Celery prefork child once ``worker_process_init`` fired and its warm-up finished."""
    import logging
    import threading

    from celery.signals import worker_process_init

    from backend.tasks.celery_app import make_celery

    failures: list[str] = []

    class _Failures(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            failures.append(record.getMessage())

    logging.getLogger("backend.tasks.celery_app").addHandler(_Failures(logging.WARNING))
    app = make_celery(_settings())  # its warm-up keeps the CPU stages it builds
    worker_process_init.send(sender=None)
    for thread in threading.enumerate():
        if thread.name == WARM_THREAD:
            thread.join()
    if failures:
        raise RuntimeError(f"the CPU stages did not build: {failures}")
    return app


def _dispatcher() -> object:
    from redis import Redis

    from backend.dispatch.service import Dispatcher

    settings = _settings()
    return Dispatcher(settings, Redis.from_url(settings.redis.url))


def _api() -> object:
    from backend.api.app import create_app

    return create_app(_settings())


def _materialize() -> object:
    from backend.models import materialize

    settings = _settings()
    return materialize(settings.engine.model_id, settings.paths.resolved_models_dir())


CONSTRUCTORS = {
    "engine-worker": _engine_worker,
    "engine-worker-inline": _engine_worker,
    "cpu-worker": _cpu_worker,
    "dispatcher": _dispatcher,
    "api": _api,
    "api+studio": _api,
    "materialize": _materialize,
}
ROLE_ENV = {
    "engine-worker": {"MASKSERVE_BATCHING": "continuous"},
    "engine-worker-inline": {"MASKSERVE_BATCHING": "inline"},
    "api": {"MASKSERVE_STUDIO": "0"},
    "api+studio": {"MASKSERVE_STUDIO": "1"},
}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_child(role: str) -> None:
    """Construct ``role``, then print its memory as one JSON line. What the role built stays
    referenced until then (as in the running role); the process exits at once after that:
    threads a role started (cache readers, heartbeats) must not keep it alive."""
    import gc

    started = time.perf_counter()
    built = CONSTRUCTORS[role]()
    gc.collect()
    import backend

    result = {
        "rss_kib": _status_kib("VmRSS"),
        "hwm_kib": _status_kib("VmHWM"),
        "build_s": round(time.perf_counter() - started, 2),
        "built": type(built).__name__,
        "torch_imported": "torch" in sys.modules,
        "backend": str(Path(backend.__file__).parent),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    os._exit(0)


# ----- parent side ----------------------------------------------------------------------------
def _child_env(repo: Path, data_dir: Path, model: str, redis_url: str, role: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASKSERVE_")}
    env.update(
        PYTHONPATH=str(repo),
        MASKSERVE_DATA_DIR=str(data_dir),
        MASKSERVE_MODELS_DIR=str(data_dir / "models"),
        MASKSERVE_MODEL=model,
        MASKSERVE_DEVICE="cpu",
        MASKSERVE_CELERY_DEVICE="cpu",
        MASKSERVE_REDIS_URL=redis_url,
        MASKSERVE_API_KEYS="role-memory",
        MASKSERVE_LOG_LEVEL="WARNING",
    )
    env.update(ROLE_ENV.get(role, {}))
    return env


def measure_once(repo: Path, data_dir: Path, model: str, redis_url: str, role: str) -> dict:
    """Run one child for ``role`` in ``repo``; its result line as a dict."""
    # -P: no script directory on sys.path (backend/bench's modules must not shadow the stdlib)
    command = [sys.executable, "-P", str(Path(__file__).resolve()), "--child", role]
    done = subprocess.run(
        command,
        cwd=repo,
        env=_child_env(repo, data_dir, model, redis_url, role),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{role} in {repo} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def _revision(repo: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True
        ).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+uncommitted" if git("status", "--porcelain", "--untracked-files=no") else "")


def measure_roles(
    repo: Path, model: str, roles: list[str], repeats: int, redis_url: str, data_dir: Path
) -> dict:
    """Median memory of each role over ``repeats`` fresh processes, after the model is built."""
    measure_once(repo, data_dir, model, redis_url, "materialize")
    results = {}
    for role in roles:
        samples = [measure_once(repo, data_dir, model, redis_url, role) for _ in range(repeats)]
        results[role] = {
            "rss_mib": round(statistics.median(s["rss_kib"] for s in samples) / 1024, 1),
            "hwm_mib": round(statistics.median(s["hwm_kib"] for s in samples) / 1024, 1),
            "torch_imported": samples[0]["torch_imported"],
            "samples_rss_mib": [round(s["rss_kib"] / 1024, 1) for s in samples],
            "backend": samples[0]["backend"],
        }
        print(f"{role}: {results[role]['rss_mib']} MiB", file=sys.stderr)
    return results


def table(report: dict) -> str:
    """Markdown: one row per role, a resident MiB column per label (peak in brackets)."""
    labels = list(report["runs"])
    header = "| role | " + " | ".join(f"{label} MiB (peak)" for label in labels) + " |"
    rows = [header, "| --- |" + " ---: |" * len(labels)]
    roles = [r for r in ROLES if any(r in run["roles"] for run in report["runs"].values())]
    for role in roles:
        cells = []
        for label in labels:
            entry = report["runs"][label]["roles"].get(role)
            cells.append(f"{entry['rss_mib']:.0f} ({entry['hwm_mib']:.0f})" if entry else "-")
        rows.append(f"| {role} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-flux-fill")
    parser.add_argument("--label", default="after", help="the run's name in the JSON report")
    parser.add_argument("--json", required=True, help="report file (other labels in it are kept)")
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[2]))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--roles", default=",".join(ROLES), help="comma-separated subset")
    args = parser.parse_args(argv)
    roles = args.roles.split(",")
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        parser.error(f"unknown roles {unknown}: use {', '.join(ROLES)}")
    from backend.services.redis_server import RedisServer

    repo = Path(args.repo).resolve()
    with tempfile.TemporaryDirectory(prefix="role-memory-") as scratch:
        with RedisServer(Path(scratch) / "redis", appendonly=False) as server:
            results = measure_roles(
                repo, args.model, roles, args.repeats, server.url, Path(scratch) / "data"
            )
    path = Path(args.json)
    report = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    if report.get("model", args.model) != args.model:
        raise SystemExit(f"{path} holds figures of {report['model']}: use another --json")
    report["model"] = args.model
    report["runs"][args.label] = {
        "revision": _revision(repo),
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "repeats": args.repeats,
        "roles": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        run_child(sys.argv[2])
    sys.exit(main())
