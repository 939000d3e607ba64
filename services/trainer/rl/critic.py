"""The critic of PPO: a value head on the policy's last hidden state, with its own AdamW.

``V(s_t) = w . h_t + b`` where ``h_t`` is the last layer's hidden state at position t (the state
before token t+1 is generated). The hidden states are detached: the value loss trains the head
only and never pulls on the policy's weights, so the head's learning rate
(``critic_learning_rate``) is the only knob of the critic. Starts at V = 0 (zero init).
"""

from __future__ import annotations

import torch


class Critic:
    """A linear value head ``[H] -> []`` and its optimizer, on ``device``."""

    def __init__(self, hidden_size: int, *, learning_rate: float, device: torch.device) -> None:
        self.head = torch.nn.Linear(hidden_size, 1).to(device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=learning_rate)

    def values(self, hidden_B_T_H: torch.Tensor) -> torch.Tensor:
        """Values ``[B, T]`` (with gradient into the head only)."""
        return self.head(hidden_B_T_H.detach()).squeeze(-1)

    def step(self, max_grad_norm: float) -> float:
        """Clip (0 = no clip), step, zero the gradients; returns the norm before clipping."""
        limit = max_grad_norm if max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), limit)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def state_dict(self) -> dict[str, object]:
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.head.load_state_dict(state["head"])  # type: ignore[arg-type]
        self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
