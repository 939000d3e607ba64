"""How the step time grows: 1, 2 and 4 concurrent jobs on one machine, and 128 -> 1024
episodes per step, all through the real single-node mesh (Redis, scheduler, EnvHub, worker ->
trainer + rollout processes per job) with the demo's tiny model and task.

Concurrent jobs: k copies of the demo job (16 prompts x 8 samples, ``--steps`` steps each, no
reward target) submitted at once to a mesh whose worker has k slots; printed: each job's mean
s/step, the mesh's aggregate steps/s and episodes/s, and both against k = 1.

Batch sizes: one job per size, ``--batch-steps`` steps each, ``prompts_per_step`` x 8 samples =
128 ... 1024 episodes; printed: mean s/step, its split (generate / env / train / sync / mesh)
and the growth against 128 (linear growth would be the ratio of the sizes).

s/step is the wall-clock between consecutive step events of a job (the first step, which pays
process and model start-up, only starts the clock); the split is the mean of the steps' own
time_* metrics after the first (with the default staleness 1 generation overlaps training).

    .venv/bin/python bench/scaling.py [--jobs 1,2,4] [--steps 12]
                                      [--batches 128,256,512,1024] [--batch-steps 4]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import structlog

import opentinker
from opentinker.jobs import JobEvent
from opentinker.services.launcher.demo import demo_spec
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.spec import JobSpec

SAMPLES_PER_PROMPT = 8
SPLIT = ("time_generate_s", "time_env_s", "time_train_s", "time_weight_sync_s", "time_mesh_s")


@dataclass
class JobFigures:
    """The step events of one finished job, start-up step left out."""

    steps: list[JobEvent]

    @property
    def seconds_per_step(self) -> float:
        """Wall-clock between consecutive steps (what a user waits; overlap included)."""
        times = [s.time_unix_s for s in self.steps]
        return mean(b - a for a, b in zip(times, times[1:], strict=False)) if len(times) > 1 else 0

    def split(self) -> dict[str, float]:
        later = self.steps[1:] or self.steps
        return {k: mean(s.metrics.get(k, 0.0) for s in later) for k in SPLIT}


def job(model_dir: Path, *, steps: int, prompts: int, name: str) -> JobSpec:
    spec = demo_spec(model_dir, threshold=1.0, max_steps=steps)
    assert spec.rl is not None
    rl = spec.rl.model_copy(update={"prompts_per_step": prompts, "stop_at_reward": None})
    return spec.model_copy(update={"name": name, "rl": rl})


def run_jobs(root: Path, specs: list[JobSpec]) -> tuple[list[JobFigures], float]:
    """All ``specs`` at once through one fresh mesh with a slot each; (figures, wall seconds
    from the first submit to the last success)."""
    settings = MeshSettings(run_root=root, warm_spares=0, cpu_slots=len(specs))
    with (
        LocalMesh(settings) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
    ):

        def fit(spec: JobSpec) -> JobFigures:
            steps: list[JobEvent] = []
            client.fit(spec, on_event=lambda e: steps.append(e) if e.kind == "step" else None)
            return JobFigures(steps)

        started = time.monotonic()
        with ThreadPoolExecutor(len(specs)) as pool:
            figures = list(pool.map(fit, specs))
        return figures, time.monotonic() - started


def concurrent_jobs(model_dir: Path, root: Path, counts: list[int], steps: int) -> None:
    print(f"\n== concurrent jobs: k demo jobs at once, 16 x {SAMPLES_PER_PROMPT}, {steps} steps")
    print(f"{'k':>3} {'s/step (per job)':>17} {'steps/s (all)':>14} {'episodes/s':>11} "
          f"{'s/step vs k=1':>14} {'throughput vs k=1':>18}")  # fmt: skip
    base: tuple[float, float] | None = None
    for k in counts:
        specs = [job(model_dir, steps=steps, prompts=16, name=f"scale-{k}-{i}") for i in range(k)]
        figures, _ = run_jobs(root / f"jobs-{k}", specs)
        per_job = mean(f.seconds_per_step for f in figures)
        throughput = k / per_job  # steps per second of the whole mesh, steady state
        base = base or (per_job, throughput)
        print(f"{k:>3} {per_job:>17.3f} {throughput:>14.2f} "
              f"{throughput * 16 * SAMPLES_PER_PROMPT:>11.0f} {per_job / base[0]:>13.2f}x "
              f"{throughput / base[1]:>17.2f}x")  # fmt: skip


def batch_sizes(model_dir: Path, root: Path, sizes: list[int], steps: int) -> None:
    print(f"\n== batch size: one job, {steps} steps, episodes per step = prompts x "
          f"{SAMPLES_PER_PROMPT}")  # fmt: skip
    print(
        f"{'episodes':>9} {'s/step':>8} {'vs first':>9} {'size ratio':>11}  split: "
        + " ".join(k.removeprefix("time_").removesuffix("_s") for k in SPLIT)
    )
    base: float | None = None
    for size in sizes:
        prompts = size // SAMPLES_PER_PROMPT
        spec = job(model_dir, steps=steps, prompts=prompts, name=f"batch-{size}")
        (figures,), _ = run_jobs(root / f"batch-{size}", [spec])
        per_step = figures.seconds_per_step
        base = base or per_step
        split = " ".join(f"{v:.3f}" for v in figures.split().values())
        print(f"{size:>9} {per_step:>8.3f} {per_step / base:>8.2f}x "
              f"{size / sizes[0]:>10.0f}x  {split}")  # fmt: skip


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="1,2,4", help="concurrent job counts")
    parser.add_argument(
        "--steps", type=int, default=100, help="steps per concurrent job (enough to overlap)"
    )
    parser.add_argument("--batches", default="128,256,512,1024", help="episodes per step")
    parser.add_argument("--batch-steps", type=int, default=4, help="steps per batch-size job")
    args = parser.parse_args()
    sizes = [int(s) for s in args.batches.split(",") if s]
    if any(s % SAMPLES_PER_PROMPT for s in sizes):
        parser.error(f"--batches must be multiples of {SAMPLES_PER_PROMPT}")
    with tempfile.TemporaryDirectory(prefix="opentinker-scaling-") as tmp:
        root = Path(tmp)
        model_dir = ensure_tiny_model(root / "tiny-qwen2")
        if args.jobs:
            counts = [int(k) for k in args.jobs.split(",")]
            concurrent_jobs(model_dir, root, counts, args.steps)
        if sizes:
            batch_sizes(model_dir, root, sizes, args.batch_steps)


if __name__ == "__main__":
    main()
