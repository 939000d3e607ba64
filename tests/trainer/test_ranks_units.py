"""The pieces of an N-rank job that need no process group: which jobs can run on several
ranks, and the environment each rank process starts with."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from opentinker import JobSpec, ModelSpec, RlConfig, SftConfig
from opentinker.errors import ConfigError
from opentinker.services.common.cpu_share import ThreadShareFile, ThreadShareReader
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.parallel.distributed import Rank
from opentinker.services.trainer.parallel.ranks import LeaderPolicy, check_data_parallel
from opentinker.services.trainer.rl.role_training import adopt_roles
from opentinker.services.worker.ranks import RankGroup, rank_envs
from opentinker.services.worker.supervisor import ManagedProcess
from opentinker.spec import LoraConfig

pytestmark = pytest.mark.unit


def rl_spec(**rl: object) -> JobSpec:
    config = RlConfig(env_name="letter", **rl)  # type: ignore[arg-type]
    return JobSpec(name="n", model=ModelSpec(base_model="m"), rl=config, num_devices=2)


def test_a_several_device_job_that_cannot_shard_is_refused_at_submission_naming_each() -> None:
    check_data_parallel(rl_spec(), 2)  # GRPO, one forward pass per rank: fine
    with pytest.raises(ValidationError) as err:
        rl_spec(kl_coef=0.1, loss="ppo", critic_learning_rate=1e-3, ppo_epochs=2)
    message = str(err.value)
    assert "num_devices: 2 devices train on 2 ranks, which needs kl_coef must be 0" in message
    assert "loss 'ppo'" in message and "ppo_epochs 1" in message
    one_device = JobSpec(
        model=ModelSpec(base_model="m"), rl=RlConfig(env_name="letter", kl_coef=0.1)
    )
    assert one_device.num_devices == 1  # one rank: any setting
    sft = JobSpec(kind="sft", sft=SftConfig(dataset_path="d.jsonl"), num_devices=2)
    with pytest.raises(ConfigError, match="a sft job trains on one device"):
        check_data_parallel(sft, 2)  # the worker starts ranks for RL jobs only


def test_per_role_adapters_on_several_ranks_fail_naming_the_setting_not_with_a_crash(
    tmp_path: Path,
) -> None:
    # Only the env knows its roles, so the spec cannot refuse this; rank 0 refuses it when
    # the rollout names them (it used to call use_role_adapters, which a LeaderPolicy lacks:
    # AttributeError). Nothing here needs the process group: it fails before any order.
    spec = ModelSpec(
        base_model=str(ensure_tiny_model(tmp_path / "tiny")), finetune="lora", lora=LoraConfig()
    )
    leader = LeaderPolicy(Policy(spec, learning_rate=1e-3, seed=0), Rank(0, 2))
    rl = RlConfig(env_name="letter")  # role_adapters "per_role", the default
    with pytest.raises(ConfigError, match="rl.role_adapters: 'per_role'.*'shared' or num_dev"):
        adopt_roles(leader, ("black", "white"), rl)
    assert not adopt_roles(leader, (), rl)  # an env without roles: nothing to adopt
    assert not adopt_roles(
        leader, ("black", "white"), RlConfig(env_name="e", role_adapters="shared")
    )


def test_one_worker_ranks_meet_on_localhost_and_a_spanning_part_numbers_from_its_start() -> None:
    local = rank_envs(2, {})
    assert [e["RANK"] for e in local] == ["0", "1"]
    assert [e["LOCAL_RANK"] for e in local] == ["0", "1"]
    assert {e["MASTER_ADDR"] for e in local} == {"127.0.0.1"}
    assert local[0]["MASTER_PORT"] == local[1]["MASTER_PORT"] and local[0]["WORLD_SIZE"] == "2"
    rendezvous = {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29501",
        "WORLD_SIZE": "3",
        "NNODES": "2",
        "NODE_RANK": "1",
        "RANK_START": "2",
        "LOCAL_WORLD_SIZE": "1",
    }
    (part,) = rank_envs(1, rendezvous)
    assert part["RANK"] == "2" and part["LOCAL_RANK"] == "0" and part["MASTER_ADDR"] == "10.0.0.1"


def test_a_rank_group_ends_at_the_first_failing_rank_and_names_it(tmp_path: Path) -> None:
    async def main() -> tuple[int, str, list[int | None]]:
        ranks = [
            await ManagedProcess.start(
                name, [sys.executable, "-c", code], log_path=tmp_path / f"{name}.log", env={}
            )
            for name, code in [
                ("trainer", "import time; time.sleep(30)"),
                ("trainer-rank1", "import sys; print('peer gone'); sys.exit(3)"),
            ]
        ]
        group = RankGroup(ranks)
        code = await asyncio.wait_for(group.wait(), timeout=20)
        await group.terminate(1.0)
        return code, group.name, [r.returncode for r in ranks]

    code, name, codes = asyncio.run(main())
    assert code == 3 and name == "trainer-rank1"
    assert codes[0] is not None and codes[0] < 0  # rank 0 was stopped, not left running


def test_a_jobs_ranks_on_one_worker_split_its_cpu_share(tmp_path: Path) -> None:
    share = ThreadShareFile(tmp_path / "share", cores=8)
    rank = ThreadShareReader(share.path, sharers=2)  # one of a job's 2 ranks here
    for jobs, threads in ((1, 4), (2, 2), (4, 1), (8, 1)):  # 8 // jobs // 2, at least 1
        share.publish(jobs)
        assert rank.threads() == threads
