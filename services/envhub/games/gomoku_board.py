"""The rules of Gomoku on a square board: placing stones, five (or more) in a row, moves as
text, and the board drawn for a language model.

Coordinates: a column letter (A.. left to right) and a row number (1.. top to bottom), e.g.
``E5`` is the center of a 9x9 board. In code a cell is ``(row, col)``, both from 0.
"""

from __future__ import annotations

import re
import string
from enum import Enum

DIRECTIONS: tuple[tuple[int, int], ...] = ((0, 1), (1, 0), (1, 1), (1, -1))  # - | \ /
_MOVE = re.compile(r"(?<![A-Za-z])([A-Za-z])\s*-?\s*(\d{1,2})(?!\d)")


class Stone(str, Enum):  # noqa: UP042 - StrEnum would change str(stone), which code relies on
    EMPTY = "."
    BLACK = "X"  # the model
    WHITE = "O"  # the opponent

    @property
    def other(self) -> Stone:
        return Stone.WHITE if self is Stone.BLACK else Stone.BLACK


class Board:
    """A ``size`` x ``size`` board; ``win_length`` in a row (or more) wins."""

    def __init__(self, size: int = 9, win_length: int = 5) -> None:
        if not 5 <= size <= 26 or not 3 <= win_length <= size:
            raise ValueError(
                f"board size must be 5..26 and win_length 3..size, got {size}, {win_length}"
            )
        self.size = size
        self.win_length = win_length
        self.cells = [[Stone.EMPTY] * size for _ in range(size)]
        self.moves = 0

    def __getitem__(self, cell: tuple[int, int]) -> Stone:
        return self.cells[cell[0]][cell[1]]

    def on_board(self, row: int, col: int) -> bool:
        return 0 <= row < self.size and 0 <= col < self.size

    def empty_cells(self) -> list[tuple[int, int]]:
        return [
            (r, c)
            for r in range(self.size)
            for c in range(self.size)
            if self.cells[r][c] is Stone.EMPTY
        ]

    @property
    def full(self) -> bool:
        return self.moves == self.size * self.size

    def place(self, cell: tuple[int, int], stone: Stone) -> bool:
        """Put a stone on an empty cell; returns whether it made ``win_length`` in a row."""
        row, col = cell
        if not self.on_board(row, col):
            raise ValueError(f"{self.name(cell)} is off the {self.size}x{self.size} board")
        if self.cells[row][col] is not Stone.EMPTY:
            raise ValueError(f"{self.name(cell)} is already taken")
        self.cells[row][col] = stone
        self.moves += 1
        return self.longest_line(cell, stone) >= self.win_length

    def longest_line(self, cell: tuple[int, int], stone: Stone) -> int:
        """The longest line of ``stone`` through ``cell`` (counting the cell as ``stone``)."""
        return max(self.run(cell, stone, direction)[0] for direction in DIRECTIONS)

    def run(
        self, cell: tuple[int, int], stone: Stone, direction: tuple[int, int]
    ) -> tuple[int, int]:
        """(stones in a row through ``cell`` along ``direction``, open ends 0..2)."""
        length, open_ends = 1, 0
        for sign in (1, -1):
            dr, dc = direction[0] * sign, direction[1] * sign
            row, col = cell[0] + dr, cell[1] + dc
            while self.on_board(row, col) and self.cells[row][col] is stone:
                length += 1
                row, col = row + dr, col + dc
            if self.on_board(row, col) and self.cells[row][col] is Stone.EMPTY:
                open_ends += 1
        return length, open_ends

    def name(self, cell: tuple[int, int]) -> str:
        """``(0, 4)`` -> ``E1``."""
        return f"{string.ascii_uppercase[cell[1]]}{cell[0] + 1}"

    def parse_move(self, text: str) -> tuple[int, int]:
        """The last coordinate written in ``text`` (``E5``, ``e 5``, ``E-5``) as (row, col).

        A ValueError says what is wrong: no coordinate, or one off the board.
        """
        found = _MOVE.findall(text)
        center = self.name((self.size // 2, self.size // 2))
        if not found:
            raise ValueError(
                f"no move found; write a column letter and a row number, like {center}"
            )
        letter, number = found[-1]
        col, row = string.ascii_uppercase.find(letter.upper()), int(number) - 1
        if not self.on_board(row, col):
            last_column = string.ascii_uppercase[self.size - 1]
            raise ValueError(
                f"{letter.upper()}{number} is off the board "
                f"(columns A-{last_column}, rows 1-{self.size})"
            )
        return row, col

    def render(self) -> str:
        """The board as text: a header of column letters, then one numbered line per row."""
        header = "   " + " ".join(string.ascii_uppercase[: self.size])
        lines = [
            f"{r + 1:>2} " + " ".join(s.value for s in self.cells[r]) for r in range(self.size)
        ]
        return "\n".join([header, *lines])
