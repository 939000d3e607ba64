"""Data-parallel training over the N devices of a lease with torch.distributed FSDP2
(``fully_shard``): no collective of our own.

Each rank holds a shard of every parameter and of AdamW's state. One decoder layer is one FSDP
unit (gathered for its forward/backward, then freed); the rest (embeddings, final norm and the
output head, tied on Qwen2) is the root unit. The policy's body and head are called apart
(chunked logprobs, logprobs.py), so a sharded policy computes its hidden states through the
root module's own forward (``Policy.hidden_through_root``): that is what gathers the root's
parameters and keeps them until the backward.

A minibatch is split into contiguous row ranges, one per rank; each rank's loss carries the
weights of the whole minibatch (training.backward_minibatch), so the sum of the ranks'
gradients is the minibatch's gradient: FSDP's reduce-scatter sums (divide factor 1) instead of
averaging. Every rank must run the same number of forward passes (one micro-batch each:
``micro_batch_tokens`` 0, and no cut for padding), since each is a collective.

Ranks are started by the worker (worker/ranks.py; torchrun or torch.multiprocessing work as
well); ``init_rank`` reads the usual RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. Backend: nccl on
CUDA, gloo on CPU. How rank 0 drives the others through a job: ranks.py.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from opentinker.services.trainer.model.logprobs import causal_lm_parts
from opentinker.services.trainer.model.master_weights import LOW_PRECISION
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.batch_work import UpdateConfig, prepare
from opentinker.services.trainer.rl.training import (
    TrainStats,
    _no_signal_stats,
    _stats,
    _Tally,
    backward_minibatch,
    zero_gradient_step,
)

# Token-weighted figures of an update summed over ranks (each rank tallies its own rows).
_TOKEN_FIGURES = ("entropy", "logprob_gap", "clip_fraction", "ratio_mean", "padding")


@dataclass(frozen=True)
class Rank:
    """This process's place in the job: rank 0 talks to the scheduler and the rollout."""

    rank: int
    world_size: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def init_rank(device: str, *, timeout_s: float = 1800.0) -> Rank:
    """Join the job's process group (env:// rendezvous set by torchrun or the caller).
    ``timeout_s``: how long joining, and any one collective later, may wait for the other
    ranks before it raises (a dead peer ends the job instead of hanging it)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return Rank(rank, dist.get_world_size())


def leave_group(*, peers_alive: bool) -> None:
    """Leave the job's process group for good, once the caller has dropped its sharded policy.

    ``peers_alive``: the job ended in order, so wait for every rank first (no rank tears its
    connections down while a peer is still in a collective); skipped after a failure, when a
    peer may be dead. The sharded modules hold the group, so collect them before destroying it:
    a group left for the interpreter's exit to free can abort the process (SIGABRT from gloo's
    threads, seen on a follower that had returned cleanly).
    """
    if not dist.is_initialized():
        return
    if peers_alive:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def group_broke(err: BaseException) -> bool:
    """True when ``err`` is the job's process group failing under a rank, not the job's own
    fault: a peer rank died, hung past the timeout, or its node left the network (the node
    was lost). torch raises those as ``DistError`` (NCCL, the rendezvous store), or, for
    gloo's transport, as a plain RuntimeError naming it ("[.../gloo/transport/tcp/pair.cc:537]
    Read error [10.0.0.2]:40848: Connection reset by peer"). Such an attempt is lost and the
    job re-queued (exit_codes.RETRY_LATER), as when a rank of one worker is killed."""
    return isinstance(err, dist.DistError) or "gloo/transport/" in str(err)


def shard_policy(policy: Policy) -> None:
    """Shard ``policy``'s model over the process group with FSDP2 and rebuild its AdamW over
    the sharded parameters (same hyperparameters).

    Trainable parameters in bfloat16 (a full fine-tune on CUDA) are sharded as float32 masters
    and gathered in bfloat16 for compute, gradients reduced in float32: FSDP2's own mixed
    precision, for the reason master_weights.py gives (bf16 steps round small updates away)."""
    mixed = any(p.dtype in LOW_PRECISION for p in policy.trainable_parameters())
    precision = MixedPrecisionPolicy()
    if mixed:
        policy.model.float()
        precision = MixedPrecisionPolicy(param_dtype=policy.dtype, reduce_dtype=torch.float32)
    body, _ = causal_lm_parts(policy.model)
    for layer in body.layers:  # type: ignore[union-attr]  # a decoder's nn.ModuleList
        fully_shard(layer, mp_policy=precision)
    fully_shard(policy.model, mp_policy=precision)
    for unit in policy.model.modules():  # the root and every layer: each has its own setting
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # sum: each rank's loss weighs the whole batch
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    policy.hidden_through_root = True
    group = policy.optimizer.param_groups[0]
    policy.optimizer = torch.optim.AdamW(
        policy.trainable_parameters(), lr=group["lr"], weight_decay=group["weight_decay"]
    )


def rank_rows(rows: Sequence[int], rank: Rank) -> list[int]:
    """The contiguous range of ``rows`` this rank computes: sizes differ by at most one.
    ValueError when there are fewer rows than ranks (a rank without rows would skip a
    collective and hang the others)."""
    if len(rows) < rank.world_size:
        raise ValueError(
            f"{len(rows)} sequences cannot be split over {rank.world_size} ranks; "
            f"use a batch of at least {rank.world_size} sequences"
        )
    base, extra = divmod(len(rows), rank.world_size)
    start = rank.rank * base + min(rank.rank, extra)
    return list(rows[start : start + base + (1 if rank.rank < extra else 0)])


def data_parallel_step(
    policy: Policy, episodes: list[Episode], config: UpdateConfig, rank: Rank
) -> float:
    """One optimizer step on the whole of ``episodes`` (every rank passes the same list), each
    rank computing its rows; returns the global gradient norm before clipping."""
    return data_parallel_update(policy, episodes, config, rank).grad_norm


def data_parallel_update(
    policy: Policy, episodes: list[Episode], config: UpdateConfig, rank: Rank
) -> TrainStats:
    """``data_parallel_step`` with the figures ``rl_update`` reports, summed over the ranks'
    rows (every rank gets the same TrainStats). When no sequence has signal every rank takes
    the step on zero gradients (every rank sees the whole batch, so all decide alike)."""
    _check_data_parallel(config)
    work = prepare(policy, episodes, config, reference=None, critic=None)
    signal_B = (work.advantages_B_T.abs() * work.full.loss_mask_B_T).sum(dim=1) > 0
    limit = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    started = time.perf_counter()
    if not bool(signal_B.any()):
        zero_gradient_step(policy, limit)
        return _no_signal_stats(
            episodes, optimizer_steps=1, optimizer_s=time.perf_counter() - started
        )
    minibatch = list(range(len(episodes)))
    tally = _Tally()
    one_pass = dataclasses.replace(config, max_padding=1.0)  # the same forwards on every rank
    backward_minibatch(policy, work, minibatch, rank_rows(minibatch, rank), one_pass, tally=tally)
    tally.add_seconds("forward_backward", started)
    started = time.perf_counter()
    grad_norm = policy.optimizer_step(limit)
    tally.add_seconds("optimizer", started)
    sums = [tally.token_sums.get(n, 0.0) for n in _TOKEN_FIGURES]
    counts = [float(tally.tokens.get(n, 0)) for n in _TOKEN_FIGURES]
    figures = torch.tensor([*sums, *counts, tally.step_sums.get("loss", 0.0)], dtype=torch.float64)
    dist.all_reduce(figures)  # a SUM: each rank's loss is its rows' share of the batch's
    summed = _Tally(
        steps=1,
        step_sums={"loss": float(figures[-1]), "grad_norm": grad_norm},
        seconds=tally.seconds,  # this rank's
    )
    for i, name in enumerate(_TOKEN_FIGURES):
        summed.token_sums[name] = float(figures[i])
        summed.tokens[name] = int(figures[len(_TOKEN_FIGURES) + i])
    return _stats(summed, work, len(episodes))


def _check_data_parallel(config: UpdateConfig) -> None:
    if config.micro_batch_tokens or config.minibatch_size or config.ppo_epochs != 1:
        raise ValueError(
            "data-parallel steps take the whole batch in one micro-batch per rank: "
            "micro_batch_tokens 0, minibatch_size 0, ppo_epochs 1"
        )


def full_state(policy: Policy, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every rank's shards gathered into whole CPU tensors on rank 0 (other ranks get an empty
    dict): what a checkpoint or a weight sync sends. A collective: every rank calls it.
    ``trainable_only``: the names ``Policy.trainable_state`` has (LoRA: the adapter)."""
    state = get_model_state_dict(
        policy.model,
        options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
        ),
    )
    # torch types a state dict's values as any state (ValueType); a model's are tensors.
    tensors = cast("dict[str, torch.Tensor]", state)
    if not trainable_only:
        return tensors
    names = trainable_names(policy)
    return {n: t for n, t in tensors.items() if n in names}


