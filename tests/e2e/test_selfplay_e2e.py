"""Self-play end to end: the real mesh trains the tiny model on the built-in
``gomoku_selfplay`` env with one LoRA adapter per role for a few steps, and validation
reports each role's win rate against the heuristic opponent."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

import opentinker
from opentinker import JobSpec, LoraConfig, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_gomoku_selfplay_trains_one_adapter_per_role_through_the_mesh(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")
    spec = JobSpec(
        name="selfplay-e2e",
        model=ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=4)),
        rl=RlConfig(
            env_name="gomoku_selfplay",
            # The untrained model writes no legal move; the env plays a random one for it.
            env_options={"invalid_move": "random"},
            steps=2,
            prompts_per_step=2,
            samples_per_prompt=2,
            max_turns=4,
            learning_rate=1e-2,
            sampling=SamplingParams(max_new_tokens=6),
            seed=3,
            max_staleness=0,
            val_every=2,
            val_episodes=4,
            val_env_options={"heuristic_plays": "alternate"},
        ),
    )
    settings = MeshSettings(run_root=tmp_path_factory.mktemp("mesh"))
    with (
        LocalMesh(settings) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client,
    ):
        events: list = []
        job = client.fit(spec, timeout=300, on_event=events.append)
    assert job.state == "SUCCEEDED", job.reason
    assert job.final_metrics["policy_version"] == 2
    steps = [e.metrics for e in events if e.kind == "step"]
    assert len(steps) == 2
    for m in steps:
        # Both roles played in every step, and the weight sync's probe (every role's
        # adapter) matched: the rollout served both adapters the trainer trained.
        assert {"role/black/reward_mean", "role/white/reward_mean"} <= set(m), sorted(m)
        assert m["probe_max_abs_diff"] < 1e-4 and m["env_errors"] == 0.0
        assert m["optimizer_steps"] >= 1
    rates = {k: v for k, v in steps[-1].items() if "win_rate_vs_heuristic" in k}
    assert rates and set(rates) <= {
        "role/black/win_rate_vs_heuristic",
        "role/white/win_rate_vs_heuristic",
    }, sorted(steps[-1])
    assert all(0.0 <= v <= 1.0 for v in rates.values())
    # The checkpoint holds one adapter per role, each of the same shapes, and they differ.
    adapters = {
        role: load_file(str(Path(job.checkpoint_uri, role, "adapter_model.safetensors")))
        for role in ("black", "white")
    }
    assert set(adapters["black"]) == set(adapters["white"])
    assert any(not adapters["black"][n].equal(adapters["white"][n]) for n in adapters["black"])
