"""What bench/real_model.py's two sides share: a step's point on the curve, a side's figures,
the mean split of a step, and the job's training and validation problems as the rollout plays
them (so TRL sees the same prompts in the same order)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentinker.eval_stats import Interval
from opentinker.services.envhub.games.arithmetic_env import ArithmeticGame
from opentinker.services.rollout.agent.seeds import derive_seed, eval_episode_seed
from opentinker.spec import RlConfig

SPLIT_KEYS = ("generate", "env", "train", "weight_sync", "mesh", "rollout_wait", "step")


@dataclass
class Point:
    """One step: training seconds since the first step began, its reward, and the validation
    accuracy after it (None: no validation then)."""

    seconds: float
    step: int
    reward: float
    val_accuracy: float | None = None


@dataclass
class Side:
    name: str
    before: Interval | None = None
    points: list[Point] = field(default_factory=list)
    split: dict[str, float] = field(default_factory=dict)  # mean seconds per step
    wall_seconds: float = 0.0

    @property
    def seconds_per_step(self) -> float:
        return self.points[-1].seconds / len(self.points) if self.points else 0.0

    def last_validation(self) -> Point | None:
        return next((p for p in reversed(self.points) if p.val_accuracy is not None), None)


def mean_split(events: list[dict[str, float]]) -> dict[str, float]:
    timed = events[1:] or events  # the first step includes warm-up
    return {k: sum(e.get(f"time_{k}_s", 0.0) for e in timed) / len(timed) for k in SPLIT_KEYS}


def training_problems(rl: RlConfig, steps: int) -> list[tuple[int, str]]:
    """(env seed, problem text) of each group of the first ``steps`` batches, in the order
    the rollout plays them."""
    game = ArithmeticGame()
    seeds = [
        derive_seed(rl.seed, "env", b, g) for b in range(steps) for g in range(rl.prompts_per_step)
    ]
    return [(s, game.reset(seed=s, **rl.env_options)) for s in seeds]


def validation_problems(rl: RlConfig) -> list[tuple[int, str]]:
    """(env seed, text) of the validation episodes the RL job's validation plays."""
    game, options = ArithmeticGame(), {**rl.env_options, **rl.val_env_options}
    seeds = [eval_episode_seed(rl.seed, i) for i in range(rl.val_episodes)]
    return [(s, game.reset(seed=s, **options)) for s in seeds]
