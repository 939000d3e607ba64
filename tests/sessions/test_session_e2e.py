"""Training sessions end to end: the real mesh (Redis, scheduler, envhub, worker, and the
trainer + rollout it starts for each session), the examples' own loops, idle timeout and
tenant isolation."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import grpc
import pytest

import opentinker
from opentinker import AdamParams, Datum, SessionConfig
from opentinker.admin import AdminClient
from opentinker.connection import Connection
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    """An example script as a module (its ``train`` is what a user would run)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        # Sessions report their usage every 0.5 s (30 s by default), for the tests to see it
        env.setenv("OPENTINKER_TRAINER_SESSION_USAGE_REPORT_S", "0.5")
        with LocalMesh(MeshSettings(run_root=tmp_path_factory.mktemp("mesh"))) as running:
            yield running


@pytest.fixture()
def client(mesh):
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=30) as c:
        yield c


def test_grpo_example_raises_the_letter_reward(client, letter_model_dir: Path) -> None:
    rewards = example("session_grpo_letter").train(
        client, str(letter_model_dir), steps=8, num_letters="1"
    )
    assert max(rewards[-3:]) > rewards[0] + 0.2, f"reward did not rise: {rewards}"


def test_sft_example_lowers_the_loss(client, letter_model_dir: Path) -> None:
    losses = example("session_sft_chat").train(
        client, str(letter_model_dir), steps=8, learning_rate=5e-2
    )
    assert losses[-1] < 0.7 * losses[0], f"loss did not fall: {losses}"
    # Closing ended the job successfully, and its steps and tokens are accounted.
    job = next(iter(client.list_jobs()))
    assert job.state == "SUCCEEDED" and job.reason == "closed", job
    assert job.final_metrics["steps"] == 8
    usage = next(j.usage for j in client.usage()[0].jobs if j.job_id == job.job_id)
    assert usage.steps == 8 and usage.tokens_trained > 0 and usage.device_seconds > 0


def test_idle_session_ends_frees_its_device_and_is_hidden_from_other_tenants(
    client, mesh, letter_model_dir: Path
) -> None:
    session = client.training_session(
        base_model=str(letter_model_dir), session=SessionConfig(idle_timeout_s=4)
    )
    assert client.usage()[0].devices_in_use == 1
    info = session.get_info()
    assert info.session_id == session.job_id and info.step == 0

    # Clear errors for the owner: the bad datum and field named; a seq used twice refused.
    with pytest.raises(opentinker.InvalidArgumentError, match=r"data\[0\]: target_tokens"):
        session.forward_backward([Datum(input_tokens=[1, 2], target_tokens=[7])])
    with pytest.raises(opentinker.FailedPreconditionError, match="forward_backward first"):
        session.optim_step(AdamParams(learning_rate=1e-3))
    owner = Connection(session.endpoint, api_key=mesh.api_key, timeout=10)
    again = trainer_pb2.SessionCall(session_id=session.job_id, seq=1)
    with pytest.raises(grpc.RpcError) as repeated:
        trainer_pb2_grpc.TrainerServiceStub(owner.channel).CloseSession(
            trainer_pb2.CloseSessionRequest(call=again), timeout=10
        )
    assert repeated.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "out of order" in (repeated.value.details() or "")
    owner.close()

    # Another tenant's key reaches the endpoint but learns nothing: NOT_FOUND.
    with AdminClient(mesh.scheduler_address, api_key=_admin_key(mesh)) as admin:
        admin.create_tenant("globex")
        admin.create_user("bob", tenant_id="globex")
        other_key = admin.create_api_key("bob", label="test")
    channel = Connection(session.endpoint, api_key=other_key, timeout=10)
    stub = trainer_pb2_grpc.TrainerServiceStub(channel.channel)
    call = trainer_pb2.SessionCall(session_id=session.job_id, seq=1)
    for rpc, request in (
        (stub.GetSessionInfo, trainer_pb2.GetSessionInfoRequest(session_id=session.job_id)),
        (stub.CloseSession, trainer_pb2.CloseSessionRequest(call=call)),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            rpc(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()

    # Nobody calls: the idle timeout ends the job, successfully, and frees the device.
    deadline = time.monotonic() + 60
    while not (job := client.get_job(session.job_id)).done and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job.state == "SUCCEEDED" and job.reason == "idle timeout", job
    assert job.endpoint == ""
    assert client.usage()[0].devices_in_use == 0
    with pytest.raises(opentinker.OpenTinkerError):
        session.close()  # the trainer is gone


def _admin_key(mesh: LocalMesh) -> str:
    from opentinker.services.launcher.mesh import ADMIN_KEY_FILE

    return (mesh.secrets_dir / ADMIN_KEY_FILE).read_text().strip()


def test_what_a_session_samples_and_trains_after_its_last_step_is_counted_at_its_end(
    client, letter_model_dir: Path
) -> None:
    """A session's tokens reached its usage only with a step's report, so a session that
    sampled and never stepped (or sampled after its last step) was never counted."""
    session = client.training_session(base_model=str(letter_model_dir))
    sampled = session.sample([1, 2, 3], num_samples=3, sampling=opentinker.SamplingParams(
        max_new_tokens=5))  # fmt: skip
    trained = session.forward_backward([Datum(input_tokens=[1, 2, 3], target_tokens=[2, 3, 4])])
    session.close()
    generated = sum(len(s.tokens) for s in sampled.sequences)
    assert generated > 0 and trained.metrics["tokens"] == 3
    [tenant] = client.usage(max_jobs=50)
    [job] = [j for j in tenant.jobs if j.job_id == session.job_id]
    assert (job.usage.tokens_generated, job.usage.tokens_trained) == (generated, 3)
    assert job.usage.steps == 0


def test_a_session_that_only_samples_is_counted_as_it_goes_and_once(
    client, letter_model_dir: Path
) -> None:
    """Its tokens reached the usage only with its end, so a trainer that died first lost all
    of them: now they are reported every session_usage_report_s, never twice."""
    session = client.training_session(base_model=str(letter_model_dir))
    params = opentinker.SamplingParams(max_new_tokens=4)

    def counted() -> float:
        [tenant] = client.usage(max_jobs=50)
        return next(j.usage.tokens_generated for j in tenant.jobs if j.job_id == session.job_id)

    first = session.sample([1, 2, 3], num_samples=2, sampling=params)
    generated = sum(len(s.tokens) for s in first.sequences)
    deadline = time.monotonic() + 15
    while counted() < generated and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counted() == generated  # while the session still runs
    second = session.sample([4, 5, 6], num_samples=3, sampling=params)
    generated += sum(len(s.tokens) for s in second.sequences)
    session.close()
    assert counted() == generated  # the rest at its end; nothing counted twice
