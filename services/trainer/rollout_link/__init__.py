"""The trainer's side of the Rollout stream: opening it, batches, verified weight sync."""
