"""deploy/compose.yaml describes the single node correctly (parsed with compose-spec, as no
Docker engine runs here): persistent Redis, the services, a worker holding the GPUs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import compose_spec
import pytest
import yaml

from opentinker.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.yaml"
pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def compose() -> compose_spec.PyCompose:
    return compose_spec.PyCompose.from_yaml(COMPOSE.read_text())


def test_it_parses_and_has_the_single_node_services(compose) -> None:
    assert compose.validate() is None
    compose.to_spec()  # full schema validation
    assert set(compose.service_names()) == {
        "redis",
        "scheduler",
        "envhub",
        "worker",
        "dashboard",
        "tinker-gateway",
    }


def test_redis_persists_to_a_volume(compose) -> None:
    redis = compose.services["redis"]
    assert "--appendonly" in redis.command and "yes" in redis.command
    command = list(redis.command)  # a restart, even a SIGKILL, loses no acknowledged write
    assert command[command.index("--appendfsync") + 1] == "always"
    assert any(str(v).endswith(":/data") or "/data" in str(v) for v in redis.volumes)
    assert redis.healthcheck is not None


def test_worker_reserves_the_gpus(compose) -> None:
    devices = compose.services["worker"].deploy.resources.reservations.devices
    assert devices and devices[0].driver == "nvidia" and "gpu" in devices[0].capabilities


def test_the_workers_compile_caches_outlive_its_container(compose) -> None:
    """vLLM's compile cache and Triton's kernels lie on a named volume: a new container's
    first job does not compile them again (minutes of a GPU job's start)."""
    worker = compose.services["worker"]
    mounts = [
        str(v).split(":")[1] for v in worker.volumes if str(v).split(":")[0] in compose.volumes
    ]
    for variable in ("XDG_CACHE_HOME", "TRITON_CACHE_DIR", "HF_HOME"):
        path = worker.environment[variable]
        assert any(path.startswith(mount + "/") for mount in mounts), (variable, path, mounts)


def test_one_image_built_once_runs_every_service_as_a_real_cli_command(compose) -> None:
    """Five identical `build:` sections built the same image five times (issue 35): one entry
    builds it, the others name it and never try to pull it."""
    parser = build_parser()
    ours = ("scheduler", "envhub", "worker", "dashboard", "tinker-gateway")
    builders = [name for name in ours if compose.services[name].build is not None]
    assert builders == ["scheduler"], builders
    build = compose.services["scheduler"].build
    dockerfile = (COMPOSE.parent / build.context / build.dockerfile).resolve()
    assert dockerfile.is_file(), dockerfile
    image = compose.services["scheduler"].image
    for name in ours:
        service = compose.services[name]
        assert service.image == image, name
        if name != "scheduler":
            assert str(service.pull_policy).endswith("never"), (name, service.pull_policy)
        args = parser.parse_args(list(service.command))
        assert args.command == "serve" and args.service == name
    assert (
        compose.services["scheduler"]
        .environment["OPENTINKER_REDIS_URL"]
        .startswith("redis://redis:")
    )
    assert (
        compose.services["worker"].environment["OPENTINKER_SCHEDULER_ADDRESS"] == "scheduler:50051"
    )


def test_dockerfile_copies_what_the_package_needs() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    for folder in ("protos", "sdk", "services", "pyproject.toml"):
        assert folder in text
    assert 'ENTRYPOINT ["opentinker"]' in text


def test_the_dependencies_are_installed_before_our_code_is_copied_in() -> None:
    """A change to our Python files must not reinstall torch: the dependency layer comes from
    pyproject.toml alone (deploy/requirements.py), before the first COPY of our code."""
    lines = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    deps = next(i for i, line in enumerate(lines) if "pip install -r requirements.txt" in line)
    code = min(i for i, line in enumerate(lines) if re.match(r"COPY (sdk|services|protos)", line))
    assert deps < code
    assert any("pip install --no-deps ." in line for line in lines[code:])
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        from requirements import requirements
    finally:
        sys.path.pop(0)
    listed = requirements(str(ROOT / "pyproject.toml"), "server,vllm")
    assert any(r.startswith("torch") for r in listed) and any(r.startswith("vllm") for r in listed)
    assert any(r.startswith("grpcio") for r in listed)  # the base dependencies too
    with pytest.raises(SystemExit, match="unknown extras"):
        requirements(str(ROOT / "pyproject.toml"), "server,nope")


def test_every_setting_in_compose_is_one_the_service_reads(compose) -> None:
    """No variable in compose.yaml is silently ignored: each names a field of the settings."""
    from opentinker.services.envhub.settings import EnvHubSettings
    from opentinker.services.gateway.settings import GatewaySettings
    from opentinker.services.scheduler.settings import SchedulerSettings
    from opentinker.services.worker.settings import WorkerSettings

    settings = {
        "scheduler": SchedulerSettings,
        "envhub": EnvHubSettings,
        "worker": WorkerSettings,
        "tinker-gateway": GatewaySettings,
    }
    for name, cls in settings.items():
        env = compose.services[name].environment
        prefix = cls.model_config["env_prefix"].upper()
        ours = [k for k in env if k.startswith(prefix)]
        assert ours, name
        for key in ours:
            field = key.removeprefix(prefix).lower()
            assert field in cls.model_fields, f"{name}: {key} is not a {cls.__name__} field"


def test_the_worker_reads_only_its_token_and_ports_stay_local(compose) -> None:
    """First start needs no person: the scheduler bootstraps its admin key into the `identity`
    volume and a worker token into `worker-identity`; the worker mounts only the latter
    (read-only), so neither it nor a job process can read the admin key or the auth secret."""
    scheduler, worker = compose.services["scheduler"], compose.services["worker"]
    bootstrap = scheduler.environment["OPENTINKER_BOOTSTRAP_DIR"]
    token_dir = scheduler.environment["OPENTINKER_WORKER_TOKEN_DIR"]
    assert worker.environment["OPENTINKER_WORKER_TOKEN_FILE"] == f"{token_dir}/worker.token"
    assert f"identity:{bootstrap}" in [str(v) for v in scheduler.volumes]
    assert f"worker-identity:{token_dir}" in [str(v) for v in scheduler.volumes]
    assert [str(v) for v in worker.volumes if "identity" in str(v)] == [
        f"worker-identity:{token_dir}:ro"
    ]
    assert scheduler.environment["OPENTINKER_AUTH_SECRET_FILE"].startswith(bootstrap + "/")
    for name, service in compose.services.items():
        mounted = [str(v).split(":")[0] for v in service.volumes or ()]
        assert name == "scheduler" or "identity" not in mounted, f"{name} mounts identity"
    assert compose.services["envhub"].environment["OPENTINKER_SCHEDULER_ADDRESS"]
    for name in ("scheduler", "envhub", "tinker-gateway"):
        assert all(str(p).startswith("127.0.0.1:") for p in compose.services[name].ports), name


def _owned_folders(dockerfile: str) -> tuple[str, set[str]]:
    """The image's USER and the folders its RUN lines make with mkdir and chown to that user."""
    user = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.MULTILINE)[-1]
    run = dockerfile.replace("\\\n", " ")
    made = {p for args in re.findall(r"mkdir\s+-p\s+([^&;\n]+)", run) for p in args.split()}
    owned = {
        p for args in re.findall(rf"chown\s+(?:-R\s+)?{user}\S*\s+([^&;\n]+)", run)
        for p in args.split()
    }  # fmt: skip
    return user, made & owned


