"""Model-side pieces shared by trainer and rollout: the tiny local model, weight packing."""
