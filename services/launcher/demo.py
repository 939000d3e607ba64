"""``opentinker up`` and ``opentinker demo``: the single-node mesh for people.

The demo builds the tiny local model, starts the mesh, trains it with GRPO on the built-in
``letter`` environment while showing progress live, and succeeds only if the job SUCCEEDED
with the final 10-step mean reward at or above the threshold it prints.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import structlog
from rich.console import Console

from opentinker.client import Client
from opentinker.console import print_event
from opentinker.errors import OpenTinkerError
from opentinker.jobs import RL_FINAL_REWARD, JobEvent
from opentinker.services.gateway.in_thread import running_gateway
from opentinker.services.gateway.settings import GatewaySettings
from opentinker.services.launcher.catalog_seed import TINY_MODEL_NAME, register_local_model
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.spec import JobSpec, ModelSpec, RlConfig, SamplingParams

TINY_DESCRIPTION = "the demo's tiny random-init Qwen2 with a local tokenizer"


def demo_spec(model_dir: Path, *, threshold: float, max_steps: int) -> JobSpec:
    """The demo job: a random-init model learns to answer with the letter the prompt names."""
    return JobSpec(
        name="demo-letters",
        model=ModelSpec(base_model=str(model_dir), finetune="full"),
        rl=RlConfig(
            env_name="letter",
            env_options={"num_letters": "8"},
            steps=max_steps,
            prompts_per_step=16,
            samples_per_prompt=8,
            learning_rate=1e-4,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=1),
            max_turns=1,
            seed=0,
            stop_at_reward=threshold,
        ),
    )


def _quiet_logs() -> None:
    """The console speaks to people here; the launcher's own logs only when something is wrong."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def run_up(
    *,
    run_root: Path,
    redis_url: str | None,
    console: Console,
    scheduler_port: int = 50051,
    envhub_port: int = 50052,
    dashboard_port: int | None = 8080,
    gateway_port: int | None = 8000,
) -> int:
    """Start the mesh on the default ports and keep it up until Ctrl-C / SIGTERM.
    ``dashboard_port``: the web dashboard's (None = no dashboard); the Tinker gateway serves in
    this process (None = no gateway; ``opentinker serve tinker-gateway`` runs it alone)."""
    _quiet_logs()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    settings = MeshSettings(
        run_root=run_root,
        redis_url=redis_url,
        scheduler_port=scheduler_port,
        envhub_port=envhub_port,
        dashboard_port=dashboard_port,
    )
    with LocalMesh(settings) as mesh, contextlib.ExitStack() as gateway:
        tiny = ensure_tiny_model(run_root.resolve().parent / "tiny-qwen2")
        register_local_model(
            mesh.scheduler_address,
            mesh.secrets_dir,
            tiny,
            name=TINY_MODEL_NAME,
            description=TINY_DESCRIPTION,
        )
        gateway_url = "off"
        if gateway_port is not None:
            gateway_settings = GatewaySettings(
                scheduler_address=mesh.scheduler_address,
                port=gateway_port,
                checkpoint_root=mesh.checkpoint_root,
            )
            gateway_url = gateway.enter_context(running_gateway(gateway_settings))
        console.print(
            f"[green]mesh up[/]  scheduler {mesh.scheduler_address}  envhub {mesh.envhub_address}"
            f"  redis {mesh.redis_url}\n"
            f"dashboard {mesh.dashboard_url or 'off'} (sign in with your API key)\n"
            f"tinker gateway {gateway_url} (api_key: tml-<your key>)\n"
            f"models: {TINY_MODEL_NAME} ({tiny}); an admin adds more with `opentinker models "
            "register NAME --location DIR`\n"
            f"logs in {mesh.log_dir}\n"
            f"your API key (tenant 'local') is in {mesh.secrets_dir / 'api.key'}; the admin key "
            f"in {mesh.secrets_dir / 'admin.key'}\n"
            f"export OPENTINKER_API_KEY=$(cat {mesh.secrets_dir / 'api.key'})\n"
            f"submit with: opentinker --scheduler {mesh.scheduler_address} submit SPEC.json"
        )
        try:
            while not stop.wait(1.0):
                if dead := mesh.dead_processes():
                    console.print(f"[red]{dead[0].name} exited; see {dead[0].log_path}[/]")
                    return 1
        except KeyboardInterrupt:
            pass
        console.print("stopping the mesh")
    return 0


