"""A multi-turn RL job through the real mesh with the rollout's prefix cache on and off.

The built-in ``gomoku`` env with ``max_invalid_moves`` = ``--turns``: a model that cannot
write moves yet plays exactly that many turns, each reply a few dozen tokens on top of a
~200-token first prompt. The tiny random-init model is nudged to end its turns with eos
(bench/prefix_cache.py), as a chat model does. Runs alternate between the rollout keeping each
turn's keys and values for the next (``OPENTINKER_ROLLOUT_PREFIX_CACHE_MB``, default 256) and
computing every prompt again (0); each prints the mean step, generation and env time of its
steps after the first two.

    .venv/bin/python bench/multi_turn_job.py [--steps 12] [--turns 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from arguments import positive_int  # bench/ is sys.path[0]
from prefix_cache import eos_nudged

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.jobs import JobEvent
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model

CACHE_SETTING = "OPENTINKER_ROLLOUT_PREFIX_CACHE_MB"


def job_spec(model_dir: Path, args: argparse.Namespace) -> JobSpec:
    return JobSpec(
        name="multi-turn-prefix-cache",
        model=ModelSpec(base_model=str(model_dir), finetune="full"),
        rl=RlConfig(
            env_name="gomoku",
            env_options={"max_invalid_moves": str(args.turns)},
            steps=args.steps,
            prompts_per_step=args.prompts,
            samples_per_prompt=args.samples,
            learning_rate=1e-5,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens),
            max_turns=args.turns,
            seed=0,
        ),
    )


def run_job(spec: JobSpec, root: Path, cache_mb: int) -> dict[str, float]:
    """The job through a fresh mesh whose rollout keeps ``cache_mb`` MiB of prefixes."""
    os.environ[CACHE_SETTING] = str(cache_mb)  # the mesh's processes inherit it
    steps: list[JobEvent] = []
    started = time.monotonic()
    with (
        LocalMesh(MeshSettings(run_root=root, warm_spares=0)) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
    ):
        client.fit(spec, on_event=lambda e: steps.append(e) if e.kind == "step" else None)
    timed = steps[2:]
    if not timed:
        raise SystemExit(f"the job ended after {len(steps)} steps; ask for more with --steps")
    mean = {
        key: statistics.mean(s.metrics.get(key, 0.0) for s in timed)
        for key in ("time_step_s", "time_generate_s", "time_env_s", "env_turns_mean")
    }
    mean["wall_s"] = time.monotonic() - started
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=12)
    parser.add_argument("--turns", type=positive_int, default=6)
    parser.add_argument("--prompts", type=positive_int, default=4)
    parser.add_argument("--samples", type=positive_int, default=4)
    parser.add_argument("--new-tokens", type=positive_int, default=8)
    parser.add_argument("--rounds", type=positive_int, default=2)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="opentinker-multi-turn-job-"))
    model, tokenizer = eos_nudged(ensure_tiny_model(root / "tiny-qwen2"), steps=6)
    model_dir = root / "tiny-qwen2-eos"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    spec = job_spec(model_dir, args)
    sides = {"prefix cache": 256, "every prompt again": 0}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for index in range(args.rounds):
        for name, cache_mb in sides.items():
            results[name].append(run_job(spec, root / f"{index}-{cache_mb}", cache_mb))
    out = sys.stdout
    out.write(
        f"\ngomoku, {args.turns} turns an episode, {args.prompts} x {args.samples} episodes a "
        f"step, up to {args.new_tokens} new tokens a turn, {args.steps} steps, "
        f"{args.rounds} rounds (medians of the per-run means of steps 3..)\n"
    )
    step = {}
    for name, runs in results.items():
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        step[name] = median["time_step_s"]
        out.write(
            f"{name:<20} step {median['time_step_s']:.3f} s   generate "
            f"{median['time_generate_s']:.3f} s   env {median['time_env_s']:.3f} s   turns "
            f"{median['env_turns_mean']:.1f}\n"
        )
    out.write(f"step time: {step['every prompt again'] / step['prefix cache']:.2f}x faster\n")


if __name__ == "__main__":
    main()
