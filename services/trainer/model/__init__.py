"""The policy and its compute: forward passes, logprobs, micro-batches, the optimizer."""
