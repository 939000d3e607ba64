"""A session job ends when the API key that opened it is revoked.

A session (JOB_KIND_SESSION, the primitives of a notebook or the Tinker gateway) is driven call
by call by the key that opened it. Revoking that key refuses its next call at once (the
session's trainer asks the scheduler's IdentityService on every call), but the session itself
would keep its lease, its device held, until its idle timeout (600 s by default). So:

- ``submit`` stores, with a session job and in the same step, the key prefix of the user's API
  key that opened it (``JobStore.create(opened_by=...)``; job_store.py keeps it until the job's
  last transition removes it). It is the scheduler's own record: no protocol field carries it.
- Every round of the scheduler's loop (at most a heartbeat apart) checks those keys again
  (``IdentityStore.is_revoked``: revoked, or deleted with their user) and cancels each session
  whose key no longer holds, as ``CancelJob`` does: its job tokens are revoked, its worker is
  told to stop it, and its lease is released once its processes have exited (draining.py).
- Nothing is cancelled while Redis's state may be lost (lost_state.py): every key then reads as
  gone, and an operator may still restore it.

Managed jobs (rl, sft, inference, eval) are not ended by a revoked key: they are the tenant's
work, not a conversation with one key; an admin cancels them when that is wanted.
"""

from __future__ import annotations

from opentinker.services.scheduler.jobs.job_store import JobStore
from opentinker.services.scheduler.tenants.identity import IdentityStore


async def sessions_of_revoked_keys(jobs: JobStore, identity: IdentityStore) -> dict[str, str]:
    """Job id -> key prefix, for each session not ended whose opening key was revoked."""
    opened = await jobs.session_openers()
    revoked = {prefix: await identity.is_revoked(prefix) for prefix in set(opened.values())}
    return {job_id: prefix for job_id, prefix in opened.items() if revoked[prefix]}


def revoked_reason(key_prefix: str) -> str:
    """The reason a session ended by its key's revocation is cancelled with."""
    return (
        f"the API key that opened this session (key {key_prefix}) was revoked; "
        "open a new session with a valid key"
    )
