"""Sampler snapshots: the weights each SaveWeightsForSampler served, kept so a sampler made
from them samples exactly them for as long as it lives (Tinker's sampling clients are bound
to the weights they were made from; a DPO reference or an async-RL sampler of an older
policy must not drift with training).

A snapshot is a copy of the policy's trainable tensors (LoRA: the adapter only) as they were
served as one policy version, and the probe answer the verified sync proved then. The session
serves one version at a time on its rollout engine; sampling from another swaps that
snapshot's tensors in with the same verified sync (only the trainable tensors travel: a LoRA
adapter is small). The newest ``memory_bytes`` of snapshots stay in memory; older ones are
written to ``spill_dir`` and read back when sampled.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from opentinker.errors import NotFoundError
from opentinker.services.trainer.model.policy import Policy, Probe


@dataclass
class Snapshot:
    """The weights served as ``version``; quacks like a Policy for ``verified_sync`` (its
    trainable state and its probe answer are the ones of that version)."""

    version: int
    tensors: dict[str, torch.Tensor] | None  # None: spilled to disk
    probe_answer: Probe
    tolerance: float
    probe_token_ids: list[int]
    is_lora: bool
    dtype: torch.dtype
    nbytes: int

    def trainable_state(self) -> dict[str, torch.Tensor]:
        assert self.tensors is not None, "load a spilled snapshot first"
        return self.tensors

    def probe(self, token_ids: list[int]) -> Probe:
        return self.probe_answer


class Snapshots:
    """The session's sampler snapshots, by policy version."""

    def __init__(self, *, memory_bytes: int, spill_dir: Path) -> None:
        self.memory_bytes = memory_bytes
        self.spill_dir = Path(spill_dir)
        self._kept: OrderedDict[int, Snapshot] = OrderedDict()  # oldest first

    def keep(self, policy: Policy, version: int, probe: Probe, tolerance: float) -> Snapshot:
        """Copy ``policy``'s trainable tensors (to the host) as ``version``'s snapshot."""
        tensors = {n: t.detach().to("cpu", copy=True) for n, t in policy.trainable_state().items()}
        snapshot = Snapshot(
            version=version,
            tensors=tensors,
            probe_answer=probe,
            tolerance=tolerance,
            probe_token_ids=list(policy.probe_token_ids),
            is_lora=policy.is_lora,
            dtype=policy.dtype,
            nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        )
        self._kept[version] = snapshot
        self._spill_beyond_budget(newest=version)
        return snapshot

    def get(self, version: int) -> Snapshot:
        """The snapshot of ``version`` with its tensors in memory (read back if spilled)."""
        snapshot = self._kept.get(version)
        if snapshot is None:
            raise NotFoundError(
                f"policy_version: {version} was never served to sample by this session "
                "(make a sampler with save_weights_for_sampler first)",
                reason="NO_SNAPSHOT",
            )
        if snapshot.tensors is None:
            snapshot.tensors = torch.load(self._file(version), weights_only=True)
            self._kept.move_to_end(version)
            self._spill_beyond_budget(newest=version)
        return snapshot

    def in_memory_bytes(self) -> int:
        return sum(s.nbytes for s in self._kept.values() if s.tensors is not None)

    def _spill_beyond_budget(self, *, newest: int) -> None:
        """Write the oldest in-memory snapshots to disk until the rest fit the budget (the
        one just kept or read stays)."""
        for version, snapshot in list(self._kept.items()):
            if self.in_memory_bytes() <= self.memory_bytes:
                return
            if version == newest or snapshot.tensors is None:
                continue
            path = self._file(version)
            if not path.exists():
                self.spill_dir.mkdir(parents=True, exist_ok=True)
                torch.save(snapshot.tensors, path)
            snapshot.tensors = None

    def _file(self, version: int) -> Path:
        return self.spill_dir / f"v{version}.pt"
