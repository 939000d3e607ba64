"""One SFT optimizer step, and the validation loss: the model work of the SFT loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opentinker.services.trainer.losses.cross_entropy import cross_entropy
from opentinker.services.trainer.model.logprobs import token_logprobs_and_entropy
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.sft.batches import SftBatch


@dataclass(frozen=True)
class SftStepStats:
    loss: float  # weighted mean NLL of the batch's trained tokens (nats per token)
    grad_norm: float  # before clipping
    trained_tokens: int  # tokens with weight > 0
    tokens: int  # tokens in the batch, padding included


def _logprobs_and_weights(policy: Policy, batch: SftBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logprobs ``[B, L-1]`` and their weights ``[B, L-1]``.

    Computed in chunks of positions (logprobs.py), with position_ids and no attention mask, so
    attention stays within each packed conversation (see batches.py); no KV cache, which
    would turn that off. The output head runs only where a weight is not 0 (prompts and
    padding hold 0).
    """
    weights_B_T = batch.weights_B_L[:, 1:].to(policy.device)
    logprobs_B_T, _ = token_logprobs_and_entropy(
        policy.model,
        batch.tokens_B_L.to(policy.device),
        None,
        position_ids_B_L=batch.position_ids_B_L.to(policy.device),
        chunk_positions=policy.logit_chunk_positions,
        wanted_B_T=weights_B_T != 0,
    )
    return logprobs_B_T, weights_B_T


def train_step(policy: Policy, batch: SftBatch, *, max_grad_norm: float) -> SftStepStats:
    """Weighted cross entropy on the batch, backward, clip, AdamW step."""
    policy.model.train()
    logprobs_B_T, weights_B_T = _logprobs_and_weights(policy, batch)
    loss = cross_entropy(logprobs_B_T, weights_B_T)
    loss.backward()
    grad_norm = policy.optimizer_step(max_grad_norm)
    return SftStepStats(
        loss=float(loss.detach()),
        grad_norm=grad_norm,
        trained_tokens=int((weights_B_T > 0).sum()),
        tokens=batch.num_tokens,
    )


@torch.no_grad()
def validation_loss(policy: Policy, batches: list[SftBatch]) -> float:
    """Weighted mean NLL over every trained token of ``batches`` (not a mean of batch means),
    in eval mode (no dropout)."""
    was_training = policy.model.training
    policy.model.eval()
    try:
        total, weight = 0.0, 0.0
        for batch in batches:
            logprobs_B_T, weights_B_T = _logprobs_and_weights(policy, batch)
            total -= float((logprobs_B_T * weights_B_T).sum())
            weight += float(weights_B_T.sum())
        return total / weight if weight > 0 else 0.0
    finally:
        policy.model.train(was_training)
