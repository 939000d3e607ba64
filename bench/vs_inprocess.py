"""The demo task through the full mesh against the same GRPO in one process, in one run.

The demo's job (services/launcher/demo.py: tiny random-init Qwen2, env ``letter`` with 8
letters, 16 prompts x 8 samples, lr 1e-4, full fine-tuning, one token per answer) runs first
through the real single-node mesh (Redis, scheduler, EnvHub, worker -> trainer + rollout, each
its own process), once per ``--staleness`` value, then in one process: the trainer's own
``rl_update`` with the same UpdateConfig, sampling by the rollout's ``TransformersEngine`` and
the letter game's reward computed directly. Each run stops when the 10-step mean reward
reaches ``--target``.

Seconds to target count from the start of training (the mesh: the first step's start, i.e. its
event time minus its step time; in-process: the first sample), so process start-up and model
load are not in it; the mesh's whole wall-clock (submit -> success) is printed beside it.

    .venv/bin/python bench/vs_inprocess.py [--staleness 0,1] [--target 0.95] [--max-steps 1500]
    .venv/bin/python bench/vs_inprocess.py --repeat 3   # rounds interleaved; medians, spread
    .venv/bin/python bench/vs_inprocess.py --quick      # 3 steps each: the figures, not a race
    .venv/bin/python bench/vs_inprocess.py --hidden-size 512 --layers 4 --target 1 --max-steps 60

``--hidden-size`` and ``--layers`` build a larger random-init Qwen2 of the same shape family
(MLP 4 x hidden): the mesh's own cost per step is about constant, so its ratio to in-process
should fall as the model's compute grows. A random model of another size learns at another
pace; ``--target 1 --max-steps N`` runs exactly N steps each and compares s/step only.

One run of each is noisy on a shared 2-core machine (the same configuration moves by +-10%
between runs minutes apart), so ``--repeat N`` plays N rounds, each round every mesh run then
the in-process one, and prints each round's ratios (a round's runs are minutes apart, so they
share the machine's state) and their median with the lowest and highest.
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from arguments import positive_int  # bench/ is sys.path[0]
from learn_letters_inprocess import sample_group_batch
from transformers import AutoConfig, AutoModelForCausalLM

import opentinker
from opentinker.jobs import JobEvent
from opentinker.services.launcher.demo import demo_spec
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_scaled_model
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.batch_work import UpdateConfig
from opentinker.services.trainer.rl.training import rl_update
from opentinker.spec import JobSpec, RlConfig

WINDOW = 10  # the loop's reward window (stop_at_reward is a 10-step mean)


@dataclass
class Run:
    """One way of training: its steps, whether and when it reached the target."""

    name: str
    steps: int = 0
    seconds_to_target: float | None = None
    train_seconds: float = 0.0  # start of training -> last step
    wall_seconds: float = 0.0  # everything, start-up included
    step_times: dict[str, float] | None = None  # mean time_* figures of a step

    @property
    def seconds_per_step(self) -> float:
        return self.train_seconds / self.steps if self.steps else 0.0


def mesh_run(spec: JobSpec, root: Path, staleness: int) -> Run:
    """The demo job through a fresh single-node mesh."""
    assert spec.rl is not None  # an RL job (demo_spec)
    rl = spec.rl.model_copy(update={"max_staleness": staleness})
    spec = spec.model_copy(update={"rl": rl})
    run = Run(f"mesh, staleness {staleness}")
    steps: list[JobEvent] = []
    started = time.monotonic()
    settings = MeshSettings(run_root=root / f"mesh-s{staleness}", warm_spares=0)
    with (
        LocalMesh(settings) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
    ):
        client.fit(spec, on_event=lambda e: steps.append(e) if e.kind == "step" else None)
    run.wall_seconds = time.monotonic() - started
    if not steps:
        return run
    start = steps[0].time_unix_s - steps[0].metrics.get("time_step_s", 0.0)
    rewards = [s.metrics["reward_mean"] for s in steps]
    run.steps = len(steps)
    run.train_seconds = steps[-1].time_unix_s - start
    reached = first_reaching(rewards, rl.stop_at_reward or 1.0)
    if reached is not None:
        run.seconds_to_target = steps[reached].time_unix_s - start
    timed = steps[2:] or steps  # the first steps include warm-up
    keys = sorted(k for k in timed[0].metrics if k.startswith("time_"))
    run.step_times = {k: sum(s.metrics.get(k, 0.0) for s in timed) / len(timed) for k in keys}
    return run


def inprocess_run(spec: JobSpec, model_dir: Path) -> Run:
    """The same GRPO in this process: sample with the rollout's engine, reward directly."""
    assert spec.rl is not None
    rl = spec.rl
    torch.manual_seed(rl.seed)
    rng = random.Random(rl.seed)
    alphabet = string.ascii_uppercase[: int(rl.env_options["num_letters"])]
    policy = Policy(spec.model, learning_rate=rl.learning_rate)
    config = UpdateConfig.from_rl(rl)
    run = Run("in-process")
    rewards: list[float] = []
    split = {"time_generate_s": 0.0, "time_train_s": 0.0}
    started = time.monotonic()
    while run.steps < rl.steps:
        episodes, generate_s, train_s = demo_step(policy, rl, config, rng, alphabet)
        split["time_generate_s"] += generate_s
        split["time_train_s"] += train_s
        rewards.append(sum(e.reward for e in episodes) / len(episodes))
        run.steps += 1
        if first_reaching(rewards, rl.stop_at_reward or 1.0) is not None:
            run.seconds_to_target = time.monotonic() - started
            break
    run.train_seconds = run.wall_seconds = time.monotonic() - started
    run.step_times = {k: v / max(1, run.steps) for k, v in split.items()}
    return run


