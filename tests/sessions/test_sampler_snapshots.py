"""A training session's sampler snapshots (services/trainer/session/snapshots.py): each keeps
the weights as they were served, however the policy trains after; past the memory budget the
oldest go to disk and come back exactly."""

from __future__ import annotations

from pathlib import Path

import torch

from opentinker.services.trainer.model.policy import Policy, Probe
from opentinker.services.trainer.session.snapshots import Snapshots
from opentinker.spec import LoraConfig, ModelSpec


def test_snapshots_keep_served_weights_and_spill_the_oldest_past_the_budget(
    letter_model_dir: Path, tmp_path: Path
) -> None:
    spec = ModelSpec(base_model=str(letter_model_dir), finetune="lora", lora=LoraConfig(rank=2))
    policy = Policy(spec, learning_rate=1e-2, seed=0)
    one = sum(t.numel() * t.element_size() for t in policy.trainable_state().values())
    snapshots = Snapshots(memory_bytes=int(1.5 * one), spill_dir=tmp_path / "spill")
    served: dict[int, dict[str, torch.Tensor]] = {}
    for version in (1, 2, 3):
        with torch.no_grad():
            for p in policy.trainable_parameters():
                p.add_(0.1 * version)  # an "optimizer step" in place
        served[version] = {n: t.clone() for n, t in policy.trainable_state().items()}
        snapshots.keep(policy, version, Probe([-1.0 * version], 2.0), tolerance=1e-3)
    # Only the newest fits the budget: 1 and 2 were written to disk.
    assert snapshots.in_memory_bytes() == one
    assert sorted(p.name for p in (tmp_path / "spill").iterdir()) == ["v1.pt", "v2.pt"]
    for version in (1, 3, 2):  # read back exactly, whatever the policy holds now
        snapshot = snapshots.get(version)
        assert snapshot.probe(snapshot.probe_token_ids).logprobs == [-1.0 * version]
        state = snapshot.trainable_state()
        assert state.keys() == served[version].keys()
        assert all(torch.equal(state[n], served[version][n]) for n in state)
    assert snapshots.in_memory_bytes() == one  # reading one back spilled another
