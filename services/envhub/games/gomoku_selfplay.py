"""``gomoku_selfplay``: Gomoku with two roles, ``black`` (X, opens) and ``white`` (O), for
multi-agent self-play: one agent per role, each trained as its own adapter.

The board, rules and move format are ``gomoku``'s (9x9, five in a row). Every reply is
addressed to the role that moves next and tells it the other's last move. Per-role rewards
(``StepResult.role_rewards``) come at the end: the winner 1, the loser 0, both 0.5 for a draw
(full board). An unreadable or taken move costs its role ``INVALID_MOVE_PENALTY`` and the same
role tries again; its ``max_invalid_moves``-th one loses the game. With env option
``invalid_move=random`` (for a model that cannot yet write moves, e.g. at the start of
training) an invalid move still costs the penalty but a random empty cell (seeded) is played
for that role instead, and the game goes on.

Env option ``heuristic_plays`` = ``black`` or ``white`` lets the heuristic opponent
(``gomoku_opponent``, at ``opponent_skill``) play that role inside the env: only the other
role's agent plays (its win rate against the heuristic: ``info["opponent"]`` is
``heuristic``).
``alternate`` gives the heuristic white on even seeds and black on odd ones, so a validation
set measures both roles. The last step's ``info["outcome"]`` is ``black_win``, ``white_win`` or
``draw``; ``info["winner"]`` is the winning role (empty for a draw).
"""

from __future__ import annotations

import random

from opentinker.game import AbstractGame, Role, StepResult
from opentinker.services.envhub.games.gomoku_board import Board, Stone
from opentinker.services.envhub.games.gomoku_env import (
    BOARD_SIZE,
    DEFAULT_MAX_INVALID_MOVES,
    DEFAULT_OPPONENT_SKILL,
    INVALID_MOVE_PENALTY,
    WIN_LENGTH,
    parse_options,
)
from opentinker.services.envhub.games.gomoku_opponent import HeuristicOpponent

BLACK, WHITE = "black", "white"
WIN_REWARD, LOSS_REWARD, DRAW_REWARD = 1.0, 0.0, 0.5
_STONE = {BLACK: Stone.BLACK, WHITE: Stone.WHITE}
_OTHER = {BLACK: WHITE, WHITE: BLACK}
_HEURISTIC_CHOICES = ("", BLACK, WHITE, "alternate")
_INVALID_CHOICES = ("retry", "random")


def _role_prompt(role: str) -> str:
    stone = _STONE[role].value
    return (
        f"You are playing Gomoku as {role} ({stone}). Think briefly, then end your reply with "
        "your move: a column letter and a row number, like E5."
    )