def trainable_names(policy: Policy) -> list[str]:
    """Trainable parameter names in the optimizer's order (``Policy.trainable_parameters``)."""
    return [n for n, p in policy.model.named_parameters() if p.requires_grad]


def load_full_state(policy: Policy, state: dict[str, torch.Tensor]) -> None:
    """Rank 0's whole tensors (``state``; other ranks pass {}) into every rank's shards; names
    not in ``state`` keep their values. A collective."""
    set_model_state_dict(
        policy.model,
        state,  # type: ignore[arg-type]  # dict is invariant; torch's ValueType has Tensor
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
    )


def full_optimizer_state(policy: Policy) -> dict[str, object]:
    """AdamW's state gathered on rank 0 in ``Optimizer.state_dict()``'s own form (parameters
    numbered in ``trainable_parameters`` order), so a 1-rank and an N-rank job write the same
    optimizer.pt; {} on other ranks. A collective."""
    state = get_optimizer_state_dict(
        policy.model,
        policy.optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )
    if not state:
        return {}
    # torch types every value as any state; AdamW's full state has Optimizer.state_dict()'s
    # form, under parameter names.
    full = cast("dict[str, Any]", state)
    index = {name: i for i, name in enumerate(trainable_names(policy))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]
    return {"state": {index[n]: s for n, s in full["state"].items()}, "param_groups": groups}


def load_full_optimizer_state(policy: Policy, state: dict[str, object]) -> None:
    """``full_optimizer_state``'s form (rank 0; other ranks pass {}) into every rank's AdamW.
    A collective."""
    if state:
        names = trainable_names(policy)
        per_param = state["state"]
        assert isinstance(per_param, dict) and isinstance(state["param_groups"], list)
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
        state = {"state": {names[i]: s for i, s in per_param.items()}, "param_groups": groups}
    set_optimizer_state_dict(
        policy.model,
        policy.optimizer,
        state,  # type: ignore[arg-type]  # the form full_optimizer_state gives, as torch's
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
