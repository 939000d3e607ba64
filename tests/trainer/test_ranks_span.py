"""A 2-device job on two workers of one device each: the scheduler spans it, rank 0's worker
runs the rollout and rank 0, the other worker's agent starts rank 1 alone, and the two ranks
meet at the scheduler's rendezvous (MultiNodeRendezvous) over gloo. Real mesh processes: Redis,
scheduler, EnvHub and two worker agents (the second with its own hostname and run folder)."""

from __future__ import annotations

import pytest

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_job_spanning_two_workers_trains_on_a_rank_from_each(tmp_path, letter_model_dir) -> None:
    settings = MeshSettings(run_root=tmp_path / "span", cpu_slots=1, warm_spares=0)
    with LocalMesh(settings) as mesh:
        mesh.start_worker(  # a second "node": stopped with the mesh
            "worker-b",
            {
                "OPENTINKER_RUN_ROOT": str(mesh.run_root / "jobs-b"),
                "OPENTINKER_HOSTNAME": "node-b",
                "OPENTINKER_WORKER_ID": "node-b",
                "OPENTINKER_RENDEZVOUS_HOST": "127.0.0.1",
                "OPENTINKER_RENDEZVOUS_PORTS": "[29700, 8]",
            },
        )
        rl = RlConfig(
            env_name="letter",
            env_options={"num_letters": "4"},
            steps=2,
            prompts_per_step=2,
            samples_per_prompt=4,
            learning_rate=1e-3,
            sampling=SamplingParams(max_new_tokens=1),
            seed=3,
        )
        spec = JobSpec(
            name="span",
            model=ModelSpec(base_model=str(letter_model_dir), finetune="full"),
            rl=rl,
            num_devices=2,
        )
        with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
            done = client.fit(spec, timeout=240)
        assert done.state == "SUCCEEDED", done.reason
        assert done.final_metrics["steps"] == 2
        parts = [mesh.run_root / "jobs", mesh.run_root / "jobs-b"]
        attempts = [root / done.job_id / "attempt-1" for root in parts]
        leader = [a for a in attempts if (a / "rollout.log").exists()]
        follower = [a for a in attempts if (a / "trainer-rank1.log").exists()]
        assert len(leader) == 1 and len(follower) == 1 and leader != follower  # one rank each
        assert "rank_leading" in (leader[0] / "trainer.log").read_text()
        rank_1 = (follower[0] / "trainer-rank1.log").read_text()
        assert "rank_following" in rank_1 and "rank_stopped" in rank_1
        assert not (follower[0] / "rollout.log").exists()  # only rank 0's worker plays