def test_the_services_can_write_their_named_volumes(compose) -> None:
    """A new named volume takes the owner of its mount point in the image, root where the image
    has no such folder: the image's services run as a user of their own, so each folder they
    mount a writable volume on must exist in the image, owned by that user (else the scheduler
    cannot write its bootstrap credentials and restarts for ever)."""
    user, owned = _owned_folders((ROOT / "deploy" / "Dockerfile").read_text())
    ours = compose.services["scheduler"].image
    for name, service in compose.services.items():
        if service.image != ours:  # another image (redis): its own user and folders
            continue
        for volume in service.volumes or ():
            source, target, *mode = str(volume).split(":")
            if source in compose.volumes and mode != ["ro"]:
                assert target in owned, f"{name}: {target} is not made and owned by {user}"


def _seconds(duration: str) -> float:
    """A compose duration ('1m30s', '45s') in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_the_worker_has_time_to_stop_its_jobs_before_docker_kills_it(compose) -> None:
    """On SIGTERM the agent stops its jobs (trainer, then rollout, each up to stop_grace_s)
    and only then says it closes (its send and the scheduler's answer, up to connect_timeout_s
    each); Docker SIGKILLs it after stop_grace_period (10 s unless set), before that `closing`."""
    from opentinker.services.worker.settings import WorkerSettings

    fields = WorkerSettings.model_fields
    stop_grace_s = fields["stop_grace_s"].default
    connect_timeout_s = fields["connect_timeout_s"].default
    period = compose.services["worker"].stop_grace_period
    assert period is not None, "worker: no stop_grace_period (Docker's 10 s)"
    assert _seconds(period) >= 2 * stop_grace_s + 2 * connect_timeout_s, period


def test_the_gateways_signing_key_is_in_a_volume_only_the_gateway_mounts(compose) -> None:
    """The download-signing secret lay in the `runs` volume the worker mounts read-write, so
    every job's processes could read it and sign download URLs for any file."""
    gateway = compose.services["tinker-gateway"]
    secret = Path(gateway.environment["OPENTINKER_GATEWAY_DOWNLOAD_SECRET_FILE"])
    mounts = {
        name: {str(v).split(":")[1]: str(v).split(":")[0] for v in service.volumes or ()}
        for name, service in compose.services.items()
    }
    [(target, volume)] = [(t, v) for t, v in mounts["tinker-gateway"].items()
                          if secret.is_relative_to(t)]  # fmt: skip
    assert volume != "runs"
    others = {
        name for name, m in mounts.items() if name != "tinker-gateway" and volume in m.values()
    }
    assert not others, f"{volume} is also mounted by {others}"


