"""``DatasetGame``: an ``AbstractGame`` whose episodes each play one row of a dataset.

Subclass it, point it at a parquet or jsonl file (see ``opentinker.data`` for the layout and
``convert_to_parquet``), and implement ``get_system_prompt`` and ``step``::

    class Capitals(DatasetGame):
        name = "capitals"
        max_turns = 1
        dataset_path = "capitals.parquet"

        def get_system_prompt(self) -> str:
            return "Answer with a city name only."

        def step(self, action: str) -> StepResult:
            right = action.strip().lower() == self.row.ground_truth.lower()
            return StepResult(observation="", reward=float(right), done=True)

    serve(Capitals)                                          # the class's dataset_path
    serve(lambda: Capitals(dataset="other.parquet"))         # or any other file

Reset options: ``split`` (default ``train``; e.g. ``validation`` for evaluation) and ``index``
(a row number in that split; default: the row the seed picks, the same row for the same
seed). The file is read once per process and shared by every episode.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from opentinker.data import TRAIN, Dataset, DatasetRow
from opentinker.errors import ConfigError
from opentinker.game import AbstractGame


class DatasetGame(AbstractGame):
    """One episode = one dataset row; ``self.row`` is that row once ``reset`` ran.

    dataset_path: the default parquet/jsonl file, used when no ``dataset`` is passed.
    """

    dataset_path: ClassVar[str] = ""

    def __init__(self, dataset: Dataset | str | Path | None = None) -> None:
        source = dataset if dataset is not None else self.dataset_path
        if not source:
            raise ConfigError(
                f"{type(self).__name__} has no dataset: set the class attribute dataset_path "
                "or pass dataset= (a parquet/jsonl path or an opentinker.data.Dataset)"
            )
        self.dataset = source if isinstance(source, Dataset) else Dataset.load(source)
        self._row: DatasetRow | None = None

    @property
    def row(self) -> DatasetRow:
        """The row of this episode; only valid after ``reset``."""
        if self._row is None:
            raise RuntimeError(f"{type(self).__name__}.row read before reset()")
        return self._row

    def reset(self, *, seed: int = 0, split: str = TRAIN, index: str = "") -> str:
        self._row = self.generate_initial_state(seed, split=split, index=index)
        return self.format_prompt(self._row)

    def generate_initial_state(self, seed: int, **options: str) -> DatasetRow:
        """The episode's row: ``index`` in ``split`` when given, else the one ``seed`` picks.

        Unknown splits and bad indices are a ``ConfigError`` (a ValueError: the caller sees
        INVALID_ARGUMENT naming this environment).
        """
        split = options.get("split") or TRAIN
        index = options.get("index", "")
        if not index:
            return self.dataset.pick(split, seed)
        rows = self.dataset.rows(split)
        try:
            position = int(index)
        except ValueError:
            position = -1
        if not 0 <= position < len(rows):
            raise ConfigError(
                f"env option index must be an integer 0..{len(rows) - 1} for split {split!r} "
                f"of {self.dataset.source}, got {index!r}"
            )
        return rows[position]

    def format_prompt(self, row: DatasetRow) -> str:
        """The first observation of an episode; by default the row's prompt as is."""
        return row.prompt