def demo_step(
    policy: Policy, rl: RlConfig, config: UpdateConfig, rng: random.Random, alphabet: str
) -> tuple[list[Episode], float, float]:
    """One in-process GRPO step of the demo task: sample a group per prompt with the rollout's
    ``TransformersEngine``, reward directly, update. Returns the episodes and the seconds
    spent generating and training."""
    letters = [rng.choice(alphabet) for _ in range(rl.prompts_per_step)]
    started = time.monotonic()
    episodes, _ = sample_group_batch(
        policy,
        letters,
        rl.samples_per_prompt,
        rl.sampling.max_new_tokens,
        rl.sampling.temperature,
        True,
        alphabet,
    )
    generated = time.monotonic()
    rl_update(policy, episodes, config)
    return episodes, generated - started, time.monotonic() - generated


def report_rounds(rounds: list[list[Run]]) -> None:
    """Across rounds: each run's seconds to target and each mesh run's ratio to the same
    round's in-process run, as median [lowest, highest]."""
    out = sys.stdout
    out.write(f"\nover {len(rounds)} rounds: median [lowest, highest]\n")
    for position, first in enumerate(rounds[0]):
        seconds = _spread([r[position].seconds_to_target for r in rounds], "s")
        per_step = _spread([r[position].seconds_per_step or None for r in rounds], "s", 4)
        out.write(f"{first.name:<20} s to target {seconds}   s/step {per_step}\n")
    for position, first in enumerate(rounds[0][:-1]):
        to_target = [_ratio(r[position].seconds_to_target, r[-1].seconds_to_target) for r in rounds]
        step_ratios = [_ratio(r[position].seconds_per_step, r[-1].seconds_per_step) for r in rounds]
        out.write(
            f"ratio {first.name} / in-process (same round): s to target "
            f"{_spread(to_target, 'x')}   s/step {_spread(step_ratios, 'x')}\n"
        )


def _ratio(mesh: float | None, base: float | None) -> float | None:
    return mesh / base if mesh and base else None


