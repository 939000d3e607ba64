"""``opentinker infer``: run a model against a registered env, one jsonl line per episode.

By default an inference job on the pool (the scheduler's workers load the model; the rows come
back through the job's event stream); ``--local`` plays in this process against an EnvHub.
Either way the env code is the one training used, and the summary line is the same.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, TaskID

from opentinker.auth import api_key_from_env
from opentinker.client import DEFAULT_ADDRESS, Client
from opentinker.errors import ConfigError
from opentinker.inference_rows import InferenceSummary, parse_env_options, summarize
from opentinker.jobs import JobInfo
from opentinker.spec import InferenceConfig, JobSpec, ModelSpec, SamplingParams

console = Console()
ENVHUB_ENV, DEFAULT_ENVHUB = "OPENTINKER_ENVHUB_ADDRESS", "127.0.0.1:50052"


def cmd_infer(args: argparse.Namespace) -> int:
    if args.envhub is not None and not args.local:
        raise ConfigError(
            "--envhub is where --local plays; a job plays on the pool's EnvHub (add --local, "
            "or drop --envhub and pick the scheduler with --scheduler)",
            reason="ENVHUB_WITHOUT_LOCAL",
        )
    options = parse_env_options(args.option, args.split)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("episodes", total=args.episodes)
        if args.local:
            summary = _run_local(args, options, sampling, progress, task)
        else:
            summary = _run_job(args, options, sampling, progress, task)
    console.print(summary.describe(args.env))
    return 0


def _run_job(
    args: argparse.Namespace,
    options: dict[str, str],
    sampling: SamplingParams,
    progress: Progress,
    task: TaskID,
) -> InferenceSummary:
    """Submit the inference job, write its rows as they arrive; the rows' summary."""
    spec = JobSpec(
        name=f"infer-{args.env}",
        kind="inference",
        model=ModelSpec(base_model=args.model, finetune="full"),
        inference=InferenceConfig(
            env_name=args.env,
            env_options=options,
            episodes=args.episodes,
            concurrency=args.concurrency,
            sampling=sampling,
            max_turns=args.max_turns,
            seed=args.seed,
            adapter_dir=args.adapter or "",
            greedy=args.greedy,
        ),
    )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    address = args.scheduler or os.environ.get("OPENTINKER_SCHEDULER_ADDRESS", DEFAULT_ADDRESS)
    rows = []

    def submitted(job: JobInfo) -> None:
        progress.console.print(f"inference job [bold]{job.job_id}[/] (opentinker tail it)")

    with Client(address, api_key=args.api_key) as client, output.open("w") as out:
        for row in client.infer(spec, on_submit=submitted):
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
            rows.append(row)
            progress.update(task, completed=len(rows))
    return summarize(rows, output)


def _run_local(
    args: argparse.Namespace,
    options: dict[str, str],
    sampling: SamplingParams,
    progress: Progress,
    task: TaskID,
) -> InferenceSummary:
    """Play in this process (needs the server extra) against the EnvHub at --envhub."""
    import logging

    import structlog

    from opentinker.services.rollout.inference import run_inference

    # The progress bar and the summary speak for the run; only warnings from the engine.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.adapter:
        raise ValueError("--adapter is for the job mode; with --local pass the adapter as --model")
    return run_inference(
        model=args.model,
        env_name=args.env,
        envhub_address=args.envhub or os.environ.get(ENVHUB_ENV, DEFAULT_ENVHUB),
        api_key=api_key_from_env(args.api_key),
        episodes=args.episodes,
        output=Path(args.output),
        env_options=options,
        sampling=sampling,
        max_turns=args.max_turns,
        seed=args.seed,
        concurrency=args.concurrency,
        greedy=args.greedy,
        progress=lambda done, total: progress.update(task, completed=done, total=total),
    )


def add_infer_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "infer", help="run a model against a registered env (a job on the pool), write jsonl"
    )
    p.add_argument("--model", required=True, help="HF id, model dir, or a trained checkpoint")
    p.add_argument("--adapter", default=None, help="a LoRA adapter dir applied to --model")
    p.add_argument("--env", required=True, help="registered environment name")
    p.add_argument("--local", action="store_true", help="play in this process, not as a job")
    p.add_argument(
        "--envhub",
        default=None,
        help=f"--local: the EnvHub to play against (default ${ENVHUB_ENV} or {DEFAULT_ENVHUB})",
    )
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32, help="episodes played together")
    p.add_argument("--output", default="infer.jsonl")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="env option")
    p.add_argument("--split", default=None, help="dataset split for dataset envs")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (no sampling)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--max-turns",
        type=int,
        default=None,
        help="model turns per episode (default: the environment's own limit)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_infer)
