"""A session's named loss on a DatumBatch: forward through the Policy, then the pure loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentinker.services.trainer.losses.cispo import cispo_loss
from opentinker.services.trainer.losses.cross_entropy import weighted_nll_sum
from opentinker.services.trainer.losses.dro import dro_loss
from opentinker.services.trainer.losses.gspo import gspo_loss
from opentinker.services.trainer.losses.importance_sampling import importance_sampling_loss
from opentinker.services.trainer.losses.ppo_token import ppo_token_loss
from opentinker.services.trainer.losses.stable_reinforce import stable_reinforce_loss
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.session.data import DatumBatch, LossName

DEFAULT_CLIP_LOW, DEFAULT_CLIP_HIGH = 0.8, 1.2


@dataclass(frozen=True)
class LossSpec:
    """Which loss; for ppo, cispo and gspo the bounds of the probability ratio; for
    stable_reinforce the weight of its KL term, for dro its beta."""

    name: LossName
    clip_low: float = DEFAULT_CLIP_LOW
    clip_high: float = DEFAULT_CLIP_HIGH
    kl_coeff: float = 0.0


@dataclass(frozen=True)
class LossResult:
    """``loss``: the summed loss (with gradient when computed with one); ``logprobs``: each
    datum's target-token logprobs (its own length); ``metrics``: plain floats."""

    loss: torch.Tensor
    logprobs: list[list[float]]
    metrics: dict[str, float]


def evaluate(policy: Policy, data: DatumBatch, spec: LossSpec) -> LossResult:
    """Logprobs of the targets under ``policy`` (temperature 1) and the loss ``spec`` names."""
    logprobs_B_T, _ = policy.token_logprobs_and_entropy(data.batch, targets_B_T=data.targets_B_T)
    metrics: dict[str, float] = {"tokens": float(data.mask_B_T.sum())}
    if spec.name == "cross_entropy":
        loss = weighted_nll_sum(logprobs_B_T, data.weights_B_T)
        metrics["weight_sum"] = float(data.weights_B_T.sum())
    elif spec.name == "importance_sampling":
        loss = importance_sampling_loss(
            logprobs_B_T, data.sampling_logprobs_B_T, data.advantages_B_T, data.mask_B_T
        )
    elif spec.name == "stable_reinforce":  # trains where weights say (the gateway: sampled)
        loss, sr = stable_reinforce_loss(
            logprobs_B_T,
            data.sampling_logprobs_B_T,
            data.advantages_B_T,
            data.weights_B_T,
            kl_coeff=spec.kl_coeff,
        )
        metrics["truncated_fraction"], metrics["kl"] = sr.truncated_fraction, sr.kl
    elif spec.name == "dro":  # every real position, as Tinker's; kl_coeff is its beta
        loss, metrics["log_ratio_sq"] = dro_loss(
            logprobs_B_T,
            data.sampling_logprobs_B_T,
            data.advantages_B_T,
            data.mask_B_T,
            beta=spec.kl_coeff,
        )
    elif spec.name == "gspo":
        loss, gs = gspo_loss(
            logprobs_B_T,
            data.sampling_logprobs_B_T,
            data.advantages_B_T,
            data.mask_B_T,
            data.ratio_mask_B_T,
            clip_low=spec.clip_low,
            clip_high=spec.clip_high,
        )
        metrics["clip_fraction"] = gs.clip_fraction
    else:
        clipped_loss = ppo_token_loss if spec.name == "ppo" else cispo_loss
        # Positions with an advantage: the prompt's (advantage 0, sampling logprob 0) add
        # nothing to the loss, but their ratio exp(logp) counted as clipped in clip_fraction
        trained_B_T = data.mask_B_T * (data.advantages_B_T != 0)
        loss, stats = clipped_loss(
            logprobs_B_T,
            data.sampling_logprobs_B_T,
            data.advantages_B_T,
            trained_B_T,
            clip_low=spec.clip_low,
            clip_high=spec.clip_high,
        )
        metrics["clip_fraction"] = stats.clip_fraction
    detached_B_T = logprobs_B_T.detach().cpu()
    per_datum = [detached_B_T[b, :n].tolist() for b, n in enumerate(data.lengths)]
    metrics["loss:sum"] = float(loss.detach())
    return LossResult(loss=loss, logprobs=per_datum, metrics=metrics)
