"""The figures one RL step reports to the scheduler (the event stream's step metrics)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from opentinker.services.common.env_errors import EnvErrorTally, env_error_metrics, tally
from opentinker.services.common.env_stats import summarize_episodes, truncated_fraction
from opentinker.services.trainer.rl.agent_segments import first_rows
from opentinker.services.trainer.rl.batch import CollectedBatch, Episode
from opentinker.services.trainer.rl.role_metrics import role_reward_means
from opentinker.services.trainer.rl.training import TrainStats
from opentinker.services.trainer.rollout_link.weight_sync import ProbeShift


@dataclass(frozen=True)
class StepTimes:
    """Seconds one step spent training, syncing weights, and in all; ``wait_s``: waiting for
    its batch (with max_staleness >= 1 the batch was mostly played while the last step trained)."""

    train_s: float
    sync_s: float
    step_s: float
    wait_s: float = 0.0


def update_metrics(stats: TrainStats) -> dict[str, float]:
    """The figures of the step's update (training.TrainStats)."""
    return {
        "loss": stats.loss,
        "entropy": stats.entropy,
        "clip_fraction": stats.clip_fraction,
        "ratio_mean": stats.ratio_mean,
        "grad_norm": stats.grad_norm,
        "kl": stats.kl,
        "value_loss": stats.value_loss,
        "explained_variance": stats.explained_variance,
        "optimizer_steps": float(stats.optimizer_steps),
        # Padding's share of the micro-batches' padded tokens (rows x longest row), what
        # RlConfig's max_padding_fraction bounds per micro-batch.
        "padding_share": stats.padding_share,
        "logprob_gap": stats.logprob_gap,
        # Parts of time_train_s (the rest: advantages, reference / old-policy passes, collate)
        "time_train_forward_backward_s": stats.forward_backward_s,
        "time_train_optimizer_s": stats.optimizer_s,
    }


def step_metrics(
    batch: CollectedBatch,
    episodes: list[Episode],
    stats: TrainStats,
    times: StepTimes,
    *,
    probe_diff: float,
    probe: ProbeShift,
    lr: float = 0.0,
    off_policy_lag: int = 0,
) -> dict[str, float]:
    """Every figure one step reports (names are part of the event stream's contract)."""
    rows = episodes  # an agent episode's segment rows count once below (agent_segments.py)
    episodes = [rows[i] for i in first_rows(rows)]
    rewards = [e.reward for e in episodes]
    reward_mean = sum(rewards) / len(rewards)
    # Generation and env work the trainer waited for (all of it when strictly on-policy; with
    # overlap, only what training did not hide); the rest of the step beyond training and the
    # weight sync is what the mesh itself cost.
    rollout_s = min(times.wait_s, batch.generate_seconds + batch.env_seconds)
    mesh_s = times.step_s - rollout_s - times.train_s
    return {
        "reward_mean": reward_mean,
        "reward_std": math.sqrt(sum((r - reward_mean) ** 2 for r in rewards) / len(rewards)),
        **update_metrics(stats),
        "lr": lr,
        "probe_max_abs_diff": probe_diff,
        # How far this update moved the probe: the sync tells versions apart above tolerance;
        # how many versions back it could not (weight_sync.ProbeShift).
        "probe_shift": probe.shift,
        "probe_blind_versions": float(probe.blind_versions),
        "tokens_per_s": batch.generated_tokens / times.step_s if times.step_s > 0 else 0.0,
        # Accounted per job and tenant by the scheduler (quotas.py reads these names).
        "tokens_generated": float(batch.generated_tokens),
        "tokens_trained": float(stats.trained_tokens),
        "completion_len_mean": sum(len(e.token_ids) - e.prompt_length for e in rows) / len(rows),
        "episodes": float(len(episodes)),
        # env_errors, env_error_frac, env_errors/<kind> (common/env_errors.py)
        **env_error_metrics(batch_env_errors(batch)),
        # Share ended by max_turns / max_episode_tokens rather than by the env (done).
        "episodes_truncated_frac": truncated_fraction([e.truncated_by for e in episodes]),
        "time_generate_s": batch.generate_seconds,
        "time_env_s": batch.env_seconds,
        "time_train_s": times.train_s,
        "time_weight_sync_s": times.sync_s,
        "time_step_s": times.step_s,
        "time_rollout_wait_s": times.wait_s,
        # Policy versions between the one that played the batch and the one trained on it.
        "off_policy_lag": float(off_policy_lag),
        # What the mesh itself cost: gRPC, (de)serialization, packing, waiting.
        "time_mesh_s": max(0.0, mesh_s - times.sync_s),
        # Per-job env statistics: episodes, reward sum/mean, turns, win/loss/draw rates.
        **summarize_episodes(
            rewards, [e.num_turns for e in episodes], [e.outcome for e in episodes]
        ),
        **role_reward_means(episodes),  # multi-agent self-play only
        **agent_metrics(batch.episodes),  # agent-program episodes only
    }


def batch_env_errors(batch: CollectedBatch) -> EnvErrorTally:
    """The batch's ENV_ERROR episodes: how many of all, their kinds, the first reason."""
    failed = [e.finish_detail for e in batch.episodes if e.env_error]
    return tally(failed, len(first_rows(batch.episodes)))


def agent_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Agent-program jobs: ``agent_rewrites``, the calls of the batch that could not continue
    their episode's token segment (the agent rewrote its conversation; each segment is a row
    of its own), counted once per episode."""
    once = [episodes[i] for i in first_rows(episodes)]
    rewrites = [e.agent_rewrites for e in once if e.agent_rewrites is not None]
    return {"agent_rewrites": float(sum(rewrites))} if rewrites else {}
