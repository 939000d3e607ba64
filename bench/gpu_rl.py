"""A short real-size RL job on one GPU with the vLLM rollout engine: the whole mesh (Redis,
scheduler, EnvHub, worker -> trainer + rollout processes) on a Qwen2.5-0.5B-shaped model built
here with random init, LoRA or full fine-tuning; prints the step time split and weight sync.

    python bench/gpu_rl.py --finetune lora [--steps 8] [--prompts 16] [--samples 8]

The env is ``visible_text`` (served here, registered with the mesh's EnvHub as a user's env
is): its reward is the answer's visible length, up to 16 characters. The random model's ids
are mostly past the local 512-token tokenizer and decode to nothing, so a few answers in each
group hold text and the rewards differ from the first step: every step trains, and the probe
shift and the trainer-to-vLLM logprob gap are measured. (Checked on CPU with transformers: 0.29%
of sampled ids were below 512, 3 of 32 answers held text, 2 of 4 groups of 8 had rewards
that differ.) (On the letter task such a model earns
0 everywhere: no gradient, nothing moves; so it ran on 2026-11-26.)

The worker leases the GPU, so the trainer runs in bf16 on it and the rollout picks vLLM
(OPENTINKER_ROLLOUT_ENGINE=vllm is set here: a fall back to transformers fails the job
instead of passing silently). Both processes share the GPU: vLLM takes
OPENTINKER_ROLLOUT_GPU_MEMORY_UTILIZATION of it (0.3 here).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from step_breakdown import KEYS  # bench/ is sys.path[0]: the same step split

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.env_server import serve
from opentinker.game import AbstractGame, StepResult
from opentinker.services.common.logging import parse_log_line
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import QWEN2_5_0_5B_SHAPE, build_tiny_model


class VisibleText(AbstractGame):
    """Single turn: the reward is the answer's visible length (stripped), 16 characters = 1."""

    name = "visible_text"
    description = "Say something visible: reward = stripped length / 16, at most 1."
    max_turns = 1

    def get_system_prompt(self) -> str:
        return "You write a short sentence."

    def reset(self, *, seed: int = 0) -> str:
        return f"Write sentence number {seed}."

    def step(self, action: str) -> StepResult:
        reward = min(len(action.strip()) / 16, 1.0)
        return StepResult(observation="", reward=reward, done=True, info={})


@dataclass
class Run:
    """What one job left: its info, its step events, and where its logs are."""

    job: opentinker.JobInfo
    steps: list[opentinker.JobEvent]
    job_s: float
    run_root: Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finetune", choices=["full", "lora"], default="lora")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="a model folder (default: build one)")
    parser.add_argument("--engine", default="vllm", help="the rollout engine (CPU: transformers)")
    return parser.parse_args()


def run_job(args: argparse.Namespace) -> Run:
    """The job on a fresh mesh with the env served here; client.fit raises JobFailedError
    (with the reason) when the job fails."""
    os.environ.setdefault("OPENTINKER_ROLLOUT_ENGINE", args.engine)
    os.environ.setdefault("OPENTINKER_ROLLOUT_GPU_MEMORY_UTILIZATION", "0.3")
    root = Path(tempfile.mkdtemp(prefix="opentinker-gpu-rl-"))
    model = args.model or build_tiny_model(root / "qwen0.5b", **QWEN2_5_0_5B_SHAPE)
    spec = JobSpec(
        name=f"gpu-rl-{args.finetune}",
        model=ModelSpec(base_model=str(model), finetune=args.finetune),
        rl=RlConfig(
            env_name=VisibleText.name,
            steps=args.steps,
            prompts_per_step=args.prompts,
            samples_per_prompt=args.samples,
            learning_rate=1e-5,
            sampling=SamplingParams(max_new_tokens=args.max_new_tokens),
        ),
    )
    steps: list[opentinker.JobEvent] = []
    with (
        LocalMesh(MeshSettings(run_root=root / "mesh", warm_spares=0)) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
    ):
        # No cap on live episodes (a batch played and the next reset ahead): at serve's default
        # (64) the fourth lease's 128-episode steps played in two waves, waiting for slots
        env = serve(
            VisibleText,
            envhub_address=mesh.envhub_address,
            api_key=mesh.api_key,
            capacity=0,
            block=False,
        )
        submitted = time.monotonic()
        try:
            job = client.fit(spec, on_event=lambda e: steps.append(e) if e.kind == "step" else None)
        finally:
            env.stop(0)
        return Run(job, steps, time.monotonic() - submitted, mesh.run_root)