def run_demo(
    *, run_root: Path, redis_url: str | None, threshold: float, max_steps: int, console: Console
) -> int:
    _quiet_logs()
    started = time.monotonic()
    run_root = run_root.resolve()
    console.rule("OpenTinker demo")
    model_dir = ensure_tiny_model(run_root.parent / "tiny-qwen2")
    console.print(f"tiny Qwen2 model (random init, local tokenizer): {model_dir}")
    spec = demo_spec(model_dir, threshold=threshold, max_steps=max_steps)
    rl = spec.rl
    assert rl is not None  # an RL job's spec
    console.print(
        f"task: answer with the letter the prompt names (env 'letter', "
        f"{rl.env_options['num_letters']} letters); GRPO, "
        f"{rl.prompts_per_step} prompts × {rl.samples_per_prompt} samples, "
        f"lr {rl.learning_rate:g}, full fine-tuning"
    )
    console.print(f"success = job SUCCEEDED and 10-step mean reward ≥ [bold]{threshold}[/]")
    with demo_mesh(
        console, run_root, redis_url, model_dir, name=TINY_MODEL_NAME, description=TINY_DESCRIPTION
    ) as mesh:

        def show(event: JobEvent) -> None:
            print_event(console, event, every=10)

        request_id = uuid.uuid4().hex  # names the job to the watchdog before fit returns
        with (
            Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
            _cancelled_if_a_service_exits(mesh, client, spec, request_id),
        ):
            try:
                job = client.fit(spec, on_event=show, request_id=request_id)
            except OpenTinkerError as err:
                console.print(f"[red]demo failed:[/] {err.message}")
                console.print(f"logs: {mesh.log_dir} and {run_root / 'jobs'}")
                return 1
    reward = job.final_metrics.get(RL_FINAL_REWARD, float("nan"))
    first = job.final_metrics.get("reward_mean_first10", float("nan"))
    elapsed = time.monotonic() - started
    console.print(
        f"job {job.job_id} {job.state} after {job.final_metrics.get('steps', 0):.0f} steps "
        f"in {elapsed:.0f} s: reward {first:.3f} (first 10 steps) → {reward:.3f} (last 10)"
    )
    console.print(f"checkpoint (HF format): {job.checkpoint_uri}")
    if reward >= threshold:
        console.print(f"[green]PASS[/]: reward {reward:.3f} ≥ threshold {threshold}")
        return 0
    console.print(f"[red]FAIL[/]: reward {reward:.3f} < threshold {threshold}")
    return 1


@contextlib.contextmanager
def demo_mesh(
    console: Console,
    run_root: Path,
    redis_url: str | None,
    model_dir: Path,
    *,
    name: str,
    description: str,
) -> Iterator[LocalMesh]:
    """The single-node mesh of a demo's job, its model registered in the catalog. No warm
    spares: for one job they could only compete with it for the CPU."""
    settings = MeshSettings(run_root=run_root, redis_url=redis_url, warm_spares=0)
    with LocalMesh(settings) as mesh:
        console.print(f"mesh up: scheduler {mesh.scheduler_address}, envhub {mesh.envhub_address}")
        register_local_model(
            mesh.scheduler_address, mesh.secrets_dir, model_dir, name=name, description=description
        )
        yield mesh


@contextlib.contextmanager
def _cancelled_if_a_service_exits(
    mesh: LocalMesh, client: Client, spec: JobSpec, request_id: str
) -> Iterator[None]:
    """While inside: once a service of ``mesh`` has exited, cancel the job ``request_id``
    submits, naming the service and its log, so that ``fit`` ends; without a worker the job
    would wait QUEUED, and the demo with it, for ever."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):
            if dead := mesh.dead_processes():
                reason = f"{dead[0].name} exited; see {dead[0].log_path}"
                with contextlib.suppress(OpenTinkerError):  # the scheduler's own exit: fit says
                    job = client.submit(spec, request_id=request_id)  # the same job, by its id
                    client.cancel(job.job_id, reason=reason)
                return

    watchdog = threading.Thread(target=watch, name="demo-watchdog", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        stop.set()
        watchdog.join(timeout=10)
