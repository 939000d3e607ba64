"""The ``opentinker`` command: submit | jobs | cancel | tail | serve | up | demo | tiny-model.

Prints for people; every command exits non-zero with a one-line reason on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console

from opentinker.client import DEFAULT_ADDRESS, Client
from opentinker.console import jobs_table, print_event
from opentinker.errors import OpenTinkerError
from opentinker.spec import parse_job_spec

console = Console()
SERVICES = ("scheduler", "envhub", "worker", "trainer", "rollout")


def _address(args: argparse.Namespace) -> str:
    return args.scheduler or os.environ.get("OPENTINKER_SCHEDULER_ADDRESS", DEFAULT_ADDRESS)


def cmd_submit(args: argparse.Namespace) -> int:
    spec = parse_job_spec(json.loads(Path(args.spec).read_text()))
    with Client(_address(args)) as client:
        job = client.submit(spec)
    console.print(f"submitted [bold]{job.job_id}[/] ({job.state}); follow it with: opentinker tail {job.job_id}")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with Client(_address(args)) as client:
        jobs = list(client.list_jobs())
    console.print(jobs_table(jobs))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with Client(_address(args)) as client:
        job = client.cancel(args.job_id, reason=args.reason)
    console.print(f"{job.job_id}: {job.state} — {job.reason}")
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    """Stream a job's events live; a late tail replays the whole run first."""
    with Client(_address(args)) as client:
        last = None
        for event in client.watch(args.job_id, from_seq=args.from_seq):
            print_event(console, event, every=args.every)
            last = event
    return 0 if last is not None and last.state == "SUCCEEDED" else 1


def cmd_serve(args: argparse.Namespace) -> int:
    """Run one service in the foreground (settings from OPENTINKER_* variables)."""
    module = f"opentinker.services.{args.service}"
    os.execv(sys.executable, [sys.executable, "-m", module, *args.rest])
    return 1  # unreachable


def cmd_up(args: argparse.Namespace) -> int:
    from opentinker.services.launcher.demo import run_up  # needs the server extra

    return run_up(run_root=Path(args.run_root), redis_url=args.redis_url, console=console)


def cmd_demo(args: argparse.Namespace) -> int:
    from opentinker.services.launcher.demo import run_demo  # needs the server extra

    return run_demo(
        run_root=Path(args.run_root),
        redis_url=args.redis_url,
        threshold=args.threshold,
        max_steps=args.max_steps,
        console=console,
    )


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from opentinker.services.modeling.tiny_model import build_tiny_model

    path = build_tiny_model(Path(args.out), seed=args.seed)
    console.print(f"tiny Qwen2 model saved to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opentinker", description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help=f"scheduler address (default {DEFAULT_ADDRESS})")
    sub = parser.add_subparsers(dest="command", required=True)

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
    p.set_defaults(func=cmd_tail)

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
        if name == "demo":
            p.add_argument("--threshold", type=float, default=0.9)
            p.add_argument("--max-steps", type=int, default=1500)
        p.set_defaults(func=func)

    p = sub.add_parser("tiny-model", help="build the tiny local Qwen2 model")
    p.add_argument("--out", default="runs/tiny-qwen2")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except OpenTinkerError as err:
        console.print(f"[red]error:[/] {err.message}", highlight=False)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