class GomokuSelfPlayGame(AbstractGame):
    """Two agents, black (X) and white (O), play five in a row on 9x9; black opens."""

    name = "gomoku_selfplay"
    description = "Self-play: 9x9 five in a row, roles black and white (win 1, loss 0, draw 0.5)."
    max_turns = 100  # model turns of both roles: 81 stones at most, plus a few invalid moves
    roles = (Role(BLACK, _role_prompt(BLACK)), Role(WHITE, _role_prompt(WHITE)))

    def __init__(self) -> None:
        self.board = Board(BOARD_SIZE, WIN_LENGTH)
        self.to_move = BLACK
        self.invalid_moves = {BLACK: 0, WHITE: 0}
        self.max_invalid_moves = int(DEFAULT_MAX_INVALID_MOVES)
        self.heuristic: HeuristicOpponent | None = None
        self.heuristic_role = ""
        self.random_for_invalid: random.Random | None = None

    def get_system_prompt(self) -> str:
        return _role_prompt(self.first_role())

    def first_role(self) -> str:
        return self.to_move

    def reset(
        self,
        *,
        seed: int = 0,
        heuristic_plays: str = "",
        opponent_skill: str = DEFAULT_OPPONENT_SKILL,
        max_invalid_moves: str = DEFAULT_MAX_INVALID_MOVES,
        invalid_move: str = "retry",
    ) -> str:
        if heuristic_plays not in _HEURISTIC_CHOICES:
            raise ValueError(
                f"env option heuristic_plays must be one of {list(_HEURISTIC_CHOICES)}, "
                f"got {heuristic_plays!r}"
            )
        if invalid_move not in _INVALID_CHOICES:
            raise ValueError(
                f"env option invalid_move must be one of {list(_INVALID_CHOICES)}, "
                f"got {invalid_move!r}"
            )
        random_moves = random.Random(seed + 1) if invalid_move == "random" else None
        self.random_for_invalid = random_moves
        skill, self.max_invalid_moves = parse_options(opponent_skill, max_invalid_moves)
        self.board = Board(BOARD_SIZE, WIN_LENGTH)
        self.invalid_moves = {BLACK: 0, WHITE: 0}
        self.to_move = BLACK
        if heuristic_plays == "alternate":
            heuristic_plays = WHITE if seed % 2 == 0 else BLACK
        self.heuristic_role = heuristic_plays
        self.heuristic = None
        note = ""
        if heuristic_plays:
            stone = _STONE[heuristic_plays]
            self.heuristic = HeuristicOpponent(stone, random.Random(seed), skill=skill)
            if heuristic_plays == BLACK:  # it opens; the agent plays white
                cell = self.heuristic.choose(self.board)
                self.board.place(cell, stone)
                note = f"Your opponent (black, X) opened at {self.board.name(cell)}.\n"
                self.to_move = WHITE
        return f"{note}{self._view(self.to_move)}"

    def get_initial_user_message(self) -> str:
        return (
            f"Gomoku on a {BOARD_SIZE}x{BOARD_SIZE} board: black is X and opens, white is O. "
            f"{WIN_LENGTH} in a row across, down or diagonally wins. Columns are letters, "
            "rows are numbers; '.' is an empty cell."
        )

    def step(self, action: str) -> StepResult:
        role = self.to_move
        stone = _STONE[role]
        penalty: dict[str, float] = {}
        try:
            cell = self.board.parse_move(action)
            won = self.board.place(cell, stone)
        except ValueError as exc:
            if self.random_for_invalid is None:
                return self._invalid(role, str(exc))
            self.invalid_moves[role] += 1
            penalty = {role: INVALID_MOVE_PENALTY}
            cell = self.random_for_invalid.choice(self.board.empty_cells())
            won = self.board.place(cell, stone)
        played = f"{role.capitalize()} ({stone.value}) played {self.board.name(cell)}."
        if penalty:
            played = f"{role.capitalize()}'s move was invalid; a random one was played. {played}"
        if won:
            return self._end(role, f"{played} Five in a row: {role} wins.", penalty)
        if self.board.full:
            return self._end("", f"{played} The board is full: a draw.", penalty)
        other = _OTHER[role]
        if self.heuristic is None:
            return self._ongoing(other, f"{played}\n{self._view(other)}", penalty)
        reply = self.heuristic.choose(self.board)
        lost = self.board.place(reply, _STONE[other])
        played += f" {other.capitalize()} ({_STONE[other].value}) played {self.board.name(reply)}."
        if lost:
            return self._end(other, f"{played} Five in a row: {other} wins.", penalty)
        if self.board.full:
            return self._end("", f"{played} The board is full: a draw.", penalty)
        return self._ongoing(role, f"{played}\n{self._view(role)}", penalty)

    def _view(self, role: str) -> str:
        return f"{self.board.render()}\nYour move ({role}, {_STONE[role].value})."

    def _invalid(self, role: str, problem: str) -> StepResult:
        self.invalid_moves[role] += 1
        if self.invalid_moves[role] >= self.max_invalid_moves:
            return self._end(
                _OTHER[role],
                f"Invalid move by {role} ({problem}); that was {self.invalid_moves[role]} "
                f"invalid moves: {_OTHER[role]} wins.",
                penalty={role: INVALID_MOVE_PENALTY},
            )
        left = self.max_invalid_moves - self.invalid_moves[role]
        observation = (
            f"Invalid move: {problem}. {left} more invalid move(s) lose the game.\n"
            f"{self._view(role)}"
        )
        return self._ongoing(role, observation, {role: INVALID_MOVE_PENALTY})

    def _ongoing(self, next_role: str, observation: str, rewards: dict[str, float]) -> StepResult:
        acting = self.to_move
        self.to_move = next_role
        return StepResult(
            observation=observation,
            reward=rewards.get(acting, 0.0),
            done=False,
            info=self._info("ongoing", ""),
            next_role=next_role,
            role_rewards=rewards,
        )

    def _end(
        self, winner: str, message: str, penalty: dict[str, float] | None = None
    ) -> StepResult:
        """The game is over: ``winner`` is a role, or '' for a draw."""
        acting = self.to_move
        rewards = {
            role: (DRAW_REWARD if not winner else WIN_REWARD if role == winner else LOSS_REWARD)
            for role in (BLACK, WHITE)
            if role != self.heuristic_role
        }
        for role, extra in (penalty or {}).items():
            rewards[role] = rewards.get(role, 0.0) + extra
        outcome = f"{winner}_win" if winner else "draw"
        return StepResult(
            observation=f"{message}\n{self.board.render()}",
            reward=rewards.get(acting, 0.0),
            done=True,
            info=self._info(outcome, winner),
            role_rewards=rewards,
        )

    def _info(self, outcome: str, winner: str) -> dict[str, str]:
        info = {
            "outcome": outcome,
            "winner": winner,
            "stones": str(self.board.moves),
            "invalid_moves_black": str(self.invalid_moves[BLACK]),
            "invalid_moves_white": str(self.invalid_moves[WHITE]),
        }
        if self.heuristic_role:  # the agents' role metrics: role/<role>/win_rate_vs_heuristic
            info["opponent"] = "heuristic"
            info["heuristic_role"] = self.heuristic_role
        return info
