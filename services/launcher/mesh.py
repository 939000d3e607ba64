"""The single-node mesh: an embedded Redis (unless a URL is given), the scheduler, EnvHub and
one worker agent, each its own process. The worker starts a trainer and a rollout per job.

    with LocalMesh(MeshSettings(run_root=Path("runs/local"))) as mesh:
        client = opentinker.Client(mesh.scheduler_address)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict, Field

from opentinker.admin import AdminClient
from opentinker.services.common.cores import usable_cores
from opentinker.services.common.launch import write_atomic
from opentinker.services.launcher.local_user import ensure_local_user_key
from opentinker.services.launcher.processes import ServiceProcess
from opentinker.services.launcher.redis_process import RedisProcess
from opentinker.services.scheduler.tenants.bootstrap import ADMIN_KEY_FILE, WORKER_TOKEN_FILE

log = structlog.get_logger()


class MeshSettings(BaseModel):
    """Where the mesh keeps its files and which Redis it uses (None = start one)."""

    model_config = ConfigDict(extra="forbid")

    run_root: Path = Path("runs/local")
    redis_url: str | None = None
    host: str = "127.0.0.1"
    scheduler_port: int = 0  # 0 = any free port (the service binds it and says which)
    envhub_port: int = 0
    # The web dashboard's HTTP port: None = no dashboard, 0 = a free port.
    dashboard_port: int | None = None
    # Jobs the worker runs at once. One per core, at most 4: a job's two processes alternate
    # between CPU-bound work (generate, train) and waiting (env, gRPC, weight sync, the
    # scheduler), so one job per core keeps the cores busy with no job starved below a core on
    # average; more slots than cores only adds contention and memory (each job holds two copies
    # of its model). A 2-core machine gets 2.
    cpu_slots: int = Field(default_factory=lambda: min(4, usable_cores()), ge=1)
    # Warm spare process pairs per recently used base model on the worker (0 = cold starts).
    warm_spares: int = Field(1, ge=0)
    # A spare whose job ended well serves the same tenant's next job (worker spare_reuse).
    spare_reuse: bool = True
    # Jobs may name agent programs: the tenants' code run by the rollout on this machine
    # (RolloutSettings.agent_programs). Also on when OPENTINKER_ROLLOUT_AGENT_PROGRAMS is set.
    agent_programs: bool = False
    # LoRA RL jobs of one base model share one rollout engine on the worker, up to this many
    # (worker/shared_rollouts.py); 0 = each job has its own rollout.
    shared_lora_capacity: int = Field(0, ge=0)
    startup_timeout_s: float = 120.0


class LocalMesh:
    """Starts the processes in dependency order and stops them in reverse."""

    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self.run_root = settings.run_root.resolve()
        self.log_dir = self.run_root / "logs"
        self._stack = contextlib.ExitStack()
        self.processes: list[ServiceProcess] = []
        self.redis_url = settings.redis_url or ""
        self.redis: RedisProcess | None = None  # the embedded one, when the mesh started it
        self.scheduler_address = ""
        self.envhub_address = ""
        self.dashboard_url = ""  # http://host:port/ when the mesh runs a dashboard
        self.secrets_dir = self.run_root / "secrets"
        self.api_key = ""  # the local user's, once started (also in secrets/api.key)

    def __enter__(self) -> LocalMesh:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        s = self.settings
        if not self.redis_url:
            redis = RedisProcess(self.run_root / "redis", start_timeout_s=s.startup_timeout_s)
            self.redis = self._stack.enter_context(redis)
            self.redis_url = self.redis.url
        log.info("mesh.redis", url=self.redis_url)
        common = {"OPENTINKER_REDIS_URL": self.redis_url, "OPENTINKER_HOST": s.host}
        scheduler = self._start_on_port(
            "scheduler",
            "opentinker.services.scheduler",
            s.scheduler_port,
            {
                **common,
                "OPENTINKER_AUTH_SECRET_FILE": str(self.secrets_dir / "auth.secret"),
                "OPENTINKER_BOOTSTRAP_DIR": str(self.secrets_dir),
            },
        )
        self.scheduler_address = scheduler.address
        envhub = self._start_on_port(
            "envhub",
            "opentinker.services.envhub",
            s.envhub_port,
            {**common, "OPENTINKER_SCHEDULER_ADDRESS": self.scheduler_address},
        )
        self.envhub_address = envhub.address
        scheduler.wait_serving(timeout_s=s.startup_timeout_s)
        envhub.wait_serving(timeout_s=s.startup_timeout_s)
        self.api_key = ensure_local_user_key(
            self.scheduler_address,
            admin_key_file=self.secrets_dir / ADMIN_KEY_FILE,
            key_file=self.secrets_dir / "api.key",
        )
        self.start_worker()
        if s.dashboard_port is not None:
            self.start_dashboard(s.dashboard_port)
        log.info(
            "mesh.up",
            scheduler=self.scheduler_address,
            envhub=self.envhub_address,
            dashboard=self.dashboard_url,
            logs=str(self.log_dir),
        )

    def start_dashboard(self, port: int) -> ServiceProcess:
        """Start the web dashboard on ``port`` (0: any free one, which it binds and says in
        its address file) and wait until it answers."""
        address_file = self.run_root / "dashboard.addr"
        address_file.unlink(missing_ok=True)  # an earlier run's, in the same run root
        proc = self._start(
            "dashboard",
            "opentinker.services.dashboard",
            {
                "OPENTINKER_DASHBOARD_HOST": self.settings.host,
                "OPENTINKER_DASHBOARD_PORT": str(port),
                "OPENTINKER_DASHBOARD_ADDRESS_FILE": str(address_file),
                "OPENTINKER_DASHBOARD_SCHEDULER_ADDRESS": self.scheduler_address,
                "OPENTINKER_DASHBOARD_ENVHUB_ADDRESS": self.envhub_address,
            },
        )
        address = proc.wait_address(
            address_file,
            timeout_s=self.settings.startup_timeout_s,
            port_variable="OPENTINKER_DASHBOARD_PORT",
        )
        self.dashboard_url = f"http://{address}/"
        proc.wait_http(self.dashboard_url + "healthz", timeout_s=self.settings.startup_timeout_s)
        return proc

    @property
    def checkpoint_root(self) -> Path:
        """Where the worker's jobs keep their checkpoints (and sessions their saved states)."""
        return self.run_root / "jobs" / "checkpoints"

    def start_worker(
        self, name: str = "worker", env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Start a worker agent (again, e.g. after one died: its jobs resume on this one, under
        the same worker id, kept in its run root). ``name`` and ``env`` (OPENTINKER_*
        overrides): another agent beside the first, e.g. a second "node" with its own
        OPENTINKER_HOSTNAME, OPENTINKER_WORKER_ID and run root. The bootstrap worker token is
        bound to the first agent's id (a token admits one worker), so one naming another id
        gets a token of its own, made here with the admin key and bound to that id."""
        token_file = self.secrets_dir / WORKER_TOKEN_FILE
        other_id = (env or {}).get("OPENTINKER_WORKER_ID", "")
        if other_id and not {"OPENTINKER_WORKER_TOKEN", "OPENTINKER_WORKER_TOKEN_FILE"} & set(
            env or {}
        ):
            token_file = self.secrets_dir / f"worker-{name}.token"
            admin_key = (self.secrets_dir / ADMIN_KEY_FILE).read_text().strip()
            with AdminClient(self.scheduler_address, api_key=admin_key, timeout=30) as admin:
                token = admin.create_worker_token(worker_id=other_id, label=f"opentinker {name}")
            write_atomic(token_file, token + "\n", mode=0o600)
        return self._start(
            name,
            "opentinker.services.worker",
            {
                "OPENTINKER_REDIS_URL": self.redis_url,
                "OPENTINKER_WORKER_TOKEN_FILE": str(token_file),
                "OPENTINKER_SCHEDULER_ADDRESS": self.scheduler_address,
                "OPENTINKER_ENVHUB_ADDRESS": self.envhub_address,
                "OPENTINKER_RUN_ROOT": str(self.run_root / "jobs"),
                "OPENTINKER_CHECKPOINT_ROOT": str(self.checkpoint_root),
                "OPENTINKER_NUM_CPU_SLOTS": str(self.settings.cpu_slots),
                "OPENTINKER_WARM_SPARES": str(self.settings.warm_spares),
                "OPENTINKER_SPARE_REUSE": str(self.settings.spare_reuse).lower(),
                **(
                    {"OPENTINKER_ROLLOUT_AGENT_PROGRAMS": "true"}
                    if self.settings.agent_programs
                    else {}
                ),
                "OPENTINKER_SHARED_LORA_CAPACITY": str(self.settings.shared_lora_capacity),
                **(env or {}),
            },
        )

    def _start_on_port(
        self, name: str, module: str, port: int, env: dict[str, str]
    ) -> ServiceProcess:
        """Start a gRPC service on ``port`` (0: any free one, which it binds itself and says
        in its address file: nothing is picked here for another process to take before the
        service binds it) and learn its address."""
        address_file = self.run_root / f"{name}.addr"
        address_file.unlink(missing_ok=True)  # an earlier run's, in the same run root
        proc = self._start(
            name,
            module,
            {**env, "OPENTINKER_PORT": str(port), "OPENTINKER_ADDRESS_FILE": str(address_file)},
        )
        # the gRPC health check a restart waits for goes to this address
        proc.address = proc.wait_address(address_file, timeout_s=self.settings.startup_timeout_s)
        return proc

    def _agent_programs_env(self) -> dict[str, str]:
        on = self.settings.agent_programs
        return {"OPENTINKER_ROLLOUT_AGENT_PROGRAMS": "true"} if on else {}

    def _start(
        self, name: str, module: str, env: dict[str, str], address: str = ""
    ) -> ServiceProcess:
        proc = ServiceProcess.start(name, module, env=env, log_dir=self.log_dir, address=address)
        self.processes.append(proc)
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL one service ("scheduler", "envhub", "worker", or "redis" when embedded)."""
        if name == "redis":
            self._embedded_redis().kill()
        else:
            self._service(name).kill()

    def restart(self, name: str) -> None:
        """Start a killed service again where it was: same port, same Redis data directory."""
        if name == "redis":
            self._embedded_redis().start()
            return
        old = self._service(name)
        new = old.restarted()
        self.processes[self.processes.index(old)] = new
        if new.address:
            new.wait_serving(timeout_s=self.settings.startup_timeout_s)

    def _service(self, name: str) -> ServiceProcess:
        found = [p for p in self.processes if p.name == name]
        if not found:
            raise KeyError(f"no service {name!r} in this mesh")
        return found[0]

    def _embedded_redis(self) -> RedisProcess:
        if self.redis is None:
            raise RuntimeError("this mesh uses an outside Redis (redis_url was given)")
        return self.redis

    def dead_processes(self) -> list[ServiceProcess]:
        return [p for p in self.processes if not p.alive()]

    def stop(self) -> None:
        """Stop every service (the newest first), then Redis. One that does not stop (a
        process stuck in the kernel outlives even SIGKILL's wait) is logged, the rest are
        stopped all the same, and a RuntimeError names it at the end."""
        stuck = []
        for proc in reversed(self.processes):
            try:
                proc.stop()
            except Exception as err:  # noqa: BLE001 - every other service still stops
                log.warning("service_did_not_stop", service=proc.name, error=repr(err))
                stuck.append(f"{proc.name} (pid {proc.process.pid}: {err!r})")
        self.processes.clear()
        self._stack.close()
        if stuck:
            raise RuntimeError(f"the mesh stopped but for: {', '.join(stuck)}")
