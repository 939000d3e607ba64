"""Datasets for dataset-backed environments: rows of (prompt, ground truth, extra fields).

The on-disk layout a ``DatasetGame`` reads is one parquet (or jsonl) file with the columns
``prompt`` (str), ``ground_truth`` (str), ``split`` (str, e.g. ``train`` / ``validation``;
a file without it is all ``train``) and any extra columns, which reach the game as
``DatasetRow.extra``. ``convert_to_parquet`` turns a jsonl or csv file with your own field
names into that layout.

Parquet needs ``pyarrow`` (the ``server`` extra); it is imported only when a parquet file is
read or written, so ``import opentinker`` never needs it.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentinker.errors import ConfigError

PROMPT = "prompt"
GROUND_TRUTH = "ground_truth"
SPLIT = "split"
TRAIN = "train"
VALIDATION = "validation"
_RESERVED = (PROMPT, GROUND_TRUTH, SPLIT)


@dataclass(frozen=True)
class DatasetRow:
    """One example.

    prompt: the task shown to the model. ground_truth: what a grader compares answers with.
    extra: the row's other fields, as read (str, numbers, lists...). split, index: where it is.
    """

    prompt: str
    ground_truth: str
    split: str = TRAIN
    index: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)


class Dataset:
    """Rows grouped by split, immutable. Build with ``load`` (a file) or ``from_records``."""

    def __init__(self, rows_by_split: Mapping[str, Sequence[DatasetRow]], *, source: str) -> None:
        self._rows = {split: tuple(rows) for split, rows in rows_by_split.items() if rows}
        self.source = source

    @classmethod
    def from_records(
        cls, records: Iterable[Mapping[str, Any]], *, source: str = "<memory>"
    ) -> Dataset:
        """Rows from dicts with ``prompt``, ``ground_truth``, optional ``split`` and extras."""
        by_split: dict[str, list[DatasetRow]] = {}
        for number, record in enumerate(records, start=1):
            problems = [
                f"'{key}' is missing or not a string"
                for key in (PROMPT, GROUND_TRUTH)
                if not isinstance(record.get(key), str)
            ]
            split = record.get(SPLIT) or TRAIN
            if not isinstance(split, str):
                problems.append(f"'{SPLIT}' is {type(split).__name__}, not a string")
            if problems:
                raise ConfigError(
                    f"{source}: row {number}: {'; '.join(problems)}; every row needs "
                    f"'{PROMPT}' and '{GROUND_TRUTH}' (convert_to_parquet renames your fields)"
                )
            rows = by_split.setdefault(split, [])
            extra = {k: v for k, v in record.items() if k not in _RESERVED}
            rows.append(
                DatasetRow(
                    prompt=record[PROMPT],
                    ground_truth=record[GROUND_TRUTH],
                    split=split,
                    index=len(rows),
                    extra=extra,
                )
            )
        if not by_split:
            raise ConfigError(f"{source}: the dataset has no rows")
        return cls(by_split, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Dataset:
        """A parquet or jsonl file, read once per (path, modification time) and cached."""
        resolved = Path(path).expanduser().resolve()
        try:
            stamp = resolved.stat().st_mtime_ns
        except OSError as exc:
            raise ConfigError(f"dataset file {resolved} cannot be read: {exc}") from exc
        key = (str(resolved), stamp)
        with _CACHE_LOCK:
            cached = _CACHE.get(key)
        if cached is None:
            cached = cls.from_records(read_records(resolved), source=str(resolved))
            with _CACHE_LOCK:
                _CACHE[key] = cached
        return cached

    @property
    def splits(self) -> list[str]:
        return sorted(self._rows)

    def rows(self, split: str) -> tuple[DatasetRow, ...]:
        """Every row of a split; a ``ConfigError`` naming the splits there are otherwise."""
        if split not in self._rows:
            raise ConfigError(
                f"dataset {self.source} has no split {split!r}; its splits: {self.splits}"
            )
        return self._rows[split]

    def pick(self, split: str, seed: int) -> DatasetRow:
        """The row a seed chooses in a split: the same seed always gives the same row."""
        rows = self.rows(split)
        return rows[random.Random(seed).randrange(len(rows))]

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._rows.values())


_CACHE: dict[tuple[str, int], Dataset] = {}
_CACHE_LOCK = threading.Lock()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``.parquet``, ``.jsonl`` (one JSON object a line) or ``.csv`` file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        _, pq = _pyarrow()
        return pq.read_table(path).to_pylist()
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as handle:
            return [dict(row) for row in csv.DictReader(handle)]
    raise ConfigError(f"{path}: unknown dataset format {suffix!r}; use .parquet, .jsonl or .csv")


def write_parquet(records: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows (dicts with the same keys) as a parquet file; returns its path."""
    pa, pq = _pyarrow()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        table = pa.Table.from_pylist([dict(r) for r in records])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ConfigError(f"{path}: the rows do not fit one parquet schema: {exc}") from exc
    pq.write_table(table, path)
    return path


def write_jsonl(records: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows as jsonl (one JSON object a line); returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(dict(record), ensure_ascii=False) + "\n")
    return path


def convert_to_parquet(
    source: str | Path,
    destination: str | Path,
    *,
    prompt_field: str = PROMPT,
    answer_field: str = GROUND_TRUTH,
    split_field: str = SPLIT,
    validation_fraction: float = 0.0,
    seed: int = 0,
) -> dict[str, int]:
    """Turn a jsonl or csv file into the parquet a ``DatasetGame`` reads; returns rows per split.

    prompt_field, answer_field: the source's names for the prompt and the ground truth (renamed
        to ``prompt`` and ``ground_truth``; answers that are numbers become strings).
    split_field: a source field holding each row's split, kept when present in every row.
    validation_fraction: without a split field, this share of rows (chosen by a hash of the
        row's prompt and ``seed``, so stable when rows are added) becomes ``validation``.
    Every other field is kept as an extra column.
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise ConfigError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    records = read_records(source)
    has_split = bool(records) and all(record.get(split_field) for record in records)
    converted = []
    for number, record in enumerate(records, start=1):
        missing = [name for name in (prompt_field, answer_field) if record.get(name) in (None, "")]
        if missing:
            raise ConfigError(
                f"{source}: row {number} has no {missing}; its fields: {sorted(record)}; "
                "name the right ones with prompt_field= / answer_field="
            )
        prompt = str(record[prompt_field])
        if has_split:
            split = str(record[split_field])
        else:
            split = VALIDATION if _hash_fraction(prompt, seed) < validation_fraction else TRAIN
        extras = {
            key: value
            for key, value in record.items()
            if key not in (prompt_field, answer_field, split_field) and key not in _RESERVED
        }
        converted.append(
            {PROMPT: prompt, GROUND_TRUTH: str(record[answer_field]), SPLIT: split, **extras}
        )
    Dataset.from_records(converted, source=str(source))  # the same checks a game will make
    write_parquet(converted, destination)
    counts: dict[str, int] = {}
    for record in converted:
        counts[record[SPLIT]] = counts.get(record[SPLIT], 0) + 1
    return counts


def _hash_fraction(text: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not JSON: {exc}") from exc
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{number}: a line must be a JSON object")
            records.append(record)
    return records


def _pyarrow() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), imported on first use: an optional dependency."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(
            "parquet datasets need pyarrow: pip install 'opentinker[server]' (or pyarrow), "
            "or use a .jsonl file"
        ) from exc
    return pa, pq
