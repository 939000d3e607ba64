"""Rows of one episode: an agent-program episode whose agent rewrote its conversation arrives
as one row per token segment (rollout agent_endpoint/episodes.py), in segment order, all with
its episode id, group and reward. Each row trains its own model turns; the episode counts once
(in the batch's size, a group's baseline and the reward metrics)."""

from __future__ import annotations

from collections.abc import Sequence

from opentinker.services.trainer.rl.batch import Episode


def episode_key(e: Episode, row: int) -> tuple[str, str] | int:
    """What the rows of one episode share: (episode id, role) for a rewritten agent
    episode's segments, else the row's own index."""
    if e.agent_rewrites and e.episode_id:
        return (e.episode_id, e.role)
    return row


def first_rows(episodes: Sequence[Episode]) -> list[int]:
    """The index of each episode's first row (its first segment), in order."""
    seen: set[tuple[str, str] | int] = set()
    rows = []
    for row, e in enumerate(episodes):
        key = episode_key(e, row)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


def rows_by_episode(members: Sequence[int], episodes: Sequence[Episode]) -> list[int]:
    """For each of ``members`` (row indices), the position among the group's episodes (in
    order of first appearance) of the episode it belongs to."""
    position: dict[tuple[str, str] | int, int] = {}
    return [position.setdefault(episode_key(episodes[m], m), len(position)) for m in members]
