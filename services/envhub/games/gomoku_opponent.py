"""The heuristic Gomoku opponent: scores every empty cell by the lines it would make for
itself (attack) and the lines it would break for the other side (defence), and plays the best.

With that scoring it takes a win when it has one, else blocks a four, else builds or blocks
open threes, and so on. Ties (and, with ``skill`` < 1, a share of moves played at random) are
broken by its own ``random.Random``, so a seeded opponent always plays the same game.
"""

from __future__ import annotations

import random

from opentinker.services.envhub.games.gomoku_board import DIRECTIONS, Board, Stone

# Score of one line through the cell, by (length, open ends); five or more always wins.
_LINE_SCORES: dict[tuple[int, int], int] = {
    (4, 2): 50_000,
    (4, 1): 5_000,
    (3, 2): 2_000,
    (3, 1): 200,
    (2, 2): 100,
    (2, 1): 10,
    (1, 2): 2,
    (1, 1): 1,
}
_FIVE = 1_000_000
_ATTACK_WEIGHT = 1.1  # prefer making our own line to blocking one of equal size


def cell_score(board: Board, cell: tuple[int, int], stone: Stone) -> int:
    """How much a stone of ``stone`` on the (empty) ``cell`` would be worth to that side."""
    total = 0
    for direction in DIRECTIONS:
        length, open_ends = board.run(cell, stone, direction)
        if length >= board.win_length:
            return _FIVE
        total += _LINE_SCORES.get((length, open_ends), 0)
    return total


class HeuristicOpponent:
    """Plays ``stone``; ``skill`` in [0, 1] is the share of moves chosen by the heuristic."""

    def __init__(self, stone: Stone, rng: random.Random, *, skill: float = 1.0) -> None:
        self.stone = stone
        self._rng = rng
        self.skill = skill

    def choose(self, board: Board) -> tuple[int, int]:
        """The opponent's next move on a board that has an empty cell."""
        empty = board.empty_cells()
        if not empty:
            raise ValueError("the board is full; there is no move to choose")
        if self._rng.random() >= self.skill:
            return self._rng.choice(empty)
        center = (board.size - 1) / 2

        def value(cell: tuple[int, int]) -> float:
            attack = cell_score(board, cell, self.stone)
            defence = cell_score(board, cell, self.stone.other)
            nearness = -(abs(cell[0] - center) + abs(cell[1] - center)) / 100
            return _ATTACK_WEIGHT * attack + defence + nearness

        values = {cell: value(cell) for cell in empty}
        best = max(values.values())
        return self._rng.choice([cell for cell, v in values.items() if v == best])