def startup_timeline(run: Run) -> list[tuple[float, str, str]]:
    """(seconds from the worker's first line for the job, process, event) of every logged
    event of the job's worker, rollout and trainer up to its first step: where the start
    went (process starts, imports, model loads, vLLM's compile and CUDA graphs)."""
    attempt = run.run_root / "jobs" / run.job.job_id / "attempt-1"
    sources = {
        "worker": [
            ln for ln in _lines(run.run_root / "logs" / "worker.log") if run.job.job_id in ln
        ],
        "rollout": _lines(attempt / "rollout.log"),
        "trainer": _lines(attempt / "trainer.log"),
    }
    events = []
    for process, lines in sources.items():
        for line in lines:
            if parsed := parse_log_line(line):
                events.append((parsed[0], process, parsed[1]))
    events.sort()
    firsts = [at for at, process, event in events if process == "trainer" and event == "step"]
    if not events or not firsts:
        return []
    return [(at - events[0][0], p, e) for at, p, e in events if at <= firsts[0]]


# vLLM's own lines that time a part of its start: "Model loading took 0.9 GiB memory and 1.2
# seconds", "torch.compile takes 31.0 s in total", "Graph capturing finished in 9 secs", "init
# engine (profile, create kv cache, warmup model) took 60.2 seconds"
VLLM_TIMING = re.compile(r"\b(takes|took|finished in|time:) .*\b[0-9.]+ ?(s|secs|seconds)\b")


def vllm_startup_lines(run: Run) -> list[str]:
    """vLLM's lines in the job's rollout log that time a part of its start (none with the
    transformers engine): where the minutes before the rollout opens went."""
    rollout_log = run.run_root / "jobs" / run.job.job_id / "attempt-1" / "rollout.log"
    return [line.strip() for line in _lines(rollout_log) if VLLM_TIMING.search(line)]


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def report(run: Run, args: argparse.Namespace, out: TextIO) -> None:
    out.write(
        f"job {run.job.job_id} {run.job.state} ({args.finetune}); logs under {run.run_root}\n"
    )
    out.write(f"job {run.job_s:.1f} s from submit to its end; start-up, from its logs:\n")
    for at, process, event in startup_timeline(run):
        out.write(f"  {at:7.1f} s  {process:<8}{event}\n")
    timings = vllm_startup_lines(run)
    if timings:
        out.write("vLLM's own start-up lines (rollout.log):\n")
        out.writelines(f"  {line[:200]}\n" for line in timings)
    measured = run.steps[1:] or run.steps  # the first step includes vLLM's warm-up
    if not measured:
        sys.exit("no step finished: see the rollout and trainer logs above")
    step_s = statistics.fmean(s.metrics["time_step_s"] for s in measured)
    first = run.steps[0].metrics["time_step_s"]
    out.write(f"step 1: {first:.2f} s; {len(measured)} steps measured, ")
    out.write(f"{args.prompts * args.samples} episodes/step\n")
    out.write(f"{'part':<18}{'s/step':>10}{'share':>9}\n")
    for key in KEYS:
        mean = statistics.fmean(s.metrics.get(key, 0.0) for s in measured)
        name = key.removeprefix("time_").removesuffix("_s")
        out.write(f"{name:<18}{mean:>10.4f}{mean / step_s:>9.1%}\n")
    out.write(f"{'step total':<18}{step_s:>10.4f}\n")
    for key in ("time_train_forward_backward_s", "time_train_optimizer_s"):  # parts of train
        mean = statistics.fmean(s.metrics.get(key, 0.0) for s in measured)
        name = "  " + key.removeprefix("time_train_").removesuffix("_s")
        out.write(f"{name:<18}{mean:>10.4f}{mean / step_s:>9.1%}  of train\n")
    for key in (
        "tokens_per_s",
        "probe_max_abs_diff",
        "probe_shift",
        "probe_blind_versions",
        "logprob_gap",
        "grad_norm",
        "memory_allocated_peak_gib",  # the trainer's, on the GPU (memory_resident_gib on CPU)
        "memory_reserved_peak_gib",
        "memory_resident_gib",
    ):
        values = [s.metrics[key] for s in measured if key in s.metrics]
        if values:
            out.write(f"{key}: mean {statistics.fmean(values):.4g}, max {max(values):.4g}\n")
    rewards = [s.metrics.get("reward_mean", 0.0) for s in run.steps]
    out.write(f"reward_mean by step: {' '.join(f'{r:.3f}' for r in rewards)}\n")


def main() -> None:
    args = parse_args()
    report(run_job(args), args, sys.stdout)


if __name__ == "__main__":
    main()
