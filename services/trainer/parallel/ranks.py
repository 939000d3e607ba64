"""Rank 0 drives, the other ranks follow: how one job's N trainer processes stay in step.

Rank 0 runs the job as a single trainer would (scheduler reports, the rollout stream,
checkpoints) on a ``LeaderPolicy``: every call that needs the other ranks (an update, the full
weights for a sync or a checkpoint, the probe's forward pass, a resume) first broadcasts an
``Order`` naming it (``torch.distributed.broadcast_object_list``), then joins the collective
itself. The other ranks run ``follow``: receive an order, join the same collective, repeat,
until ``stop``. No collective or RPC of our own: orders and data travel through
torch.distributed; an update's order carries the whole batch and each rank computes its rows
(distributed.py).

A follower waits for the next order for as long as the process group's timeout
(``TrainerSettings.rank_timeout_s``): a rank 0 that died ends the followers with an error
rather than a hang (on one worker the worker ends them at once, job_run.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import structlog
import torch
import torch.distributed as dist
from peft.utils import load_peft_weights
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from opentinker.errors import ConfigError
from opentinker.services.trainer.model.policy import Policy, Probe
from opentinker.services.trainer.parallel.distributed import (
    Rank,
    data_parallel_update,
    full_optimizer_state,
    full_state,
    load_full_optimizer_state,
    load_full_state,
    trainable_names,
)
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.batch_work import UpdateConfig
from opentinker.services.trainer.rl.training import TrainStats
from opentinker.spec import JobSpec, data_parallel_problems

log = structlog.get_logger()

OrderKind = Literal[
    "update", "weights", "probe", "optimizer_state", "load_weights", "load_optimizer", "stop"
]


@dataclass(frozen=True)
class Order:
    """What rank 0 tells the followers to join next. ``episodes``, ``config``, ``groups``
    (each optimizer param group's lr and weight_decay): an update, then the gather of its new
    trainable weights (for the weight sync that follows); ``token_ids``: a probe."""

    kind: OrderKind
    episodes: list[Episode] = field(default_factory=list)
    config: UpdateConfig | None = None
    groups: list[tuple[float, float]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def check_data_parallel(spec: JobSpec, world_size: int) -> None:
    """ConfigError naming every setting that keeps ``spec`` from running on ``world_size``
    ranks."""
    rl = spec.rl
    if spec.kind != "rl" or rl is None:
        problems = [f"a {spec.kind} job trains on one device; set num_devices 1"]
    else:  # JobSpec refuses these at submission; a spec stored before that still lands here
        problems = data_parallel_problems(rl)
    if problems:
        raise ConfigError(
            f"the job leases {world_size} devices (one trainer rank each), but "
            + "; ".join(problems),
            reason="NOT_DATA_PARALLEL",
        )


def _broadcast(order: Order | None) -> Order:
    box: list[Order | None] = [order]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


class _LeaderOptimizer:
    """What the loop and checkpoints use of an optimizer: the local param groups (their lr
    and weight decay go out with each update) and a gathered ``state_dict``."""

    def __init__(self, leader: LeaderPolicy) -> None:
        self._leader = leader

    @property
    def param_groups(self) -> list[dict[str, object]]:
        return self._leader.policy.optimizer.param_groups

    def state_dict(self) -> dict[str, object]:
        _broadcast(Order("optimizer_state"))
        return full_optimizer_state(self._leader.policy)

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._leader.order_load(optimizer=state)


class LeaderPolicy:
    """Rank 0's face of a policy sharded over the job's ranks: what the RL loop, the weight
    sync and checkpoints call on a ``Policy``, each call ordering the followers along."""

    def __init__(self, policy: Policy, rank: Rank) -> None:
        if not rank.is_leader:
            raise ValueError(f"rank {rank.rank} follows (follow()); only rank 0 leads")
        self.policy = policy
        self.rank = rank
        self.optimizer = _LeaderOptimizer(self)
        # Gathered right after each update, in the update's worker thread: the sync that
        # follows every update takes them without a collective on the event loop's thread.
        self._gathered: dict[str, torch.Tensor] | None = None

    # What a Policy answers locally.
    @property
    def model(self) -> PreTrainedModel:
        return self.policy.model

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.policy.tokenizer

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.dtype

    @property
    def is_lora(self) -> bool:
        return self.policy.is_lora

    @property
    def probe_token_ids(self) -> list[int]:
        return self.policy.probe_token_ids

    def num_trainable_parameters(self) -> int:
        return self.policy.num_trainable_parameters()  # a DTensor counts its global size

    # Collectives: the followers are ordered along first.
    def update(self, episodes: list[Episode], config: UpdateConfig) -> TrainStats:
        groups = [(g["lr"], g["weight_decay"]) for g in self.policy.optimizer.param_groups]
        _broadcast(Order("update", episodes=episodes, config=config, groups=groups))
        stats = data_parallel_update(self.policy, episodes, config, self.rank)
        self._gathered = full_state(self.policy, trainable_only=True)  # part of the order
        return stats

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable weights gathered whole (CPU tensors): those the last update gathered,
        else gathered now."""
        gathered, self._gathered = self._gathered, None
        if gathered is not None:
            return gathered
        _broadcast(Order("weights"))
        return full_state(self.policy, trainable_only=True)

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        return self.probe(token_ids).logprobs

    def probe(self, token_ids: list[int]) -> Probe:
        _broadcast(Order("probe", token_ids=list(token_ids)))
        return self.policy.probe(token_ids)

    def save_checkpoint(self, out_dir: Path, *, trainer_state: dict | None = None) -> Path:
        """``Policy.save_checkpoint``'s Hugging Face files, from the gathered full weights."""
        _broadcast(Order("weights"))
        state = full_state(self.policy, trainable_only=self.is_lora)
        # Tied weights (Qwen2's head is its embedding) under one name, as save_pretrained of
        # the unsharded model writes them: the gathered copies no longer share storage.
        named = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        state = {name: tensor for name, tensor in state.items() if name in named}
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir, state_dict=state)
        _unshard_architecture(out_dir / "config.json")
        self.tokenizer.save_pretrained(out_dir)
        if trainer_state is not None:
            (out_dir / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        return out_dir.resolve()

    def load_weights(self, directory: Path) -> None:
        """``Policy.load_weights`` for the sharded model: rank 0 reads the files, every rank
        takes its shards. ValueError when the saved tensors do not fit."""
        state = _read_saved_weights(Path(directory), self.is_lora, self.dtype)
        names = trainable_names(self.policy) if self.is_lora else list(self.model.state_dict())
        missing = [n for n in names if n not in state]
        unexpected = [n for n in state if n not in set(names)]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {directory} does not fit the model: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        self.order_load(weights=state)

    def order_load(
        self,
        *,
        weights: Mapping[str, torch.Tensor] | None = None,
        optimizer: dict[str, object] | None = None,
    ) -> None:
        """Broadcast rank 0's weights or optimizer state into every rank's shards."""
        self._gathered = None  # no longer the weights
        _broadcast(Order("load_weights" if weights is not None else "load_optimizer"))
        if weights is not None:
            load_full_state(self.policy, dict(weights))
        else:
            load_full_optimizer_state(self.policy, optimizer or {})

    def stop(self) -> None:
        """Release the followers (they return from ``follow``)."""
        _broadcast(Order("stop"))


def follow(policy: Policy, rank: Rank) -> None:
    """A follower's whole job: join each collective rank 0 orders, until it orders stop."""
    rank_log = log.bind(rank=rank.rank, world_size=rank.world_size)
    rank_log.info("rank_following")
    while True:
        order = _broadcast(None)
        if order.kind == "stop":
            rank_log.info("rank_stopped")
            return
        if order.kind == "update":
            assert order.config is not None
            for group, (lr, weight_decay) in zip(
                policy.optimizer.param_groups, order.groups, strict=True
            ):
                group["lr"], group["weight_decay"] = lr, weight_decay
            data_parallel_update(policy, order.episodes, order.config, rank)
            full_state(policy, trainable_only=True)  # the weights the sync after it sends
        elif order.kind == "weights":
            full_state(policy, trainable_only=True)  # the leader keeps what it asked for
        elif order.kind == "probe":
            policy.probe(order.token_ids)
        elif order.kind == "optimizer_state":
            full_optimizer_state(policy)
        elif order.kind == "load_weights":
            load_full_state(policy, {})
        elif order.kind == "load_optimizer":
            load_full_optimizer_state(policy, {})


def _read_saved_weights(
    directory: Path, is_lora: bool, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The tensors ``save_checkpoint`` wrote, under the live model's parameter names."""
    if not is_lora:  # as Policy.load_weights reads them (tied weights under both names)
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).state_dict()
    saved = load_peft_weights(str(directory), device="cpu")
    # peft saves "...q_proj.lora_A.weight"; the live parameter is "...lora_A.default.weight".
    return {
        name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): t
        for name, t in saved.items()
    }


def _unshard_architecture(config_path: Path) -> None:
    """save_pretrained names the class it saves; FSDP2 made that "FSDPQwen2ForCausalLM"."""
    if not config_path.exists():
        return
    config = json.loads(config_path.read_text())
    config["architectures"] = [a.removeprefix("FSDP") for a in config.get("architectures", [])]
    config_path.write_text(json.dumps(config, indent=2))