class _Reset:
    """compose's `!reset` tag: the override removes the key."""


def _load_override(path: Path) -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: _Reset())
    return yaml.load(path.read_text(), Loader=Loader)


def _merged(base: dict, override: dict) -> dict:
    """compose's merge of mappings: keys of the override win, mappings merge, !reset removes."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, _Reset):
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def test_the_cpu_override_runs_the_stack_without_gpus_or_vllm() -> None:
    """A machine without GPUs runs the stack with a documented override, not a hand edit
    (issue 35: the worker's GPU reservation had to be deleted by hand)."""
    from opentinker.services.worker.settings import WorkerSettings

    base = yaml.safe_load(COMPOSE.read_text())
    override = _load_override(COMPOSE.parent / "compose.cpu.yaml")
    merged = _merged(base, override)
    spec = compose_spec.PyCompose.from_yaml(yaml.safe_dump(merged))
    assert spec.validate() is None
    spec.to_spec()
    worker = merged["services"]["worker"]
    assert "deploy" not in worker, "the CPU worker still reserves GPUs"
    assert "deploy" in base["services"]["worker"]  # and the GPU file still does
    assert "vllm" not in merged["services"]["scheduler"]["build"]["args"]["EXTRAS"]
    for key in worker["environment"]:
        if key.startswith("OPENTINKER_"):
            assert key.removeprefix("OPENTINKER_").lower() in WorkerSettings.model_fields, key
