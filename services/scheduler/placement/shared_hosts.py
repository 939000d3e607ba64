"""Placement of LoRA sessions onto shared LoRA hosts: one trainer process per (worker, base
model) serving many tenants' sessions (trainer/session/host.py), each session holding a share
of the host's device in the ledger (``LeaseLedger.acquire_share``), not a whole one.

Behind the scheduler's ``shared_lora_sessions`` setting (the sessions one host takes; 0 = off,
every session a trainer and a device of its own, as before). Only a LoRA session job is hosted;
full fine-tuning, RL, SFT, inference and eval jobs keep whole devices. A session that finds no
host with room and no free device for a new host waits in the queue (its reason is told, as for
any job); a host that is full leaves a new session to a whole device of its own when one is free.

The ledger is the one record of the hosts and their room (a host id per worker and base model;
its shares' count against its slots, in one Lua script): two rounds can never put more sessions
on a host than it takes, and a host's room frees when a share is released.
"""

from __future__ import annotations

import hashlib

from opentinker.common.v1 import common_pb2


def hosted_base(job: common_pb2.Job) -> str:
    """The base model of a LoRA session job on one device, "" for any other job."""
    spec = job.spec
    if (
        spec.kind != common_pb2.JOB_KIND_SESSION
        or spec.model.finetune != common_pb2.FINETUNE_MODE_LORA
        or spec.num_devices > 1
    ):
        return ""
    return spec.model.base_model


def shared_host_id(worker_id: str, base_model: str) -> str:
    """The one host of ``base_model`` on ``worker_id`` (the same id in every round)."""
    digest = hashlib.sha256(f"{worker_id}\n{base_model}".encode()).hexdigest()[:16]
    return f"host-{digest}"
