"""The verified weight sync: send the policy's trainable weights as a new version, then prove
the rollout serves exactly them (its logprobs of the probe sequence equal the trainer's own
within a tolerance). Used by the managed RL loop and by sessions' save_weights_for_sampler.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from opentinker.services.modeling.placement import probe_tolerance
from opentinker.services.trainer.errors import WeightSyncError
from opentinker.services.trainer.model.policy import Policy, Probe
from opentinker.services.trainer.rollout_link.rollout_client import WeightsAck

if TYPE_CHECKING:
    from opentinker.services.trainer.parallel.ranks import LeaderPolicy


class WeightReceiver(Protocol):
    async def sync_weights(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        policy_version: int,
        is_adapter: bool,
        probe_token_ids: list[int],
        timeout_s: float,
        after_send: Callable[[], Awaitable[None]] | None = None,
    ) -> WeightsAck: ...


@dataclass(frozen=True)
class SyncResult:
    """seconds: applying (rollout side) plus probing (trainer side). probe_diff: the probe's
    max |Δlogprob| between the rollout and the trainer. probe_logprobs: the trainer's own
    answer for the synced version; tolerance: what probe_diff was held to."""

    seconds: float
    probe_diff: float
    probe_logprobs: tuple[float, ...] = ()
    tolerance: float = 0.0


# How many earlier versions' probe answers the trainer keeps, to say how far back a sync could
# not tell versions apart (probe_blind_versions).
PROBE_WINDOW = 8


@dataclass(frozen=True)
class ProbeShift:
    """What one update did to the probe. shift: max |Δlogprob| between the trainer's answers
    for this version and the last synced one. blind_versions: how many of the last synced
    versions, counted back from the newest, all answer within tolerance of this one (up to
    PROBE_WINDOW): a rollout serving any of them would pass this sync, and one stuck at an old
    version fails once the updates since add up past the tolerance."""

    shift: float
    blind_versions: int


class ProbeShiftWatch:
    """How far each update moved the probe, and how many versions back the sync cannot tell
    apart (a tiny learning rate, or bfloat16's wider tolerance: on an H100 one LoRA step of a
    0.5B model moved it 0.025 against a tolerance of 0.05); says so once per job."""

    def __init__(self, window: int = PROBE_WINDOW) -> None:
        self._answers: deque[tuple[float, ...]] = deque(maxlen=window)
        self._warned = False

    def shift(self, result: SyncResult, version: int) -> ProbeShift | None:
        """The update's ProbeShift (None for the first sync)."""
        earlier = list(reversed(self._answers))  # newest first
        self._answers.append(result.probe_logprobs)
        if not earlier:
            return None
        moved = [probe_difference(result.probe_logprobs, answer, version) for answer in earlier]
        blind = next((k for k, d in enumerate(moved) if d > result.tolerance), len(moved))
        return ProbeShift(moved[0], blind)

    def warning(
        self, shift: ProbeShift, tolerance: float, step: int, *, had_gradient: bool
    ) -> str | None:
        """The once-per-job warning when an update that had a gradient (one without, as when
        every reward of a batch was equal, moves nothing to tell) stayed within tolerance."""
        if self._warned or shift.shift > tolerance or not had_gradient:
            return None
        self._warned = True
        return (
            f"step {step}'s update moved the weight-sync probe by {shift.shift:.3g} (max "
            f"|Δlogprob|), within the probe tolerance {tolerance:g}: a rollout still serving "
            f"the last version would have passed this sync. One stuck at an old version fails "
            f"once the updates since add up past the tolerance; the probe_blind_versions "
            f"metric says for every step how many versions back (of the last "
            f"{self._answers.maxlen}) its sync could not tell apart"
        )


def probe_difference(sent: Sequence[float], expected: Sequence[float], version: int) -> float:
    """Max |Δlogprob| between the rollout's probe answer and the trainer's own; raises
    WeightSyncError when their lengths differ."""
    if len(sent) != len(expected):
        raise WeightSyncError(
            f"rollout returned {len(sent)} probe logprobs for policy version {version}, "
            f"expected {len(expected)}"
        )
    return max((abs(a - b) for a, b in zip(sent, expected, strict=True)), default=0.0)


async def verified_sync(
    rollout: WeightReceiver,
    policy: Policy | LeaderPolicy,
    *,
    version: int,
    tolerance: float | None,
    timeout_s: float,
    after_send: Callable[[], Awaitable[None]] | None = None,
) -> SyncResult:
    """Send ``policy``'s trainable weights as ``version`` and check the rollout serves them;
    raises WeightSyncError naming what differs. ``tolerance`` None: the documented one for
    the policy's dtype on both sides (the rollout picks its dtype by the same rule from the
    same lease, placement.py) at the logit scale of the trainer's probe. The trainer's own
    probe runs while the rollout applies.
    after_send: awaited once the weights are written (see ``sync_weights``)."""
    ids = policy.probe_token_ids
    probe: asyncio.Task[tuple[Probe, float]] | None = None

    async def sent() -> None:
        nonlocal probe
        probe = asyncio.create_task(asyncio.to_thread(_timed_probe, policy, ids))
        if after_send is not None:
            await after_send()

    try:
        ack = await rollout.sync_weights(
            policy.trainable_state(),
            policy_version=version,
            is_adapter=policy.is_lora,
            probe_token_ids=ids,
            timeout_s=timeout_s,
            after_send=sent,
        )
    except BaseException:
        if probe is not None:
            probe.cancel()
        raise
    assert probe is not None, "sync_weights awaits after_send before it returns"
    answer, probe_seconds = await probe
    expected = answer.logprobs
    if tolerance is None:
        tolerance = probe_tolerance(policy.dtype, policy.dtype, answer.logit_scale)
    if ack.policy_version != version:
        raise WeightSyncError(
            f"rollout applied policy version {ack.policy_version}, the trainer sent {version}"
        )
    diff = probe_difference(ack.probe_logprobs, expected, version)
    if not diff <= tolerance:  # also catches nan
        raise WeightSyncError(
            f"rollout serves stale/different weights: max |Δlogprob| = {diff:.3g} on the probe "
            f"after syncing policy version {version} (tolerance {tolerance:g}, {policy.dtype} "
            f"logits of std {answer.logit_scale:.3g}); check that the rollout loads the same "
            f"base model and LoRA config and applies every tensor"
        )
    return SyncResult(ack.apply_seconds + probe_seconds, diff, tuple(expected), tolerance)


def _timed_probe(policy: Policy | LeaderPolicy, ids: list[int]) -> tuple[Probe, float]:
    """The trainer's probe answer and the seconds it took."""
    started = time.monotonic()
    answer = policy.probe(ids)
    return answer, time.monotonic() - started
