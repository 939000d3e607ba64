"""A lease of N devices trains with N FSDP2 ranks (distributed.py); on CPU the same code runs
2 ranks over gloo, and their step equals the single-process step on the same batch."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer import checkpoints
from opentinker.services.trainer.model.master_weights import MASTERS_KEY
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.parallel.distributed import (
    Rank,
    data_parallel_step,
    full_state,
    init_rank,
    leave_group,
    rank_rows,
    shard_policy,
)
from opentinker.services.trainer.parallel.ranks import LeaderPolicy, follow
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.batch_work import UpdateConfig
from opentinker.services.trainer.rl.training import rl_update
from opentinker.spec import ModelSpec

LEARNING_RATE = 1e-3
SMALL_LR = 1e-6  # full fine-tuning's order; bf16's rounding step at a weight of 0.02: 1.2e-4
CONFIG = UpdateConfig(clip_epsilon=0.2, max_grad_norm=1.0)


def test_rows_split_in_contiguous_ranges_of_near_equal_size() -> None:
    # 5 rows over 2 ranks: divmod(5, 2) = (2, 1), so rank 0 takes 2 + 1 rows, rank 1 takes 2.
    assert rank_rows(range(5), Rank(0, 2)) == [0, 1, 2]
    assert rank_rows(range(5), Rank(1, 2)) == [3, 4]
    with pytest.raises(ValueError, match="1 sequences cannot be split over 2 ranks"):
        rank_rows([7], Rank(1, 2))


def make_policy(
    model_dir: Path, *, dtype: torch.dtype | None = None, learning_rate: float = LEARNING_RATE
) -> Policy:
    spec = ModelSpec(base_model=str(model_dir), finetune="full")
    return Policy(spec, learning_rate=learning_rate, seed=0, dtype=dtype)


def make_episodes(policy: Policy) -> list[Episode]:
    """4 sequences of one group, rewards 1, 0, 1, 0 (advantages +-1); their sampling logprobs
    are the policy's own, so the ratio starts at 1 and nothing is clipped."""
    episodes = []
    for i in range(4):
        ids = [5 + i, 17, 33 + i, 40, 41 + 2 * i, 60, 61 + i, 90 - i]
        logprobs = policy.probe_logprobs(ids)[2:]  # completion = ids[3:]
        episodes.append(
            Episode(
                group_index=0,
                policy_version=0,
                token_ids=ids,
                prompt_length=3,
                logprobs=logprobs,
                loss_mask=[1] * len(logprobs),
                reward=float(i % 2 == 0),
                env_error=False,
            )
        )
    return episodes


def _rank_main(
    rank: int, world_size: int, port: int, model_dir: Path, out: Path, bf16: bool = False
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    me = init_rank("cpu")
    ended_in_order = False
    try:
        _one_sharded_step(me, model_dir, out, bf16)
        ended_in_order = True
    finally:  # the sharded policy is unreachable by now: leave_group frees the group with it
        leave_group(peers_alive=ended_in_order)


def _one_sharded_step(me: Rank, model_dir: Path, out: Path, bf16: bool = False) -> None:
    policy = (
        make_policy(model_dir, dtype=torch.bfloat16, learning_rate=SMALL_LR)
        if bf16
        else make_policy(model_dir)
    )
    episodes = make_episodes(policy)
    shard_policy(policy)
    grad_norm = data_parallel_step(policy, episodes, CONFIG, me)
    state = full_state(policy)
    if me.is_leader:
        torch.save({"grad_norm": grad_norm, "state": state}, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration  # ~20 s: two spawned processes each import torch and transformers
def test_two_gloo_ranks_compute_the_single_process_update(tmp_path: Path) -> None:
    model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
    single = make_policy(model_dir)
    before = {n: p.detach().clone() for n, p in single.model.named_parameters()}
    stats = rl_update(single, make_episodes(single), CONFIG)
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, _free_port(), model_dir, out), nprocs=2, join=True)
    sharded = torch.load(out)
    assert sharded["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-4)
    state = sharded["state"]
    for name, param in single.model.named_parameters():
        # AdamW's first step moves every weight by ~lr (= 1e-3); the ranks' result may differ
        # only by float summation order: under 1e-5, 1% of the step (seen: < 1e-6).
        assert (param.detach() - before[name]).abs().max() > LEARNING_RATE / 2, name
        assert (state[name] - param.detach()).abs().max() < 1e-5, name


@pytest.mark.integration  # ~20 s: two spawned processes
def test_bf16_ranks_step_float32_masters_as_one_bf16_process_does(tmp_path: Path) -> None:
    """A bf16 full fine-tune at lr 1e-6: the 2 ranks shard float32 masters (FSDP2's mixed
    precision) and the one process steps float32 masters beside its bf16 weights
    (master_weights.py); both move by ~lr where bf16 weights alone would not move at all."""
    model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
    single = make_policy(model_dir, dtype=torch.bfloat16, learning_rate=SMALL_LR)
    names = [n for n, p in single.model.named_parameters() if p.requires_grad]
    before = {n: p.detach().float() for n, p in single.model.named_parameters()}
    stats = rl_update(single, make_episodes(single), CONFIG)
    masters = dict(zip(names, single.optimizer.state_dict()[MASTERS_KEY], strict=True))
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, _free_port(), model_dir, out, True), nprocs=2, join=True)
    sharded = torch.load(out)
    assert sharded["grad_norm"] == pytest.approx(stats.grad_norm, rel=2e-2)  # bf16 sums
    moved = 0.0
    for name in names:
        state = sharded["state"][name]
        assert state.dtype == torch.float32, name  # the masters, not bf16 weights
        step = (state - before[name]).abs()
        # Adam's first step is ~lr wherever the gradient is not ~0; bf16 gradients summed
        # in another order may flip a near-zero one: at most 2 lr apart, rarely.
        assert (state - masters[name]).abs().max() <= 2.5 * SMALL_LR, name
        assert ((state - masters[name]).abs() > SMALL_LR / 10).float().mean() < 0.02, name
        moved += (step > SMALL_LR / 2).float().mean().item() / len(names)
    assert moved > 0.5


