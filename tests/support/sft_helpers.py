"""A locally made chat set for SFT tests: whatever the question, the assistant answers in
one fixed format, ``ANSWER: <the question's last word>``, which the tiny model learns in
seconds (the format) and then, more slowly, the copying."""

from __future__ import annotations

import json
import random
from pathlib import Path

from opentinker.services.modeling.tiny_model import _CORPUS_WORDS

WORDS = _CORPUS_WORDS[:24]


def answer_format_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 5))]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": " ".join(words)},
                    {"role": "assistant", "content": f"ANSWER: {words[-1]}"},
                ]
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
