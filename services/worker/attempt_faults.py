"""How a failed attempt is told: which process failed, killed or hung, and on whose fault.

A trainer that failed while its rollout was killed, or runs on without answering a health
check (liveness.py: hung, then killed), failed on its rollout; a rollout that exited
exit_codes.PEER_LOST lost its trainer, which is killed as hung if it does not exit within
``peer_lost_grace_s``. Either way the attempt ends as one whose process was killed (exit code
< 0), which the scheduler re-queues, and the reason names the process, the signal or exit code,
what it was doing and its log.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
from pathlib import Path

import structlog

from opentinker.services.common.exit_codes import PEER_LOST, RETRY_LATER
from opentinker.services.worker.liveness import check
from opentinker.services.worker.ranks import RankGroup
from opentinker.services.worker.reusable import JobProcess
from opentinker.services.worker.supervisor import ManagedProcess, last_meaningful_line
from opentinker.services.worker.trainer_hosts import HostedTrainer

log = structlog.get_logger(__name__)

# How long a process that refused a health check gets to be reaped (it was dying) before it is
# taken for hung.
REAP_S = 1.0

# A job's process: started for it, or a spare handed it (reusable.py when it may be kept)
Proc = ManagedProcess | JobProcess | HostedTrainer


@dataclass(frozen=True)
class Exit:
    """How an attempt ended, as the worker reports it (JobExited)."""

    exit_code: int
    reason: str  # empty when the trainer exited 0 by itself


async def rollout_lost(
    rollout: Proc, trainer: Proc | RankGroup, *, address_file: Path, timeout_s: float
) -> Exit | None:
    """The trainer failed: on its rollout's fault if the rollout was killed, or runs on
    but does not answer a health check (hung: then it is killed). Either way the attempt is
    lost, not the job failed; None when the rollout answers or exited by itself."""
    when = "while the trainer ran"
    address = address_file.read_text().strip() if address_file.exists() else ""
    health = "serving"
    if rollout.running and address:
        health = await check(address, timeout_s=timeout_s)
    if health != "serving":
        try:  # a process dying refuses connections before it is reaped: let it end
            await asyncio.wait_for(asyncio.shield(rollout.wait()), REAP_S)
        except TimeoutError:
            if health == "unreachable":  # alive, not serving: not a hang
                return None
            code = await rollout.terminate(0)  # hung: it would not handle SIGTERM
            log.warning("rollout_hung_killed", pid=rollout.pid, timeout_s=timeout_s)
            failed = last_meaningful_line(trainer.log_path)
            return Exit(
                min(code, -1),
                f"rollout process stopped answering (no health check answer within "
                f"{timeout_s:g} s) {when} and was killed (see {rollout.log_path}); the "
                f"trainer failed on it: {failed}",
            )
    ended = rollout.returncode
    if ended is not None and ended < 0:  # killed: the trainer failed on a lost rollout
        return Exit(ended, died("rollout", ended, rollout, when))
    return None


async def trainer_lost(
    rollout: Proc, trainer: Proc | RankGroup, when: str, *, grace_s: float
) -> Exit:
    """The rollout exited PEER_LOST: its trainer left the stream unclosed (hung, or gone).
    A trainer killed meanwhile says so; one still there after ``peer_lost_grace_s`` is
    killed as hung; the attempt is lost either way (a trainer that ends by itself closes
    its stream first)."""
    try:
        code = await asyncio.wait_for(asyncio.shield(trainer.wait()), grace_s)
    except TimeoutError:
        code = await trainer.terminate(0)  # hung: it would not handle SIGTERM
        log.warning("trainer_hung_killed", pid=trainer.pid, grace_s=grace_s)
        return Exit(
            min(code, -1),
            f"trainer process stopped answering its rollout {when} (the rollout lost its "
            f"stream: see {rollout.log_path}) and was killed after {grace_s:g} s more "
            f"(see {trainer.log_path})",
        )
    await trainer.terminate(0)  # the other ranks, if any
    if code == 0:
        return Exit(0, "")
    if code < 0:
        return Exit(code, died("trainer", code, trainer, when))
    return Exit(
        -1,
        f"the rollout lost its trainer's stream {when} (it exited with code {PEER_LOST}: "
        f"see {rollout.log_path}), and the trainer then exited with code {code}",
    )


def died(name: str, code: int | None, process: Proc | RankGroup, when: str) -> str:
    """``name`` process was killed by SIGKILL / died with exit code N, doing ``when``."""
    where = f"(see {process.log_path})"
    if code is not None and code < 0:
        return f"{name} process was killed by {_signal_name(-code)} {when} {where}"
    if code == RETRY_LATER and name != "trainer":  # a follower rank on a broken group
        return (
            f"{name} process exited {RETRY_LATER} {when}: its process group broke (another "
            f"rank or its node was lost); the attempt is re-queued {where}"
        )
    last = last_meaningful_line(process.log_path)
    detail = f": {last}" if last else ""
    return f"{name} process died with exit code {code} {when} {where}{detail}"


def _signal_name(number: int) -> str:
    """``signal 9 (SIGKILL)``."""
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"
