"""Trainer: the policy (full or LoRA), GRPO, AdamW, verified weight sync, checkpoints."""
