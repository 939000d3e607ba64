"""``bandit``: a data-free, single-turn multi-armed bandit.

The model is offered arms named A, B, C...; each arm pays 1.0 with its own fixed probability
(the ``arm_probabilities`` option, the same for every episode, never shown to the model) and
0.0 otherwise. The episode's seed draws the payout, so a seed and an answer always give the
same reward. A policy learns which arm is best only from rewards: the smallest RL problem with
noise. An answer naming no arm (its first letter A.. after stripping) earns 0.0.
"""

from __future__ import annotations

import math
import random
import string

from opentinker.game import AbstractGame, StepResult

DEFAULT_ARM_PROBABILITIES = "0.3,0.8,0.5,0.1"


def parse_arm_probabilities(value: str) -> list[float]:
    """The ``arm_probabilities`` option: 2..26 comma-separated probabilities in [0, 1]."""
    try:
        probabilities = [float(part) for part in value.split(",")]
    except ValueError:
        probabilities = []
    if not 2 <= len(probabilities) <= 26 or not all(
        math.isfinite(p) and 0.0 <= p <= 1.0 for p in probabilities
    ):
        raise ValueError(
            "env option arm_probabilities must be 2..26 comma-separated numbers in [0, 1], "
            f"e.g. {DEFAULT_ARM_PROBABILITIES!r}; got {value!r}"
        )
    return probabilities


class BanditGame(AbstractGame):
    """Pick an arm; it pays 1 with its hidden probability."""

    name = "bandit"
    description = "Single turn: pick one arm (A, B, ...); each pays 1 with a hidden probability."
    max_turns = 1

    def __init__(self) -> None:
        self.arms = ""
        self.probabilities: list[float] = []
        self.payout_draw = 0.0

    def get_system_prompt(self) -> str:
        return "You choose one slot machine. Answer with its letter only."

    def generate_initial_state(self, seed: int, **options: str) -> float:
        """The payout draw in [0, 1): an arm pays when its probability exceeds it."""
        return random.Random(seed).random()

    def reset(self, *, seed: int = 0, arm_probabilities: str = DEFAULT_ARM_PROBABILITIES) -> str:
        self.probabilities = parse_arm_probabilities(arm_probabilities)
        self.arms = string.ascii_uppercase[: len(self.probabilities)]
        self.payout_draw = self.generate_initial_state(seed)
        return f"Machines: {', '.join(self.arms)}. Which one do you play?"

    def step(self, action: str) -> StepResult:
        choice = action.strip()[:1]
        if not choice or choice not in self.arms:
            info = {"arm": "", "valid": "false"}
            return StepResult(observation="", reward=0.0, done=True, info=info)
        paid = self.payout_draw < self.probabilities[self.arms.index(choice)]
        info = {"arm": choice, "valid": "true"}
        return StepResult(observation="", reward=1.0 if paid else 0.0, done=True, info=info)
