"""``gomoku``: a data-free, multi-turn game of five in a row against a heuristic opponent.

The model plays X on a 9x9 board, the opponent (``gomoku_opponent``) plays O; five or more in
a row across, down or diagonally wins. The seed decides who opens (and where the opponent's
opening stone goes) and the opponent's tie-breaks, so a seed replays the same game for the
same moves. Rewards: +1 win, -1 loss, 0 draw (full board), ``INVALID_MOVE_PENALTY`` for a move
that cannot be read or is taken (the board is shown again and the model retries); after
``max_invalid_moves`` of them the game is lost. The last step's ``info["outcome"]`` is
``win``, ``loss`` or ``draw``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.games.gomoku_board import Board, Stone
from opentinker.services.envhub.games.gomoku_opponent import HeuristicOpponent

BOARD_SIZE = 9
WIN_LENGTH = 5
WIN_REWARD, LOSS_REWARD, DRAW_REWARD = 1.0, -1.0, 0.0
INVALID_MOVE_PENALTY = -0.1
DEFAULT_MAX_INVALID_MOVES = "3"
DEFAULT_OPPONENT_SKILL = "1.0"


@dataclass(frozen=True)
class GomokuStart:
    """What a seed fixes: who opens, the opponent's opening cell, its tie-break seed."""

    opponent_first: bool
    opening: tuple[int, int]
    opponent_seed: int


def parse_options(opponent_skill: str, max_invalid_moves: str) -> tuple[float, int]:
    problems = []
    try:
        skill = float(opponent_skill)
    except ValueError:
        skill = -1.0
    if not 0.0 <= skill <= 1.0:
        problems.append(f"opponent_skill must be a number in [0, 1], got {opponent_skill!r}")
    try:
        limit = int(max_invalid_moves)
    except ValueError:
        limit = 0
    if limit < 1:
        problems.append(f"max_invalid_moves must be an integer >= 1, got {max_invalid_moves!r}")
    if problems:
        raise ValueError("env option " + "; ".join(problems))
    return skill, limit


class GomokuGame(AbstractGame):
    """Five in a row on 9x9 against the heuristic opponent; the model plays X."""

    name = "gomoku"
    description = "Multi-turn: 9x9 five in a row against a heuristic opponent (win +1, loss -1)."
    max_turns = 50  # 41 stones at most for X, plus room for a few invalid moves

    def __init__(self) -> None:
        self.board = Board(BOARD_SIZE, WIN_LENGTH)
        self.opponent = HeuristicOpponent(Stone.WHITE, random.Random(0))
        self.invalid_moves = 0
        self.max_invalid_moves = int(DEFAULT_MAX_INVALID_MOVES)

    def get_system_prompt(self) -> str:
        return (
            "You are playing Gomoku as X. Think briefly, then end your reply with your move: a "
            "column letter and a row number, like E5."
        )

    def get_initial_user_message(self) -> str:
        return (
            f"Gomoku on a {BOARD_SIZE}x{BOARD_SIZE} board: you are X, your opponent is O. "
            f"{WIN_LENGTH} in a row across, down or diagonally wins. Columns are letters, "
            "rows are numbers; '.' is an empty cell."
        )

    def generate_initial_state(self, seed: int, **options: str) -> GomokuStart:
        rng = random.Random(seed)
        middle = BOARD_SIZE // 2
        opening = (middle + rng.randint(-1, 1), middle + rng.randint(-1, 1))
        return GomokuStart(
            opponent_first=rng.random() < 0.5, opening=opening, opponent_seed=rng.getrandbits(64)
        )

    def reset(
        self,
        *,
        seed: int = 0,
        opponent_skill: str = DEFAULT_OPPONENT_SKILL,
        max_invalid_moves: str = DEFAULT_MAX_INVALID_MOVES,
    ) -> str:
        skill, self.max_invalid_moves = parse_options(opponent_skill, max_invalid_moves)
        start = self.generate_initial_state(seed)
        self.board = Board(BOARD_SIZE, WIN_LENGTH)
        self.opponent = HeuristicOpponent(
            Stone.WHITE, random.Random(start.opponent_seed), skill=skill
        )
        self.invalid_moves = 0
        opened = ""
        if start.opponent_first:
            self.board.place(start.opening, Stone.WHITE)
            opened = f"Your opponent opened at {self.board.name(start.opening)}.\n"
        return f"{opened}{self.board.render()}\nYour move (X)."

    def step(self, action: str) -> StepResult:
        try:
            cell = self.board.parse_move(action)
            won = self.board.place(cell, Stone.BLACK)
        except ValueError as exc:
            return self._invalid(str(exc))
        played = f"You played {self.board.name(cell)}."
        if won:
            return self._end(WIN_REWARD, "win", f"{played} Five in a row: you win.")
        if self.board.full:
            return self._end(DRAW_REWARD, "draw", f"{played} The board is full: a draw.")
        reply = self.opponent.choose(self.board)
        lost = self.board.place(reply, Stone.WHITE)
        played += f" Your opponent played {self.board.name(reply)}."
        if lost:
            return self._end(LOSS_REWARD, "loss", f"{played} Five in a row for O: you lose.")
        if self.board.full:
            return self._end(DRAW_REWARD, "draw", f"{played} The board is full: a draw.")
        return StepResult(
            observation=f"{played}\n{self.board.render()}\nYour move (X).",
            reward=0.0,
            done=False,
            info=self._info("ongoing"),
        )

    def _invalid(self, problem: str) -> StepResult:
        self.invalid_moves += 1
        if self.invalid_moves >= self.max_invalid_moves:
            return self._end(
                LOSS_REWARD,
                "loss",
                f"Invalid move ({problem}); that was {self.invalid_moves} invalid moves: you lose.",
            )
        left = self.max_invalid_moves - self.invalid_moves
        return StepResult(
            observation=(
                f"Invalid move: {problem}. {left} more invalid move(s) lose the game.\n"
                f"{self.board.render()}\nYour move (X)."
            ),
            reward=INVALID_MOVE_PENALTY,
            done=False,
            info=self._info("ongoing"),
        )

    def _end(self, reward: float, outcome: str, message: str) -> StepResult:
        observation = f"{message}\n{self.board.render()}"
        return StepResult(
            observation=observation, reward=reward, done=True, info=self._info(outcome)
        )

    def _info(self, outcome: str) -> dict[str, str]:
        return {
            "outcome": outcome,
            "stones": str(self.board.moves),
            "invalid_moves": str(self.invalid_moves),
        }
