"""docker-compose.yml and the Dockerfile, checked against the code they run (no Docker engine here):
every command parses with the real `maskserve` argument parser, every MASKSERVE_* variable is one
backend/config.py reads (and its value validates), Redis and the object store come first, each role
has its own volume (nothing shared but Redis and the bucket), and the image pins torch exactly as
the Makefile does."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from backend import cli
from backend.config import env_variable_names, load_settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
MASKSERVE = {
    name: service
    for name, service in SERVICES.items()
    if service.get("command", [""])[0] == "maskserve"
}
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")


def parse_command(service: dict):
    """The argparse namespace of a service's command, from the real parser (fails the test on
    error)."""
    try:
        return cli.build_parser().parse_args(service["command"][1:])
    except SystemExit:
        pytest.fail(f"`{' '.join(service['command'])}` is not accepted by the maskserve parser")


def role_of(args) -> str | None:
    """The long-running role a parsed command starts; None for one-shot commands (no place in a
    stack)."""
    return args.role if args.func is cli.cmd_role else None


def container_env(service: dict) -> dict[str, str]:
    """The service's environment as the container gets it, compose interpolation resolved: a default
    for ``${VAR:-default}``, a placeholder for a required ``${VAR:?message}``."""

    def resolve(match: re.Match) -> str:
        return "placeholder" if match.group(2) == "?" else (match.group(3) or "")

    return {
        name: _INTERPOLATION.sub(resolve, str(value))
        for name, value in service.get("environment", {}).items()
    }


def test_the_stack_runs_every_role_and_one_cpu_engine_worker_by_default():
    roles = {name: role_of(parse_command(service)) for name, service in MASKSERVE.items()}
    assert None not in roles.values(), roles
    default = {name: role for name, role in roles.items() if not MASKSERVE[name].get("profiles")}
    assert sorted(default.values()) == ["api", "cpu-worker", "dispatcher", "worker"]
    (worker,) = [name for name, role in default.items() if role == "worker"]
    args = parse_command(MASKSERVE[worker])
    settings = load_settings(container_env(MASKSERVE[worker]), **args.overrides(args))
    assert settings.engine.device == "cpu" and settings.engine.model_id.startswith("tiny-")
    assert "redis" in SERVICES and "redis-server" in SERVICES["redis"]["command"]


def test_the_gpu_worker_is_profile_gated_and_reserves_an_nvidia_device():
    gpu = MASKSERVE["worker-gpu"]
    args = parse_command(gpu)
    assert gpu["profiles"] == ["gpu"] and role_of(args) == "worker" and args.device == "cuda:0"
    assert load_settings(container_env(gpu), **args.overrides(args)).engine.device == "cuda:0"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "cu" in gpu["build"]["args"]["TORCH_INDEX_URL"]  # a CUDA build of torch in its image
    ids = [
        parse_command(s).worker_id
        for s in MASKSERVE.values()
        if role_of(parse_command(s)) == "worker"
    ]
    assert len(set(ids)) == len(ids)  # heartbeats and inboxes are per worker id


@pytest.mark.parametrize("name", sorted(MASKSERVE))
def test_every_variable_is_one_config_reads_and_its_value_validates(name):
    env = container_env(MASKSERVE[name])
    unknown = sorted(
        var for var in env if var.startswith("MASKSERVE_") and var not in env_variable_names()
    )
    assert unknown == [], f"{name} sets variables backend/config.py never reads: {unknown}"
    args = parse_command(MASKSERVE[name])
    # raises when invalid
    load_settings(env, **(args.overrides(args) if hasattr(args, "overrides") else {}))


@pytest.mark.parametrize("name", sorted(MASKSERVE))
def test_every_role_shares_only_redis_and_the_object_store_and_keeps_its_own_volume(name):
    service, env = MASKSERVE[name], container_env(MASKSERVE[name])
    assert urlparse(env["MASKSERVE_REDIS_URL"]).hostname in SERVICES
    assert (
        service["depends_on"]["redis"]["condition"] == "service_healthy"
        and SERVICES["redis"]["healthcheck"]
    )
    settings = load_settings(env)
    bucket = urlparse(settings.paths.blob_url)
    assert bucket.scheme == "s3" and urlparse(settings.paths.s3_endpoint_url).hostname in SERVICES
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]  # boto3 reads them
    # the bucket exists before a role starts: the init service made it
    init = service["depends_on"]["minio-init"]
    assert init["condition"] == "service_completed_successfully"
    assert f"store/{bucket.hostname}" in " ".join(SERVICES["minio-init"]["command"])
    (mount,) = service["volumes"]
    volume, _, path = mount.partition(":")
    assert path.split()[0] == env["MASKSERVE_DATA_DIR"] and volume in COMPOSE["volumes"]
    others = [v for other, s in MASKSERVE.items() if other != name for v in s["volumes"]]
    assert all(not other.startswith(f"{volume}:") for other in others), "a shared volume"


ONE_SHOT = {"minio-init"}  # creates the bucket and exits; the roles wait for it


@pytest.mark.parametrize("name", sorted(set(SERVICES) - ONE_SHOT))
def test_every_service_is_restarted_when_it_exits_until_an_operator_stops_it(name):
    # the engine worker, dispatcher, API and Celery reconnect to a restarted Redis on their own;
    # a process that exits (a crash, an OOM kill) is Docker's to restart
    assert SERVICES[name].get("restart") == "unless-stopped"


def test_the_api_listens_on_every_interface_of_its_container_behind_the_published_port():
    api = MASKSERVE["api"]
    settings = load_settings(container_env(api))
    assert settings.api.host == "0.0.0.0" and settings.api.api_keys  # keys are required to start
    assert [port.rsplit(":", 1)[1] for port in api["ports"]] == [str(settings.api.port)]
    assert "/readyz" in " ".join(api["healthcheck"]["test"])


def test_the_image_pins_torch_as_the_makefile_does():
    makefile, dockerfile = (ROOT / "Makefile").read_text(), (ROOT / "Dockerfile").read_text()
    (pin,) = set(re.findall(r'pip install [^\n]*"(torch==[\w.+]+)"', makefile))
    installs = [line for line in dockerfile.splitlines() if line.startswith("RUN pip install")]
    # torch before the project
    assert f'"{pin}"' in installs[0] and installs[-1] == "RUN pip install ."
    env_lines = re.findall(r"\b(MASKSERVE_\w+)=", dockerfile)
    assert env_lines and set(env_lines) <= env_variable_names()
    for copied in ("backend", "studio", "templates_store", "profiles"):
        assert f"COPY {copied} {copied}" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    # a build context without the environment
    assert {".venv", ".maskserve", ".git"} <= set(ignored)
