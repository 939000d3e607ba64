"""Job processes under uids of their own (services/worker/job_user.py, issue 35): a real
scheduler and a real worker agent started as root with OPENTINKER_JOB_UIDS; the job's trainer
(a stand-in that probes the files around it, then reports as the real one does) runs as a uid
of the range, cannot read the agent's worker token, another job's folder or another job's
checkpoints, and writes its own run folder and checkpoint folder."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_agent_helpers import mesh_with_agent, run, submit, wait_for_state, wait_until

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.services.worker.job_user import JobUsers
from opentinker.services.worker.settings import WorkerSettings

pytestmark = pytest.mark.integration

FIRST_UID = 20_000

# Both of the job's processes: probe what they can reach and write the answers into the run
# folder (plain Python: the machine's, which every uid can run); the rollout then says it is
# ready and waits, the trainer exits (without a result: the job ends FAILED, as it may here).
PROBE = """
import json, os, sys
from pathlib import Path

launch = json.loads(Path(sys.argv[sys.argv.index("--launch") + 1]).read_text())
run_dir, checkpoints = Path(launch["run_dir"]), Path(launch["checkpoint_dir"])
secrets, others = Path(os.environ["PROBE_SECRETS"]), Path(os.environ["PROBE_OTHERS"])

def readable(path):
    try:
        Path(path).read_bytes() if Path(path).is_file() else os.listdir(path)
        return True
    except OSError:
        return False

name = "trainer" if "--rollout-address-file" in sys.argv else "rollout"
if name == "trainer":
    (checkpoints / "step-000001").mkdir(parents=True, exist_ok=True)
    import time
    deadline = time.monotonic() + 60  # the rollout has probed too before this one ends
    while not (run_dir / "rollout.addr").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
probe = {
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "worker_token": readable(secrets / "worker.token"),
    "other_job": readable(others / "job"), "other_checkpoints": readable(others / "ckpt"),
    "home": os.environ["HOME"],
}
(run_dir / f"probe-{name}.json").write_text(json.dumps(probe))
if name == "rollout":
    (run_dir / "rollout.addr").write_text("127.0.0.1:1")
    import time
    time.sleep(60)
"""
SYSTEM_PYTHON = Path("/usr/bin/python3")


def readable_by_others(path: Path) -> bool:
    """Whether a uid other than ours can reach ``path`` (every folder above it searchable)."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents] if p.is_dir())


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A folder other uids can reach (pytest's tmp_path lies under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="job-user-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_pool_needs_root_and_gives_each_running_job_its_own_uid() -> None:
    if os.geteuid() != 0:
        with pytest.raises(ConfigError, match="started as root"):
            JobUsers(FIRST_UID, 2)
        return
    pool = JobUsers(FIRST_UID, 2)
    first, second = pool.take(("a", 1)), pool.take(("b", 1))
    assert {first.uid, second.uid} == {FIRST_UID, FIRST_UID + 1}
    with pytest.raises(ConfigError, match="widen OPENTINKER_JOB_UIDS"):
        pool.take(("c", 1))
    pool.give_back(("a", 1))
    assert pool.take(("c", 1)) == first
    assert JobUsers(0, 0).take(("d", 1)) is None  # off: the agent's own uid


def test_the_setting_names_a_bad_range() -> None:
    with pytest.raises(ValueError, match="first uid >= 1000"):
        WorkerSettings(job_uids=(0, 4))
    assert WorkerSettings(job_uids=(20000, 4)).job_uids == (20000, 4)


@pytest.mark.skipif(os.geteuid() != 0, reason="starting processes as other uids needs root")
def test_a_job_runs_as_its_uid_and_reads_none_of_the_agents_or_other_jobs_files(
    redis_url: str, open_tmp: Path
) -> None:
    if not SYSTEM_PYTHON.exists() or not readable_by_others(SYSTEM_PYTHON.resolve()):
        pytest.skip(f"no {SYSTEM_PYTHON} that other uids can run")
    others = open_tmp / "others"
    for name in ("job", "ckpt"):
        (others / name).mkdir(parents=True)
        (others / name).chmod(0o700)
        os.chown(others / name, FIRST_UID + 7, FIRST_UID + 7)  # another job's uid
    (open_tmp / "probe.py").write_text(PROBE)
    secrets = open_tmp / "secrets"
    secrets.mkdir(mode=0o755)
    os.environ.update(PROBE_SECRETS=str(secrets), PROBE_OTHERS=str(others))
    probe = [str(SYSTEM_PYTHON), "-I", str(open_tmp / "probe.py")]

    async def main() -> None:
        async with mesh_with_agent(
            redis_url,
            open_tmp,
            job_uids=(FIRST_UID, 2),
            trainer_command=probe,
            rollout_command=probe,
        ) as mesh:
            token = secrets / "worker.token"  # the agent's token, as the agent's alone
            token.write_text(mesh.agent.settings.worker_token)
            token.chmod(0o600)
            job = await submit(mesh.stub, "good")
            await wait_for_state(mesh.stub, job.job_id, common_pb2.JOB_STATE_FAILED, 60)
            run_dir = mesh.run_root / job.job_id / "attempt-1"
            for name in ("rollout", "trainer"):
                found = json.loads((run_dir / f"probe-{name}.json").read_text())
                assert found["uid"] == FIRST_UID and found["gid"] == FIRST_UID, found
                assert found["groups"] in ([], [FIRST_UID]), found
                assert found["worker_token"] is False, "the job read the agent's worker token"
                assert found["other_job"] is False and found["other_checkpoints"] is False
                assert found["home"] == str(run_dir.resolve())
            checkpoints = mesh.agent.settings.checkpoint_dir(job.job_id)
            assert (checkpoints / "step-000001").is_dir()
            assert checkpoints.stat().st_uid == FIRST_UID
            assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
            await wait_until(lambda: not mesh.agent.held.runs)
            users = mesh.agent.job_users  # the job's uid was given back: both are free
            assert {users.take(("next", i)).uid for i in (1, 2)} == {FIRST_UID, FIRST_UID + 1}

    try:
        run(main)
    finally:
        for name in ("PROBE_SECRETS", "PROBE_OTHERS"):
            os.environ.pop(name, None)
