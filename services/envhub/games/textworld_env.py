"""``textworld``: a multi-turn household text game in the spirit of ALFWorld.

Each episode plays one TextWorld game generated locally (``textworld_games``): a few rooms in a
row with furniture and objects, and a task such as "put the mug in the fridge". The first
observation is the task, the room and the admissible commands; each turn the model replies
with one command (its last non-empty line is taken, e.g. ``go east``), and the game's answer
plus the admissible commands come back. Reward 1.0 when the task is done (``outcome`` win);
the turn that reaches ``max_turns`` without it ends the episode with 0.0 (``outcome`` loss).

Reset options (strings): ``rooms`` (1-4, default 2), ``distractors`` (objects besides the
target, 0-8, default 3), ``games`` (how many different games the seeds share: the game is
``seed % games``; default 0 = one game per seed), ``max_turns`` (1-100, default 30). The same
seed and options always give the same game. Games are built on first use (seconds each, in a
helper process that ``GeneratorWorker`` keeps warm) into ``cache_dir``
(``$OPENTINKER_TEXTWORLD_CACHE``, default ``~/.cache/opentinker/textworld``); build them ahead
with ``textworld_games.ensure_game`` to keep first resets fast. Needs the ``textworld``
package.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, ClassVar

from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.games.textworld_games import (
    MAX_DISTRACTORS,
    MAX_ROOMS,
    GeneratorWorker,
)

DEFAULT_CACHE_DIR = Path(
    os.environ.get(
        "OPENTINKER_TEXTWORLD_CACHE", Path.home() / ".cache" / "opentinker" / "textworld"
    )
)
_OPTION_RANGES = {
    "rooms": (1, MAX_ROOMS),
    "distractors": (0, MAX_DISTRACTORS),
    "games": (0, 2**63),
    "max_turns": (1, 100),
}
_PROMPT = re.compile(r"\n>[^\n]*\Z")  # TextWorld's input prompt and status line, at the end
_PREFIX = re.compile(r"^(?:action|command|next command)\s*:\s*", re.IGNORECASE)
MAX_COMMAND_CHARS = 200


def parse_command(text: str) -> str:
    """The command in a reply: its last non-empty line, without decoration, lower case."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    command = _PREFIX.sub("", lines[-1]) if lines else ""
    command = command.strip("`'\"*> .").lower()
    return " ".join(command.split())[:MAX_COMMAND_CHARS]


def _options(given: dict[str, str]) -> dict[str, int]:
    values, problems = {}, []
    for name, text in given.items():
        low, high = _OPTION_RANGES[name]
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            problems.append(f"{name} must be an integer in [{low}, {high}], got {text!r}")
        values[name] = value
    if problems:
        raise ValueError("env option " + "; ".join(problems))
    return values


def _cleaned(feedback: str) -> str:
    text = _PROMPT.sub("", feedback)
    text = text.split("*** The End ***")[0]
    return re.sub(r"\n{3,}", "\n\n", text).strip()


class HouseholdGame(AbstractGame):
    """One generated household game per episode; the model types commands."""

    name = "textworld"
    description = (
        "Multi-turn: a generated household text game (TextWorld, like ALFWorld); put an object "
        "in its place. Reward 1 on the goal."
    )
    max_turns = 30
    cache_dir: ClassVar[Path] = DEFAULT_CACHE_DIR
    generator: ClassVar[GeneratorWorker] = GeneratorWorker()  # shared by the process's games

    def __init__(self, cache_dir: str | Path | None = None) -> None:
        self._cache = Path(cache_dir) if cache_dir is not None else self.cache_dir
        self._env: Any = None  # a textworld Environment once reset
        self.turn_limit = self.max_turns
        self.turns = 0
        self.game_file: Path | None = None

    def get_system_prompt(self) -> str:
        return (
            "You are a household robot in a text game. Each turn, reply with exactly one "
            "command, chosen from the admissible commands, on the last line of your reply "
            "(for example: go east). Complete the task in as few turns as you can."
        )

    def reset(
        self,
        *,
        seed: int = 0,
        rooms: str = "2",
        distractors: str = "3",
        games: str = "0",
        max_turns: str = "",
    ) -> str:
        given = {"rooms": rooms, "distractors": distractors, "games": games}
        values = _options({**given, **({"max_turns": max_turns} if max_turns else {})})
        self.turn_limit = values.get("max_turns", self.max_turns)
        game_seed = seed % values["games"] if values["games"] else seed
        self.close()
        self.game_file = self.generator.path(
            self._cache, game_seed, rooms=values["rooms"], distractors=values["distractors"]
        )
        import textworld  # a server-side dependency, needed only to play
        from jericho import UnsupportedGameWarning

        # Jericho warns that it cannot detect score changes in generated games; TextWorld
        # tracks the quest itself, so the warning says nothing here.
        warnings.filterwarnings("ignore", category=UnsupportedGameWarning)
        infos = textworld.EnvInfos(
            admissible_commands=True, objective=True, description=True, won=True, lost=True
        )
        self._env = textworld.start(str(self.game_file), request_infos=infos)
        state = self._env.reset()
        self.turns = 0
        return f"{state.objective}\n\n{state.description}\n\n{self._admissible(state)}"

    def step(self, action: str) -> StepResult:
        self.turns += 1
        command = parse_command(action)
        if not command:
            text = "No command found: end your reply with one command, e.g. look."
            return self._after(text, won=False, lost=False, command=command)
        state, _, _ = self._env.step(command)
        observation = _cleaned(state.feedback) or "Nothing happens."
        if not (state.won or state.lost):
            observation += f"\n\n{self._admissible(state)}"
        return self._after(observation, won=state.won, lost=state.lost, command=command)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def _after(self, observation: str, *, won: bool, lost: bool, command: str) -> StepResult:
        info = {"command": command, "turns": str(self.turns)}
        if won:
            return StepResult(
                observation=f"{observation}\n\nTask complete.",
                reward=1.0,
                done=True,
                info={**info, "outcome": "win"},
            )
        if lost or self.turns >= self.turn_limit:
            why = "The game is lost." if lost else f"Turn limit reached ({self.turn_limit})."
            return StepResult(
                observation=f"{observation}\n\n{why}",
                reward=0.0,
                done=True,
                info={**info, "outcome": "loss"},
            )
        return StepResult(
            observation=observation, reward=0.0, done=False, info={**info, "outcome": "ongoing"}
        )

    @staticmethod
    def _admissible(state: Any) -> str:
        commands = "\n".join(f"- {c}" for c in state.admissible_commands)
        return f"Admissible commands:\n{commands}"
