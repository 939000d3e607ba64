"""``math``: single-turn math problems from a dataset, graded for mathematical equivalence.

Each episode is one dataset row (``DatasetGame``: the seed picks it; reset options ``split``
and ``index``). The model answers once; the reward is 1.0 when the final answer in its reply
(ideally in ``\\boxed{}``) equals the ground truth as a value (see ``math_grading``), else 0.0.
With no dataset given, it plays the generated one (``math_dataset.default_math_dataset``).
"""

from __future__ import annotations

from pathlib import Path

from opentinker.data import Dataset
from opentinker.dataset_game import DatasetGame
from opentinker.game import StepResult
from opentinker.services.envhub.games.math_dataset import default_math_dataset
from opentinker.services.envhub.games.math_grading import extracted_answer, is_equivalent

SYSTEM_PROMPT = (
    "Solve the math problem. Reason step by step, then put only the final answer in "
    "\\boxed{}, e.g. \\boxed{\\frac{3}{4}}."
)


class MathGame(DatasetGame):
    """One problem, one answer, reward 1 for an equivalent final answer."""

    name = "math"
    description = "Single turn: solve a math problem; reward 1 when the boxed answer is right."
    max_turns = 1

    def __init__(self, dataset: Dataset | str | Path | None = None) -> None:
        super().__init__(dataset if dataset is not None else default_math_dataset())

    def get_system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def step(self, action: str) -> StepResult:
        correct = is_equivalent(action, self.row.ground_truth)
        return StepResult(
            observation="",
            reward=1.0 if correct else 0.0,
            done=True,
            info={
                "ground_truth": self.row.ground_truth,
                "answer": extracted_answer(action),
                "correct": str(correct).lower(),
            },
        )
