"""AdamW with float32 master weights for the parameters held in bfloat16 (or float16).

On CUDA the policy is bfloat16, the dtype the rollout serves (placement.py). bfloat16 keeps 8
bits of mantissa: a weight of 0.02 moves only in steps of 1.2e-4, and an update under half of
that rounds away. AdamW's steps are about the learning rate, so at the 1e-6..1e-5 RL uses for
full fine-tuning nearly every update of a bfloat16 weight would be lost and the model would not
learn. As in Megatron's and DeepSpeed's bf16 optimizers, AdamW here steps float32 copies of
those parameters (the masters) with their gradients and writes the rounded result back: what
rounding drops stays in the master, so small steps add up. AdamW's own state (first and
second moments) is float32 with them.

Parameters already in float32 (everything on CPU; LoRA adapters, which peft keeps in float32
over a bfloat16 base) are stepped in place as by plain AdamW, with the same state_dict.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
MASTERS_KEY = "float32_masters"  # in state_dict(), only when some parameter has a master


class MasterWeightAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over ``params``, stepping a float32 master for each low-precision one."""

    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw: Any) -> None:
        self._masters: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        stepped: list[torch.Tensor] = []
        for param in params:
            if param.dtype in LOW_PRECISION:
                master = param.detach().to(torch.float32, copy=True)
                self._masters.append((param, master))
                stepped.append(master)
            else:
                stepped.append(param)
        super().__init__(stepped, **adamw)

    def __getstate__(self) -> dict[str, Any]:  # Optimizer's keeps its own keys only
        return {**super().__getstate__(), "_masters": self._masters}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for param, master in self._masters:
            master.grad = None if param.grad is None else param.grad.to(torch.float32)
        loss = super().step(closure)
        for param, master in self._masters:
            param.copy_(master)  # rounded to the parameter's dtype
            master.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param, _ in self._masters:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._masters:
            state[MASTERS_KEY] = [master.clone() for _, master in self._masters]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class or by plain AdamW. A state saved where every
        parameter was low precision (a bf16 policy on CUDA) loads into one where none is (a
        float32 policy on CPU) too: its masters are the float32 weights, copied in. Anything
        else that does not fit raises ValueError before changing a thing."""
        state_dict = dict(state_dict)
        masters = state_dict.pop(MASTERS_KEY, None)
        stepped = [p for group in self.param_groups for p in group["params"]]
        pairs = self._masters
        if masters is None:  # saved by plain AdamW: the parameters are the best start there is
            masters = [param.detach() for param, _ in self._masters]
        elif not self._masters and len(masters) == len(stepped):
            pairs = [(param, param) for param in stepped]  # the masters are the weights
        if len(masters) != len(pairs):
            raise ValueError(
                f"optimizer state holds {len(masters)} float32 masters, this policy has "
                f"{len(self._masters)} low-precision parameters (of {len(stepped)})"
            )
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for (param, master), saved in zip(pairs, masters, strict=True):
                master.copy_(saved)
                param.copy_(master)