def _spread(values: list[float | None], unit: str, digits: int = 2) -> str:
    """``median [lowest, highest]`` of the values measured (None: not reached)."""
    reached = [v for v in values if v is not None]
    if not reached:
        return "n/a (not reached)"
    missed = len(values) - len(reached)
    low, mid, high = (
        f"{v:.{digits}f}" for v in (min(reached), statistics.median(reached), max(reached))
    )
    return f"{mid}{unit} [{low}, {high}]" + (f" ({missed} not reached)" if missed else "")


def first_reaching(rewards: list[float], target: float) -> int | None:
    """Index of the first step whose 10-step mean reward is >= target (after 10 steps)."""
    for i in range(WINDOW - 1, len(rewards)):
        if sum(rewards[i - WINDOW + 1 : i + 1]) / WINDOW >= target:
            return i
    return None


def report(runs: list[Run], target: float) -> None:
    out = sys.stdout
    out.write(f"\ndemo task to a {WINDOW}-step mean reward of {target}\n")
    out.write(f"{'run':<20}{'steps':>7}{'s/step':>9}{'s to target':>13}{'wall s':>9}\n")
    for r in runs:
        to_target = (
            f"{r.seconds_to_target:.1f}" if r.seconds_to_target is not None else "not reached"
        )
        out.write(
            f"{r.name:<20}{r.steps:>7}{r.seconds_per_step:>9.4f}{to_target:>13}"
            f"{r.wall_seconds:>9.1f}\n"
        )
    base = runs[-1]
    for r in runs[:-1]:
        if r.seconds_to_target and base.seconds_to_target:
            ratio = r.seconds_to_target / base.seconds_to_target
            out.write(f"ratio {r.name} / in-process (seconds to target): {ratio:.2f}x\n")
        else:
            out.write(f"ratio {r.name} / in-process (seconds to target): n/a (not reached)\n")
        if base.seconds_per_step:
            out.write(
                f"ratio {r.name} / in-process (s/step): "
                f"{r.seconds_per_step / base.seconds_per_step:.2f}x\n"
            )
    for r in runs:
        if r.step_times:
            split = "  ".join(
                f"{k.removeprefix('time_').removesuffix('_s')} {v:.4f}"
                for k, v in r.step_times.items()
            )
            out.write(f"step split ({r.name}, mean s): {split}\n")


def parameter_count(model_dir: Path) -> int:
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", default="0,1", help="mesh runs, comma-separated")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--quick", action="store_true", help="3 steps per run (a smoke test)")
    parser.add_argument(
        "--repeat", type=positive_int, default=1, help="rounds of every run, interleaved"
    )
    parser.add_argument("--hidden-size", type=positive_int, default=128, help="128: the demo's")
    parser.add_argument("--layers", type=positive_int, default=2, help="2: the demo's")
    args = parser.parse_args()
    max_steps = 3 if args.quick else args.max_steps

    root = Path(tempfile.mkdtemp(prefix="opentinker-vs-inprocess-"))
    model_dir = ensure_scaled_model(
        root / "qwen2", hidden_size=args.hidden_size, num_layers=args.layers
    )
    sys.stdout.write(
        f"model: random-init Qwen2, hidden {args.hidden_size}, {args.layers} layers, "
        f"{parameter_count(model_dir) / 1e6:.1f}M parameters\n"
    )
    spec = demo_spec(model_dir, threshold=args.target, max_steps=max_steps)
    rounds: list[list[Run]] = []
    for index in range(args.repeat):
        round_root = root / f"round-{index}"
        runs = [mesh_run(spec, round_root, int(s)) for s in args.staleness.split(",")]
        runs.append(inprocess_run(spec, model_dir))
        if args.repeat > 1:
            sys.stdout.write(f"\n== round {index + 1} of {args.repeat}")
        report(runs, args.target)
        rounds.append(runs)
    if args.repeat > 1:
        report_rounds(rounds)


if __name__ == "__main__":
    main()
