"""One engine for many jobs: a node's shared rollout and the batcher that merges their calls."""
