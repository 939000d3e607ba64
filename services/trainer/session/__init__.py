"""Training sessions: the primitives (forward_backward, optim_step, sample, ...) a user's own
loop calls on a session job's trainer, in order, until close or idle timeout."""
