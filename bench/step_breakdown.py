"""Where one RL step's time goes, and what the mesh itself costs.

Runs the real single-node mesh (Redis, scheduler, envhub, worker → trainer + rollout, all
separate processes) on the tiny local model for a fixed number of steps, then prints the mean
split of a step from the trainer's own timers: generation, environment, training, weight sync
and the rest (gRPC transfer of trajectories, serialization, Redis/scheduler reporting).

Baseline measured in the same run: the same episodes' environment work done in-process
(calling the game directly), so "env RPC overhead" is what going through EnvHub over gRPC
adds on top of the game logic itself.

    .venv/bin/python bench/step_breakdown.py [--steps 30] [--prompts 16] [--samples 8] \
        [--staleness 0]

With --staleness 1 generation and env work overlap training: their rows then say how long they
took on the rollout, "rollout_wait" how long the trainer waited for its batch, and the shares
add up to more than 100%. Last, the CPU each of the mesh's processes used per step (from
/proc, between step 2 and the last step; bench/process_cpu.py): where the cores went.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from process_cpu import cpu_by_service, per_step  # bench/ is sys.path[0]

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.jobs import JobEvent, JobInfo
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model


def inprocess_env_seconds(episodes: int) -> float:
    """Seconds to reset + step ``episodes`` letter games directly, no RPC."""
    started = time.perf_counter()
    for i in range(episodes):
        game = LetterGame()
        game.reset(seed=i, num_letters="8")
        game.step("A")
    return time.perf_counter() - started


KEYS = [
    "time_generate_s",
    "time_env_s",
    "time_rollout_wait_s",
    "time_train_s",
    "time_weight_sync_s",
    "time_mesh_s",
]
WARM_UP_STEPS = 2  # the first steps include warm-up (allocator, caches): not averaged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--finetune", choices=["full", "lora"], default="full")
    parser.add_argument("--staleness", type=int, default=0, help="RlConfig.max_staleness")
    args = parser.parse_args()
    if args.steps <= WARM_UP_STEPS:
        parser.error(f"--steps must be above the {WARM_UP_STEPS} warm-up steps, got {args.steps}")
    root = Path(tempfile.mkdtemp(prefix="opentinker-bench-"))
    job, steps, cpu = run_job(job_spec(args, ensure_tiny_model(root / "tiny-qwen2")), root)
    step_s = write_split(job, steps[WARM_UP_STEPS:], args)
    _write_cpu(per_step(cpu[0], cpu[1], len(steps) - WARM_UP_STEPS), step_s)


def job_spec(args: argparse.Namespace, model: Path) -> JobSpec:
    return JobSpec(
        name="bench-step-breakdown",
        model=ModelSpec(base_model=str(model), finetune=args.finetune),
        rl=RlConfig(
            env_name="letter",
            env_options={"num_letters": "8"},
            steps=args.steps,
            prompts_per_step=args.prompts,
            samples_per_prompt=args.samples,
            learning_rate=1e-4,
            sampling=SamplingParams(max_new_tokens=2),
            max_staleness=args.staleness,
        ),
    )


def run_job(spec: JobSpec, root: Path) -> tuple[JobInfo, list[JobEvent], list[dict[str, float]]]:
    """The job through a fresh local mesh: its final state, its step events, and the CPU the
    mesh's processes had used when the last warm-up step and the last step were reported."""
    assert spec.rl is not None
    last_step = spec.rl.steps
    steps: list[JobEvent] = []
    cpu: list[dict[str, float]] = []

    def on_event(event: JobEvent) -> None:
        if event.kind == "step":
            steps.append(event)
            if len(steps) in (WARM_UP_STEPS, last_step):
                cpu.append(cpu_by_service())

    with (
        # No warm spares: one starting for the next job would load its model during the steps
        # measured, and its CPU would count as this job's.
        LocalMesh(MeshSettings(run_root=root / "mesh", warm_spares=0)) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
    ):
        job = client.fit(spec, on_event=on_event)
    if len(cpu) != 2:
        raise SystemExit(f"job {job.job_id} {job.state} after {len(steps)} steps: {job.reason}")
    return job, steps, cpu


def write_split(job: JobInfo, steps: list[JobEvent], args: argparse.Namespace) -> float:
    """Print the mean split of a step and the mesh's cost; returns the mean step seconds."""
    mean = {k: statistics.fmean(s.metrics.get(k, 0.0) for s in steps) for k in KEYS}
    step_s = statistics.fmean(s.metrics["time_step_s"] for s in steps)
    episodes = args.prompts * args.samples
    env_direct = inprocess_env_seconds(episodes)
    env_rpc_overhead = max(mean["time_env_s"] - env_direct, 0.0)
    mesh_cost = mean["time_mesh_s"] + env_rpc_overhead + mean["time_weight_sync_s"]
    out = sys.stdout
    out.write(
        f"job {job.job_id} {job.state}: {len(steps)} steps measured, "
        f"{episodes} episodes/step, {args.finetune} fine-tuning, max_staleness {args.staleness}\n"
    )
    out.write(f"{'part':<28}{'s/step':>10}{'share':>9}\n")
    for key in KEYS:
        out.write(
            f"{key.removeprefix('time_').removesuffix('_s'):<28}{mean[key]:>10.4f}"
            f"{mean[key] / step_s:>9.1%}\n"
        )
    out.write(f"{'step total':<28}{step_s:>10.4f}{1:>9.0%}\n\n")
    out.write(
        f"baseline: the same {episodes} episodes' env work in-process: {env_direct:.4f} s "
        f"(through EnvHub over gRPC: {mean['time_env_s']:.4f} s, "
        f"{mean['time_env_s'] / max(env_direct, 1e-9):.0f}x)\n"
    )
    out.write(
        f"mesh cost per step (gRPC + Redis + env RPC + weight sync): {mesh_cost:.4f} s = "
        f"{mesh_cost / step_s:.1%} of the step\n"
    )
    out.write(
        f"steps/s: {1 / step_s:.2f}; tokens/s: "
        f"{statistics.fmean(s.metrics.get('tokens_per_s', 0.0) for s in steps):.0f}\n"
    )
    return step_s


def _write_cpu(ms_per_step: dict[str, float], step_s: float) -> None:
    """CPU each process used per step, against the wall time the cores offered."""
    cores = os.cpu_count() or 1
    out = sys.stdout
    out.write(f"\nCPU per step by process (ms; {cores} cores x {step_s * 1000:.1f} ms a step "
              f"= {cores * step_s * 1000:.1f} ms on offer)\n")  # fmt: skip
    for name, ms in ms_per_step.items():
        out.write(f"  {name:<26}{ms:>8.1f}\n")
    out.write(f"  {'all':<26}{sum(ms_per_step.values()):>8.1f}\n")


if __name__ == "__main__":
    main()
