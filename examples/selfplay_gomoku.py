"""Gomoku self-play: black and white, one LoRA adapter each, trained against each other.

    python examples/selfplay_gomoku.py --local --model runs/tiny-qwen2 --steps 10
    python examples/selfplay_gomoku.py --scheduler 127.0.0.1:50051 --model Qwen/Qwen2.5-1.5B

``--local`` starts the single-node mesh in this process (``opentinker tiny-model --out
runs/tiny-qwen2`` builds the tiny model); otherwise the job goes to a running scheduler (API key
from ``$OPENTINKER_API_KEY``). Every ``--val-every`` steps each role's adapter plays fixed
validation games against the heuristic opponent (``heuristic_plays=alternate``), and the step
reports ``role/black/win_rate_vs_heuristic`` and ``role/white/win_rate_vs_heuristic``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

import opentinker
from opentinker import JobSpec, LoraConfig, ModelSpec, RlConfig, SamplingParams


def selfplay_spec(model: str, *, steps: int, val_every: int, untrained: bool) -> JobSpec:
    """The self-play job: 4 games x 4 samples per step, both roles' adapters trained."""
    return JobSpec(
        name="gomoku-selfplay",
        model=ModelSpec(base_model=model, finetune="lora", lora=LoraConfig(rank=8)),
        rl=RlConfig(
            env_name="gomoku_selfplay",
            # A model that cannot write moves yet gets a random legal one (and the penalty).
            env_options={"invalid_move": "random"} if untrained else {},
            role_adapters="per_role",
            steps=steps,
            prompts_per_step=4,
            samples_per_prompt=4,
            learning_rate=1e-3 if untrained else 1e-5,
            sampling=SamplingParams(max_new_tokens=16 if untrained else 256),
            # Both roles' turns; a byte-level tiny tokenizer spends ~220 tokens per board.
            max_turns=20 if untrained else None,
            max_episode_tokens=4096,
            val_every=val_every,
            val_episodes=16,
            val_env_options={"heuristic_plays": "alternate"},
        ),
    )


@contextlib.contextmanager
def client_for(args: argparse.Namespace) -> Iterator[opentinker.Client]:
    if not args.local:
        with opentinker.Client(args.scheduler, timeout=30) as client:
            yield client
        return
    from opentinker.services.launcher.mesh import LocalMesh, MeshSettings  # server extras

    with (
        LocalMesh(MeshSettings(run_root=Path("runs/selfplay"))) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=30) as client,
    ):
        yield client


def show(event: opentinker.JobEvent) -> None:
    if event.kind != "step":
        print(event.kind, event.state or "")
        return
    m = event.metrics
    roles = "  ".join(
        f"{name.removeprefix('role/')}={value:.3f}"
        for name, value in sorted(m.items())
        if name.startswith("role/")
    )
    print(f"step {event.step:3d}  reward_mean={m['reward_mean']:.3f}  {roles}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", default="127.0.0.1:50051")
    parser.add_argument("--local", action="store_true", help="start a mesh in this process")
    parser.add_argument("--model", default="runs/tiny-qwen2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument(
        "--trained-model", action="store_true", help="a model that writes moves: no random moves"
    )
    args = parser.parse_args()
    local_dir = Path(args.model)
    model = str(local_dir.resolve()) if local_dir.exists() else args.model  # the worker's cwd
    spec = selfplay_spec(
        model, steps=args.steps, val_every=args.val_every, untrained=not args.trained_model
    )
    with client_for(args) as client:
        job = client.fit(spec, timeout=24 * 3600, on_event=show)
    print(job.state, job.checkpoint_uri)


if __name__ == "__main__":
    main()
