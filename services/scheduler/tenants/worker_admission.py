"""Who may register as a worker: a worker token admits exactly one worker identity.

Found from outside (issue 37): the bootstrap worker token, made valid for any worker id, let a
rogue process holding it register under an id of its own; the scheduler dispatched it another
job's launch (the spec and the attempt's job token) and the job lost 2 of its 3 attempts.

Two rules close that, checked before a registration touches the ledger (so a refused worker is
never a session, never offered devices and never sent a launch):

- **One identity per token.** A token made for a worker id admits that id only. A token made
  with none (the bootstrap ``worker.token``) is bound to the first worker id that registers
  with it, atomically in Redis (identity.py, ``bind_worker_token``); every other id is refused
  ``PERMISSION_DENIED`` naming the fix: a token of its own (``opentinker admin
  create-worker-token --worker-id X``). Trust on first use, because the scheduler writes the
  bootstrap token before any worker exists and a single node must need no manual step; the
  worker's default id is stable across restarts (worker/worker_id.py: kept in its run root),
  so the machine that bound the token is still admitted after a restart.
- **One live stream per identity.** A second registration under a worker id whose stream is
  alive and heartbeating is refused ``ALREADY_EXISTS``, not a takeover: otherwise a holder of
  the token (or a second agent started by mistake with the same id) would silently take the
  worker's launches. A reconnect must keep working, so "alive" is measured, not assumed: the
  new registration waits up to ``2 x heartbeat_interval_s`` for the old stream to end (a
  killed or restarted agent's stream ends within milliseconds) or to show life (a heartbeat
  after the new registration arrived). Ended or silent for that long: the new stream replaces
  it, as a worker whose old stream dropped unnoticed expects. The refused agent retries with
  backoff (worker/agent.py), so a reconnect racing its own old stream gets in at the next try.
"""

from __future__ import annotations

import asyncio
import time

from opentinker.errors import AlreadyExistsError, PermissionDeniedError
from opentinker.services.common.auth import Principal
from opentinker.services.scheduler.placement.worker_session import WorkerSession
from opentinker.services.scheduler.tenants.identity import IdentityStore

POLL_S = 0.02  # how often a waiting registration looks at the old stream again


async def admit_identity(identity: IdentityStore, principal: Principal, worker_id: str) -> None:
    """PermissionDeniedError unless ``principal`` (a worker token) admits ``worker_id``; a token
    not bound yet is bound to ``worker_id`` here (first use)."""
    bound = principal.worker_id
    if not bound:
        bound = await identity.bind_worker_token(principal.key_prefix, worker_id)
    if bound != worker_id:
        raise PermissionDeniedError(
            f"this worker token (key {principal.key_prefix}) is bound to worker {bound!r}, so "
            f"it cannot register worker {worker_id!r}: a worker token admits one worker. Give "
            f"this agent a token of its own (`opentinker admin create-worker-token "
            f"--worker-id {worker_id}`, as OPENTINKER_WORKER_TOKEN or "
            f"OPENTINKER_WORKER_TOKEN_FILE), or run it as {bound!r} (OPENTINKER_WORKER_ID)",
            reason="WRONG_WORKER",
        )


async def refuse_if_alive(old: WorkerSession | None, *, heartbeat_interval_s: float) -> None:
    """AlreadyExistsError when ``old`` (the session now registered under the id) shows life
    within ``2 x heartbeat_interval_s``; returns once it ended or stayed silent that long."""
    if old is None or old.lost:
        return
    arrived = time.monotonic()
    deadline = arrived + 2 * heartbeat_interval_s
    while time.monotonic() < deadline:
        if old.lost:
            return
        if old.last_seen > arrived:
            raise AlreadyExistsError(
                f"worker {old.worker_id!r} is connected already, on a stream that is "
                "heartbeating: a second agent with the same worker id is refused (it would take "
                "the first one's launches). Give each agent its own OPENTINKER_WORKER_ID and "
                "worker token; a reconnect of the same agent is admitted once its old stream "
                "ends or goes silent",
                reason="WORKER_ID_IN_USE",
            )
        await asyncio.sleep(POLL_S)
