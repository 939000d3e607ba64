"""The reference policy of the KL term: where the policy started.

LoRA: the base model with the adapter disabled (peft's ``disable_adapter()`` context) -- the
same weights in memory, no second copy. Full fine-tuning: a frozen copy of the model made when
the loop starts, before a resume loads a checkpoint, so it is the base model in every attempt.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from opentinker.services.trainer.model.forward import can_share_prompts, model_forward
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.model.shared_prompts import PromptGroups, shared_prompt_logprobs
from opentinker.services.trainer.rl.batch import SequenceBatch


class ReferencePolicy:
    """``logprobs(batch)``: the reference's next-token logprobs ``[B, T]``, no gradient."""

    def __init__(self, policy: Policy, frozen: PreTrainedModel | None) -> None:
        self.policy = policy
        self.frozen = frozen

    @classmethod
    def from_policy(cls, policy: Policy) -> ReferencePolicy:
        """Build before the first update (and before a resume): a full fine-tune copies the
        weights now."""
        if policy.is_lora:
            return cls(policy, None)
        frozen = copy.deepcopy(policy.model).eval()
        for p in frozen.parameters():
            p.requires_grad_(False)
        return cls(policy, frozen)

    @torch.no_grad()
    def logprobs(
        self, batch: SequenceBatch, *, temperature: float, groups: PromptGroups | None = None
    ) -> torch.Tensor:
        """The reference logprobs at the batch's loss positions, 0 elsewhere (the KL reads
        them there only). groups: rows that share a prompt; each prompt then runs once
        (shared_prompts.py)."""
        shared = groups if groups is not None and can_share_prompts(self.policy, batch) else None
        wanted_B_T = batch.loss_mask_B_T > 0
        if self.frozen is not None:
            if shared is not None:
                return self._shared(self.frozen, batch, shared, temperature)
            return model_forward(
                self.frozen,
                batch,
                temperature=temperature,
                device=self.policy.device,
                image_processor=self.policy.image_processor,
                wanted_B_T=wanted_B_T,
            ).logprobs_B_T
        with self.policy.model.disable_adapter():  # type: ignore[operator]
            if shared is not None:
                return self._shared(self.policy.model, batch, shared, temperature)
            logprobs_B_T, _ = self.policy.token_logprobs_and_entropy(
                batch, temperature=temperature, wanted_B_T=wanted_B_T
            )
        return logprobs_B_T

    def _shared(
        self,
        model: torch.nn.Module,
        batch: SequenceBatch,
        groups: PromptGroups,
        temperature: float,
    ) -> torch.Tensor:
        logprobs_B_T, _, _ = shared_prompt_logprobs(
            model,
            batch,
            groups,
            temperature=temperature,
            device=self.policy.device,
            chunk_positions=self.policy.logit_chunk_positions,
            wanted_B_T=batch.loss_mask_B_T > 0,
        )
        return logprobs_B_T
