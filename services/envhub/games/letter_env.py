"""``letter``: the built-in toy environment of the demo.

Single turn and data-free: the seed picks a target letter among the first ``num_letters``
letters of A..Z, the user message names it, and the reward is 1.0 when the answer (stripped
of whitespace) starts with that capital letter, else 0.0. A tiny model learns it in a few
RL steps, which makes it the end-to-end check of the whole mesh.
"""

from __future__ import annotations

import random
import string

from opentinker.game import AbstractGame, StepResult

DEFAULT_NUM_LETTERS = "8"


def parse_num_letters(value: str) -> int:
    """The ``num_letters`` option as an int in 1..26, or a ValueError saying what to pass."""
    try:
        count = int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= len(string.ascii_uppercase):
        raise ValueError(f"env option num_letters must be an integer 1..26, got {value!r}")
    return count


def parse_format_reward(value: str) -> float:
    """The ``format_reward`` option as a float in [0, 1], or a ValueError saying what to pass."""
    try:
        reward = float(value)
    except ValueError:
        reward = -1.0
    if not 0.0 <= reward <= 1.0:
        raise ValueError(f"env option format_reward must be a number in [0, 1], got {value!r}")
    return reward


class LetterGame(AbstractGame):
    """Answer with the letter the user names."""

    name = "letter"
    description = "Single turn: answer with the capital letter the user names (reward 0 or 1)."
    max_turns = 1

    def __init__(self) -> None:
        self.target = ""
        self.letters = ""
        self.format_reward = 0.0

    def get_system_prompt(self) -> str:
        return "You answer with a single capital letter."

    def generate_initial_state(self, seed: int, **options: str) -> str:
        """The target letter: uniform over the first num_letters letters, fixed by the seed;
        or the ``target`` option's letter (one of them) whatever the seed."""
        count = parse_num_letters(options.get("num_letters", DEFAULT_NUM_LETTERS))
        letters = string.ascii_uppercase[:count]
        target = options.get("target", "")
        if target:
            if len(target) != 1 or target not in letters:
                raise ValueError(
                    f"env option target must be one of the {count} letters in play "
                    f"({letters}), got {target!r}"
                )
            return target
        return random.Random(seed).choice(letters)

    def reset(
        self,
        *,
        seed: int = 0,
        num_letters: str = DEFAULT_NUM_LETTERS,
        format_reward: str = "0",
        target: str = "",
    ) -> str:
        """Options: num_letters (1..26); format_reward (0..1), the reward for answering with
        another of the letters in play instead of the named one (0 = plain task); target: one
        fixed letter to name in every episode (empty = drawn by the seed)."""
        self.target = self.generate_initial_state(seed, num_letters=num_letters, target=target)
        self.letters = string.ascii_uppercase[: parse_num_letters(num_letters)]
        self.format_reward = parse_format_reward(format_reward)
        return f"Answer with the letter {self.target}."

    def step(self, action: str) -> StepResult:
        answer = action.strip()
        if answer.startswith(self.target):
            reward, outcome = 1.0, "win"
        elif answer[:1] and answer[0] in self.letters:
            reward, outcome = self.format_reward, "loss"
        else:
            reward, outcome = 0.0, "loss"
        info = {"target": self.target, "outcome": outcome}
        return StepResult(observation="", reward=reward, done=True, info=info)
