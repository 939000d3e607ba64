"""The next training batch's episodes are reset while the trainer trains on this one.

Strictly on-policy (max_staleness 0) the rollout idles while the trainer updates, then starts
the next batch by resetting every episode (the env's first observation, rendered with the chat
template) before the first token is generated: ~9 ms of the demo's ~0.1 s step. A Reset needs
no weights, and a batch's episode ids and seeds follow from the job's seed and the batch index,
so once batch k is played the session resets batch k+1's episodes; the request for k+1 finds
them ready and only generates and steps. A request of another index or shape, or one on a new
EnvHub link, closes them and resets its own; the end of the stream closes them too. An
evaluation closes them before it plays (they may hold every slot of the env) and resets them
again once it is done. With max_staleness >= 1 the request for k+1 is already queued, and the
reset ahead merely starts a little earlier.

Off with ``OPENTINKER_ROLLOUT_RESET_AHEAD=false`` (an env whose Reset is costly). A batch
larger than its env's capacity is reset ahead only as far as it fits (``BatchAhead``), and
tried whole again now and then, so that capacity registered later is used.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from opentinker.services.rollout.agent.agent_loop import AgentLoop, ResetEpisodes
from opentinker.services.rollout.agent.loop_config import EpisodeRequest
from opentinker.services.rollout.agent.seeds import derive_seed
from opentinker.services.rollout.config import RolloutConfig
from opentinker.services.rollout.envs.envhub_link import EnvHubLink

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class BatchKey:
    """What a training collect asks for."""

    batch_index: int
    num_groups: int
    group_size: int

    def next(self) -> BatchKey:
        return BatchKey(self.batch_index + 1, self.num_groups, self.group_size)


def episode_id(job_id: str, batch_index: int, group: int, sample: int) -> str:
    return f"{job_id}-b{batch_index}-g{group}-s{sample}"


def batch_requests(config: RolloutConfig, link: EnvHubLink, key: BatchKey) -> list[EpisodeRequest]:
    """The episodes of training batch ``key``: ``group_size`` per group, each group from one
    reset seed (one prompt per group), every id and seed a function of the job and the key."""
    requests = []
    for g in range(key.num_groups):
        group_seed = derive_seed(config.seed, "env", key.batch_index, g)
        for i in range(key.group_size):
            eid = episode_id(config.job_id, key.batch_index, g, i)
            requests.append(EpisodeRequest(eid, g, group_seed, link.session(eid), link.session))
    return requests


@dataclass(frozen=True)
class _Ahead:
    key: BatchKey
    link: EnvHubLink
    task: asyncio.Task[ResetEpisodes]


class BatchAhead:
    """At most one batch reset ahead of its request.

    A batch larger than its env's capacity cannot be reset ahead whole: the episodes reset
    ahead hold every slot until they are played, so the others wait at EnvHub
    (``capacity_wait_s``) and come back at capacity. They are reset when played instead, and
    from then on only as many episodes as found a slot are reset ahead (``limit``), so the
    wait happens once, not every step. The env may gain capacity later (another instance
    registers, another job leaves), so a limited batch is tried whole again ``probe_s`` after
    the limit was set: if it fits, the limit goes; if not, the limit becomes what fit then
    and the next try waits twice as long, so an env that stays full costs one wait per
    doubling interval."""

    def __init__(self, loop: AgentLoop, *, probe_s: float = 300.0) -> None:
        self._loop = loop
        self._pending: _Ahead | None = None
        self.limit: int | None = None  # episodes reset ahead at most; None = all
        self.probe_s = probe_s  # how long until a limited batch is tried whole again
        self.wait_s = probe_s  # the wait before the next whole try (doubles while full)
        self._probe_at = 0.0
        self._probing = False  # the pending batch is such a try

    def start(self, key: BatchKey, link: EnvHubLink, requests: Sequence[EpisodeRequest]) -> None:
        """Reset ``requests`` (batch ``key``'s episodes on ``link``) in the background."""
        self._probing = self.limit is not None and time.monotonic() >= self._probe_at
        task = asyncio.create_task(
            self._loop.reset_ahead(requests, limit=None if self._probing else self.limit),
            name=f"reset-ahead-{key.batch_index}",
        )
        self._pending = _Ahead(key, link, task)

    async def take(self, key: BatchKey, link: EnvHubLink) -> ResetEpisodes | None:
        """Batch ``key``'s episodes, reset ahead on ``link``; None when another batch was
        reset ahead (its episodes are closed) or none was."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.key == key and pending.link is link:
            ready = await pending.task
            self._learn(ready)
            return ready
        await self._discard(pending, cancel=False)
        return None

    def _learn(self, ready: ResetEpisodes) -> None:
        """Set the limit from what fit in the env, and when to try the whole batch again."""
        if not ready.found_env_full:
            if self._probing:
                log.info("reset_ahead_whole_again", batch_size=len(ready.episodes),
                         was_limited_to=self.limit)  # fmt: skip
                self.limit = None
            return
        # A whole try that still did not fit waits twice as long; a new limit waits probe_s.
        self.wait_s = 2 * self.wait_s if self._probing else self.probe_s
        self._probe_at = time.monotonic() + self.wait_s
        self.limit = ready.tried - ready.found_env_full  # what fit this time
        log.warning(
            "reset_ahead_limited",
            batch_size=len(ready.episodes),
            reset_ahead=self.limit,
            next_whole_try_s=round(self.wait_s, 3),
            reason="the env was at capacity; the rest are reset when played",
        )

    async def set_aside(self) -> BatchKey | None:
        """Close what was reset ahead, once reset, and say which batch it was (None: none):
        its episodes hold env slots that another request (an evaluation) needs now."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        await self._discard(pending, cancel=False)
        return pending.key

    async def close(self) -> None:
        """Drop what was reset ahead (the stream ends)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await self._discard(pending, cancel=True)

    async def _discard(self, pending: _Ahead, *, cancel: bool) -> None:
        """Close the episodes of ``pending`` once reset (``cancel``: stop resetting first;
        the episode stream's end closes the ones EnvHub had opened)."""
        if cancel:
            pending.task.cancel()
        await asyncio.wait({pending.task})  # our own cancellation still reaches us
        if pending.task.cancelled() or pending.task.exception() is not None:
            return
        await self._loop.close_unplayed(pending.task.result())
