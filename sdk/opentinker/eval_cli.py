"""``opentinker eval``: a model (or a trained adapter) on an env's validation split as inference
jobs on the pool: accuracy with its 95% confidence interval, mean reward, pass@k, one jsonl line
per episode; with ``--compare-adapter``/``--compare-model``, the second model on the same
episodes (same seeds) and the paired difference, so before/after a training run is one command.

    opentinker eval --model runs/smollm2 --env arithmetic --episodes 128 \\
        --compare-adapter <checkpoint of the LoRA job>
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from opentinker.client import DEFAULT_ADDRESS, Client
from opentinker.eval_stats import evaluate, paired_difference
from opentinker.inference_rows import parse_env_options
from opentinker.spec import InferenceConfig, JobSpec, ModelSpec, SamplingParams

console = Console()


def cmd_eval(args: argparse.Namespace) -> int:
    if args.samples > 1 and args.temperature == 0:
        raise ValueError(
            f"--samples {args.samples}: greedy decoding plays every sample the same; "
            "give a --temperature > 0 (e.g. 1.0) to estimate pass@k"
        )
    args.k = args.k or sorted({1, args.samples})
    if max(args.k) > args.samples:
        raise ValueError(f"--k {max(args.k)}: pass@k needs --samples >= k (it is {args.samples})")
    options = parse_env_options(args.option, args.split)
    runs = [("model", args.model, args.adapter)]
    if args.compare_adapter or args.compare_model:
        runs.append(("compared", args.compare_model or args.model, args.compare_adapter))
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    address = args.scheduler or os.environ.get("OPENTINKER_SCHEDULER_ADDRESS", DEFAULT_ADDRESS)
    results: list[list[dict[str, Any]]] = []
    with Client(address, api_key=args.api_key) as client:
        for label, model, adapter in runs:
            spec = _spec(args, options, model, adapter)
            rows = _play(client, spec, out_dir / f"{label}.jsonl", label)
            results.append(rows)
            name = model + (f" + {adapter}" if adapter else "")
            console.print(f"{name}: {evaluate(rows, args.k).describe()}", highlight=False)
    if len(results) == 2:
        diff = paired_difference(results[0], results[1])
        console.print(
            f"difference (compared - model) in accuracy: {diff.value:+.1%} "
            f"(95% CI {diff.low:+.1%} to {diff.high:+.1%}, paired over the same episodes)",
            highlight=False,
        )
    return 0


def _spec(
    args: argparse.Namespace, options: dict[str, str], model: str, adapter: str | None
) -> JobSpec:
    greedy = args.temperature == 0  # the engine's argmax; a temperature must still be > 0
    sampling = SamplingParams(
        temperature=args.temperature if not greedy else 1.0, max_new_tokens=args.max_new_tokens
    )
    return JobSpec(
        name=f"eval-{args.env}",
        kind="inference",
        model=ModelSpec(base_model=model, finetune="full"),
        inference=InferenceConfig(
            env_name=args.env,
            env_options=options,
            episodes=args.episodes,
            sampling=sampling,
            seed=args.seed,
            adapter_dir=adapter or "",
            greedy=greedy,
            samples_per_episode=args.samples,
        ),
    )


def _play(client: Client, spec: JobSpec, output: Path, label: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    c = spec.inference
    total = c.episodes * c.samples_per_episode if c is not None else None
    with Progress(console=console, transient=True) as progress, output.open("w") as out:
        task = progress.add_task(label, total=total)
        for row in client.infer(spec):
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            rows.append(row)
            progress.update(task, completed=len(rows))
    return rows


def _ks(value: str) -> Sequence[int]:
    ks = [int(k) for k in value.split(",")]
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"--k takes positive integers like 1,4; got {value!r}")
    return ks


def add_eval_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy (95%% CI) of a model on an env's validation split")
    p.add_argument("--model", required=True, help="HF id, model dir, GGUF file or checkpoint")
    p.add_argument("--adapter", default=None, help="a LoRA adapter dir applied to --model")
    p.add_argument("--compare-adapter", default=None, help="also: --model with this adapter")
    p.add_argument("--compare-model", default=None, help="also: this model")
    p.add_argument("--env", required=True, help="registered environment name")
    p.add_argument("--split", default="validation", help="the env's split (default validation)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="env option")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="samples of each problem (pass@k up to k = this; needs --temperature > 0)",
    )
    p.add_argument("--k", type=_ks, default=None, help="pass@k for these k (default 1,SAMPLES)")
    p.add_argument("--seed", type=int, default=0, help="the same seed: the same episodes")
    p.add_argument("--output-dir", default="eval", help="model.jsonl (and compared.jsonl)")
    p.set_defaults(func=cmd_eval)
