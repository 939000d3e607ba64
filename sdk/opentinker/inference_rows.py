"""Rows and summary of an inference run: one row per episode, the summary computed from rows.

The same code serves ``opentinker infer --local`` (in-process), the inference job on the pool
(the trainer reports a row per episode) and validation during RL (``val/*`` metrics). Needs
no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.errors import ConfigError

ENV_ERROR = "ENV_ERROR"
MAX_COMPLETION_CHARS = 2000  # a row's completion text on the wire (ResultRow stays < 16 KiB)
MAX_DETAIL_CHARS = 500  # a row's finish_detail on the wire
MAX_INFO_CHARS = 200  # each value of a row's info on the wire


@dataclass(frozen=True)
class InferenceSummary:
    """What a run of inference scored.

    mean_reward: mean total episode reward. accuracy: fraction of episodes with reward > 0.
    mean_turns: mean model turns per episode. env_errors: episodes that ended ENV_ERROR.
    output: the jsonl file the rows went to. seconds: wall time of the run.
    """

    episodes: int
    mean_reward: float
    accuracy: float
    mean_turns: float
    env_errors: int
    output: Path
    seconds: float

    def metrics(self) -> dict[str, float]:
        """The figures as a metrics map (a job's final_metrics; ``val/*`` with a prefix)."""
        return {
            "episodes": float(self.episodes),
            "mean_reward": self.mean_reward,
            "accuracy": self.accuracy,
            "mean_turns": self.mean_turns,
            "env_errors": float(self.env_errors),
        }

    def describe(self, env_name: str) -> str:
        """One line for people, as ``opentinker infer`` prints it."""
        return (
            f"{self.episodes} episodes on '{env_name}': mean reward {self.mean_reward:.3f}, "
            f"accuracy {self.accuracy:.1%}, {self.mean_turns:.1f} turns/episode, "
            f"{self.env_errors} env errors → {self.output}"
        )


def summarize(
    rows: Sequence[Mapping[str, Any]], output: Path = Path(), *, seconds: float = 0.0
) -> InferenceSummary:
    """The summary of rows (as ``episode_row`` makes them)."""
    count = len(rows)
    return InferenceSummary(
        episodes=count,
        mean_reward=sum(r["reward"] for r in rows) / count if count else 0.0,
        accuracy=sum(r["reward"] > 0 for r in rows) / count if count else 0.0,
        mean_turns=sum(r["turns"] for r in rows) / count if count else 0.0,
        env_errors=sum(r["finish_reason"] == ENV_ERROR for r in rows),
        output=output,
        seconds=seconds,
    )


def episode_row(
    *,
    episode_id: str,
    index: int,
    env_seed: int,
    reward: float,
    turns: int,
    finish_reason: str,
    finish_detail: str,
    info: Mapping[str, str],
    env_retries: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The fields every row has (see common.proto ResultRow)."""
    return {
        "episode_id": episode_id,
        "index": index,
        "env_seed": env_seed,
        "reward": reward,
        "turns": turns,
        "finish_reason": finish_reason,
        "finish_detail": finish_detail,
        "info": dict(info),
        "env_retries": env_retries,
        "completion_tokens": completion_tokens,
    }


def wire_row(row: Mapping[str, Any], completion: str) -> dict[str, Any]:
    """``row`` with its texts cut to the wire limits, plus ``completion`` and ``truncated``."""
    detail = row["finish_detail"]
    info = {k: v[:MAX_INFO_CHARS] for k, v in row["info"].items()}
    truncated = (
        len(completion) > MAX_COMPLETION_CHARS
        or len(detail) > MAX_DETAIL_CHARS
        or info != row["info"]
    )
    return {
        **row,
        "finish_detail": detail[:MAX_DETAIL_CHARS],
        "info": info,
        "completion": completion[:MAX_COMPLETION_CHARS],
        "truncated": truncated,
    }


def parse_env_options(items: Sequence[str], split: str | None) -> dict[str, str]:
    """``--option KEY=VALUE`` items as env options, with ``split`` (see options_with_split);
    ValueError naming the items without ``=``."""
    bad = [item for item in items if "=" not in item]
    if bad:
        raise ValueError(f"--option takes KEY=VALUE, got {bad}")
    return options_with_split(dict(item.split("=", 1) for item in items), split)


def options_with_split(options: Mapping[str, str], split: str | None) -> dict[str, str]:
    """Env options with a dataset ``split`` (None: as they are); ConfigError when the options
    already name another split."""
    merged = dict(options)
    if split is not None:
        if merged.get("split", split) != split:
            raise ConfigError(f"split={split!r} contradicts env option split={merged['split']!r}")
        merged["split"] = split
    return merged
