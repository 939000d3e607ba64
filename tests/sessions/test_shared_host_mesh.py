"""Sessions share one trainer process per base model, end to end: the real mesh with ONE
device slot and the scheduler's shared_lora_sessions on. Two tenants' LoRA sessions run at once
in one host process (one endpoint, one pid), each with its own adapter; neither reaches the
other's session (NOT_FOUND); closing one leaves the other training; the host ends with its last
session and the device is free again; a host that dies re-queues its session with a reason
naming it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest

import opentinker
from opentinker import AdamParams, Datum
from opentinker.admin import AdminClient
from opentinker.connection import Connection
from opentinker.services.launcher.mesh import ADMIN_KEY_FILE, LocalMesh, MeshSettings
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DATA = [Datum(input_tokens=[5, 9, 17, 33], target_tokens=[9, 17, 33, 2])]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPENTINKER_SHARED_LORA_SESSIONS", "2")  # the scheduler's setting
        root = tmp_path_factory.mktemp("mesh")
        with LocalMesh(MeshSettings(run_root=root, cpu_slots=1, warm_spares=0)) as running:
            yield running


def hosts_root(mesh: LocalMesh) -> Path:
    return mesh.run_root / "jobs" / "hosts"


def host_pids(mesh: LocalMesh) -> dict[str, int]:
    """Each host folder's process id, of the hosts whose process is alive."""
    out = {}
    for folder in hosts_root(mesh).glob("host-*"):
        pid = int((folder / "host.pid").read_text())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        out[folder.name] = pid
    return out


def wait_for(predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def train_one_step(session) -> float:
    out = session.forward_backward(DATA)
    session.optim_step(AdamParams(learning_rate=1e-2))
    return out.loss


def test_two_tenants_share_one_host_process_on_one_device(mesh, letter_model_dir: Path) -> None:
    admin_key = (mesh.secrets_dir / ADMIN_KEY_FILE).read_text().strip()
    with AdminClient(mesh.scheduler_address, api_key=admin_key) as admin:
        admin.create_tenant("initech")
        admin.create_user("peter", tenant_id="initech")
        other_key = admin.create_api_key("peter", label="test")
    base = str(letter_model_dir)
    with (
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=60) as alice,
        opentinker.Client(mesh.scheduler_address, api_key=other_key, timeout=60) as bob,
    ):
        a = alice.training_session(base_model=base, lora_rank=4, wait_timeout=240)
        b_submitted = time.monotonic()
        b = bob.training_session(base_model=base, lora_rank=8, wait_timeout=240)
        # One device slot, both running, in ONE trainer process: one endpoint, one host pid
        assert a.endpoint == b.endpoint
        pids = host_pids(mesh)
        assert len(pids) == 1, pids
        [(host_id, pid)] = pids.items()
        for job_id in (a.job_id, b.job_id):
            attempt = mesh.run_root / "jobs" / job_id / "attempt-1"
            assert not (attempt / "trainer.pid").exists()  # no trainer process of its own
            assert (attempt / "trainer.addr").read_text().strip() == a.endpoint
        assert alice.usage()[0].devices_in_use == 1  # a share of the device, counted whole

        # Each trains its own adapter of its own rank
        info_a, info_b = a.get_info(), b.get_info()
        assert info_b.trainable_parameters == 2 * info_a.trainable_parameters
        loss_a, loss_b = train_one_step(a), train_one_step(b)
        assert a.get_info().step == 1 and b.get_info().step == 1
        assert loss_a > 0 and loss_b > 0

        # Neither tenant reaches the other's session on the shared endpoint: NOT_FOUND
        for key, other in ((other_key, a.job_id), (mesh.api_key, b.job_id)):
            channel = Connection(a.endpoint, api_key=key, timeout=10)
            stub = trainer_pb2_grpc.TrainerServiceStub(channel.channel)
            call = trainer_pb2.SessionCall(session_id=other, seq=1)
            for rpc, request in (
                (stub.GetSessionInfo, trainer_pb2.GetSessionInfoRequest(session_id=other)),
                (stub.CloseSession, trainer_pb2.CloseSessionRequest(call=call)),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    rpc(request, timeout=10)
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            # Nor hands the host a session of its own: only the worker that started it may
            handover = trainer_pb2.OpenHostedSessionRequest(launch_path="/etc/passwd")
            with pytest.raises(grpc.RpcError) as denied:
                list(stub.OpenHostedSession(handover, timeout=10))
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            channel.close()

        # Closing one leaves the other training on the same host
        a.close()
        job_a = wait_for(lambda: (j := alice.get_job(a.job_id)).done and j, "a to end")
        assert job_a.state == "SUCCEEDED" and job_a.reason == "closed", job_a
        train_one_step(b)
        assert b.get_info().step == 2
        assert host_pids(mesh) == {host_id: pid}

        # The host ends with its last session, and the device is free again
        b.close()
        wait_for(lambda: not host_pids(mesh), "the host process to end")
        wait_for(lambda: alice.usage()[0].devices_in_use == 0, "the device to be free")
        b_held_at_most_s = time.monotonic() - b_submitted
        job_b = bob.get_job(b.job_id)
        assert job_b.state == "SUCCEEDED", job_b
        usage_b = next(j.usage for j in bob.usage()[0].jobs if j.job_id == b.job_id)
        # Charged its share of the device's seconds: half (2 slots) of the time it held it
        assert 0 < usage_b.device_seconds <= 0.5 * b_held_at_most_s + 0.5, usage_b

        # A host that dies: its session is re-queued with a reason naming the host
        c = alice.training_session(base_model=base, lora_rank=4, wait_timeout=240)
        [(_, pid_c)] = host_pids(mesh).items()
        assert pid_c != pid  # a new host for the new first session
        os.kill(pid_c, signal.SIGKILL)
        requeued = None
        for event in alice.watch(c.job_id, timeout=120):
            if event.kind == "state" and event.state == "QUEUED" and "re-queued" in event.reason:
                requeued = event
                break
        assert requeued is not None
        assert "shared LoRA host" in requeued.reason, requeued.reason
        assert "lost the session" in requeued.reason, requeued.reason
        alice.cancel(c.job_id, reason="test over")