def _leader_or_follower(
    rank: int, world_size: int, port: int, model_dir: Path, out: Path, ckpt: Path
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    me = init_rank("cpu", timeout_s=120)
    ended_in_order = False
    try:
        _drive_or_follow(me, model_dir, out, ckpt)
        ended_in_order = True
    finally:
        leave_group(peers_alive=ended_in_order)


def _drive_or_follow(me: Rank, model_dir: Path, out: Path, ckpt: Path) -> None:
    """Rank 0 drives a LeaderPolicy through an update, a weight gather, the probe, a
    checkpoint, a second update and a resume from that checkpoint; rank 1 follows."""
    policy = make_policy(model_dir)
    episodes = make_episodes(policy)
    shard_policy(policy)
    if not me.is_leader:
        follow(policy, me)
        return
    leader = LeaderPolicy(policy, me)
    stats = leader.update(episodes, CONFIG)
    after_1 = leader.trainable_state()
    probe = leader.probe_logprobs(policy.probe_token_ids)
    state = checkpoints.TrainerState(
        job_id="j", step=1, policy_version=1, rewards=[0.5], data_cursor=1
    )
    path = checkpoints.save(leader, state, ckpt, keep=2)
    optimizer_1 = leader.optimizer.state_dict()
    leader.update(episodes, CONFIG)
    moved = leader.trainable_state()
    checkpoints.load(leader, path)
    resumed = leader.trainable_state()
    optimizer_resumed = leader.optimizer.state_dict()
    leader.stop()
    torch.save(
        {
            "stats": stats,
            "after_1": after_1,
            "probe": probe,
            "moved": moved,
            "resumed": resumed,
            "optimizer_1": optimizer_1,
            "optimizer_resumed": optimizer_resumed,
            "path": str(path),
        },
        out,
    )


@pytest.mark.integration  # ~25 s: two spawned processes
def test_rank_zero_drives_a_follower_through_update_sync_checkpoint_and_resume(
    tmp_path: Path,
) -> None:
    model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
    single = make_policy(model_dir)
    stats = rl_update(single, make_episodes(single), CONFIG)
    out = tmp_path / "rank0.pt"
    args = (2, _free_port(), model_dir, out, tmp_path / "checkpoints")
    mp.spawn(_leader_or_follower, args=args, nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    # The 2-rank update's figures are the whole batch's, as the 1-process update's.
    for figure in ("loss", "grad_norm", "entropy", "ratio_mean", "clip_fraction"):
        assert getattr(got["stats"], figure) == pytest.approx(
            getattr(stats, figure), rel=1e-4, abs=1e-6
        ), figure
    assert got["stats"].trained_tokens == stats.trained_tokens
    for name, param in single.trainable_state().items():
        assert (got["after_1"][name] - param).abs().max() < 1e-5, name
    assert got["probe"] == pytest.approx(single.probe_logprobs(single.probe_token_ids), abs=1e-5)
    # The second update moved the weights; resuming the step-1 checkpoint brought them back.
    assert any((got["moved"][n] - got["after_1"][n]).abs().max() > 1e-4 for n in got["moved"])
    for name, tensor in got["after_1"].items():
        assert torch.equal(got["resumed"][name], tensor), name
    first, again = got["optimizer_1"], got["optimizer_resumed"]
    assert set(first["state"]) == set(range(len(single.trainable_parameters())))
    for i, moments in first["state"].items():
        assert torch.equal(again["state"][i]["exp_avg"], moments["exp_avg"]), i
    # The checkpoint is the 1-process format: a plain Policy resumes it (HF files + AdamW).
    plain = make_policy(model_dir)
    checkpoints.load(plain, Path(got["path"]))
    for name, param in single.trainable_state().items():
        assert (plain.trainable_state()[name] - param).abs().max() < 1e-5, name
    step = plain.optimizer.state_dict()["state"][0]["step"]
    assert float(step) == 1.0
