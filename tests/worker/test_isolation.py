"""Every RPC of the scheduler's services, called as every kind of caller: the right status
code, no data. EnvHub, trainer and rollout: test_isolation_services.py.

Callers: no key, a malformed key, a well-formed but unknown key, a revoked key, another tenant's
key, the owner's key, a job token, a worker token, an admin's key. Real servers, real Redis.
"""

import asyncio
import contextlib

import grpc
import pytest
from async_guard import run
from identity_helpers import api_key, worker_token
from isolation_helpers import DENIED, MALFORMED, NOT_FOUND, OK, UNAUTH, UNKNOWN, Call, outcome

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import (
    identity_pb2,
    identity_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.spec import JobSpec, RlConfig, to_proto

pytestmark = pytest.mark.integration


def scheduler_calls(job_id: str) -> dict[str, Call]:
    """One call of every method of the scheduler's three services."""

    def sched(ch: grpc.aio.Channel) -> scheduler_pb2_grpc.SchedulerServiceStub:
        return scheduler_pb2_grpc.SchedulerServiceStub(ch)

    def admin(ch: grpc.aio.Channel) -> identity_pb2_grpc.AdminServiceStub:
        return identity_pb2_grpc.AdminServiceStub(ch)

    async def watch(ch: grpc.aio.Channel) -> list[object]:
        call = sched(ch).WatchJob(scheduler_pb2.WatchJobRequest(job_id=job_id), timeout=5)
        return [await call.read()]

    async def connect(ch: grpc.aio.Channel) -> object:
        call = sched(ch).ConnectWorker(timeout=5)
        register = scheduler_pb2.RegisterWorker(worker_id="w-iso", hostname="h")
        # A refused caller may be turned away before its first message is read: the status
        # then comes with the read, whatever the write raced into.
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await call.write(scheduler_pb2.ConnectWorkerRequest(seq=1, register=register))
        first = await call.read()
        call.cancel()
        return first

    spec = to_proto(JobSpec(rl=RlConfig(env_name="letter", steps=1)))
    report = scheduler_pb2.ReportJobProgressRequest(
        job_id=job_id, attempt=1, log=common_pb2.LogLine(message="hi")
    )
    return {
        "SchedulerService/SubmitJob": lambda ch: sched(ch).SubmitJob(
            scheduler_pb2.SubmitJobRequest(spec=spec), timeout=5
        ),
        "SchedulerService/GetJob": lambda ch: sched(ch).GetJob(
            scheduler_pb2.GetJobRequest(job_id=job_id), timeout=5
        ),
        "SchedulerService/ListJobs": lambda ch: sched(ch).ListJobs(
            scheduler_pb2.ListJobsRequest(), timeout=5
        ),
        "SchedulerService/CancelJob": lambda ch: sched(ch).CancelJob(
            scheduler_pb2.CancelJobRequest(job_id=job_id, reason="iso"), timeout=5
        ),
        "SchedulerService/WatchJob": watch,
        "SchedulerService/ListWorkers": lambda ch: sched(ch).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5
        ),
        "SchedulerService/GetJobsProgress": lambda ch: sched(ch).GetJobsProgress(
            scheduler_pb2.GetJobsProgressRequest(job_ids=[job_id]), timeout=5
        ),
        "SchedulerService/GetUsage": lambda ch: sched(ch).GetUsage(
            scheduler_pb2.GetUsageRequest(), timeout=5
        ),
        "SchedulerService/ReportJobProgress": lambda ch: sched(ch).ReportJobProgress(
            report, timeout=5
        ),
        "SchedulerService/ConnectWorker": connect,
        "AdminService/CreateTenant": lambda ch: admin(ch).CreateTenant(
            identity_pb2.CreateTenantRequest(tenant_id="t-iso"), timeout=5
        ),
        "AdminService/ListTenants": lambda ch: admin(ch).ListTenants(
            identity_pb2.ListTenantsRequest(), timeout=5
        ),
        "AdminService/CreateUser": lambda ch: admin(ch).CreateUser(
            identity_pb2.CreateUserRequest(user_id="u-iso", tenant_id="acme"), timeout=5
        ),
        "AdminService/ListUsers": lambda ch: admin(ch).ListUsers(
            identity_pb2.ListUsersRequest(), timeout=5
        ),
        "AdminService/CreateApiKey": lambda ch: admin(ch).CreateApiKey(
            identity_pb2.CreateApiKeyRequest(user_id="alice"), timeout=5
        ),
        "AdminService/ListApiKeys": lambda ch: admin(ch).ListApiKeys(
            identity_pb2.ListApiKeysRequest(), timeout=5
        ),
        "AdminService/RevokeApiKey": lambda ch: admin(ch).RevokeApiKey(
            identity_pb2.RevokeApiKeyRequest(key_prefix="000000000000"), timeout=5
        ),
        "AdminService/CreateWorkerToken": lambda ch: admin(ch).CreateWorkerToken(
            identity_pb2.CreateWorkerTokenRequest(), timeout=5
        ),
        "AdminService/SetTenantQuota": lambda ch: admin(ch).SetTenantQuota(
            identity_pb2.SetTenantQuotaRequest(tenant_id="globex"), timeout=5
        ),
        "IdentityService/WhoAmI": lambda ch: identity_pb2_grpc.IdentityServiceStub(ch).WhoAmI(
            identity_pb2.WhoAmIRequest(), timeout=5
        ),
    }


USER_METHODS = {"SubmitJob", "GetJob", "ListJobs", "CancelJob", "WatchJob"}
ADMIN_METHODS = {m.name for m in identity_pb2.DESCRIPTOR.services_by_name["AdminService"].methods}


def expected_for_scheduler(caller: str, method: str) -> grpc.StatusCode | None:
    """The status code a caller must get from ``Service/Method`` of the scheduler."""
    service, name = method.split("/")
    if caller in ("none", "malformed", "unknown", "revoked"):
        return UNAUTH
    if name == "WhoAmI":
        return OK
    if service == "AdminService":
        if caller == "admin" and name == "RevokeApiKey":
            return NOT_FOUND  # admitted; the table's prefix names no key
        return OK if caller == "admin" else DENIED
    if name == "ReportJobProgress":
        return OK if caller == "job" else DENIED
    if name == "ConnectWorker":
        return OK if caller == "worker" else DENIED
    if caller in ("job", "worker"):
        return DENIED
    if caller == "other_tenant" and name in ("GetJob", "CancelJob", "WatchJob"):
        return NOT_FOUND  # another tenant's job is not said to exist
    return OK


def test_every_scheduler_rpc_admits_exactly_its_callers(redis_url: str) -> None:
    services = [
        identity_pb2.DESCRIPTOR.services_by_name["AdminService"],
        identity_pb2.DESCRIPTOR.services_by_name["IdentityService"],
        scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
    ]
    # Authenticate is open by design: it is tested on its own below.
    methods = {f"{s.name}/{m.name}" for s in services for m in s.methods} - {
        "IdentityService/Authenticate"
    }

    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            ids = running.stores.identity
            keys = {
                "none": "",
                "malformed": MALFORMED,
                "unknown": UNKNOWN,
                "owner": await api_key(ids, tenant="acme", user="alice"),
                "other_tenant": await api_key(ids, tenant="globex", user="bob"),
                "admin": await api_key(ids, tenant="system", user="root", admin=True),
                "worker": await worker_token(ids),
            }
            revoked = await api_key(ids, tenant="acme", user="carol")
            await ids.revoke(revoked.split("_")[1])
            keys["revoked"] = revoked
            async with aio_channel(running.address, credential=keys["owner"]) as owner:
                job = (
                    await scheduler_pb2_grpc.SchedulerServiceStub(owner).SubmitJob(
                        scheduler_pb2.SubmitJobRequest(
                            spec=to_proto(JobSpec(rl=RlConfig(env_name="letter", steps=1)))
                        ),
                        timeout=5,
                    )
                ).job
            keys["job"] = await ids.issue_job_token(
                job.job_id, 1, tenant_id="acme", user_id="alice"
            )
            calls = scheduler_calls(job.job_id)
            assert set(calls) == methods, "every method is called by the table"
            failures = []
            for caller, key in keys.items():
                async with aio_channel(running.address, credential=key) as channel:
                    for method, call in calls.items():
                        if method.endswith("CancelJob") and caller in ("owner", "admin"):
                            continue  # would end the job the other rows need; tested below
                        code, reply = await outcome(call, channel)
                        want = expected_for_scheduler(caller, method)
                        if code != want:
                            failures.append(f"{caller} -> {method}: got {code}, want {want}")
                        if caller == "other_tenant" and method.endswith("GetJobsProgress"):
                            assert reply is not None and job.job_id not in reply.last_step
                        if caller == "other_tenant" and method.endswith("ListJobs"):
                            # Only its own job (submitted a row above), never acme's.
                            assert reply is not None
                            assert {j.tenant_id for j in reply.jobs} == {"globex"}
            assert not failures, "\n".join(failures)
            # The owner (and only the owner's tenant or an admin) may cancel.
            async with aio_channel(running.address, credential=keys["owner"]) as channel:
                code, _ = await outcome(calls["SchedulerService/CancelJob"], channel)
                assert code is OK

    run(main, timeout_s=90)


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "busy"])
def test_a_watch_ends_unauthenticated_once_its_key_is_revoked(redis_url: str, busy: bool) -> None:
    """A key is checked when a call starts, and a WatchJob stream is one call that lasts as
    long as its job: revoking the key must end the watch too, even while no event comes
    (quiet), and while events come closer together than the heartbeat (busy: a job that
    reports all the time; before, only a quiet gap of a whole heartbeat let the check run)."""

    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0, heartbeat_interval_s=0.5)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            ids = running.stores.identity
            key = await api_key(ids, tenant="acme", user="dave")
            async with aio_channel(running.address, credential=key) as channel:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                request = scheduler_pb2.SubmitJobRequest(
                    spec=to_proto(JobSpec(rl=RlConfig(env_name="letter", steps=1)))
                )
                job = (await stub.SubmitJob(request, timeout=5)).job
                watch = stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job.job_id))
                first = await asyncio.wait_for(watch.read(), 5)  # QUEUED; then quiet (no worker)
                assert first.event.state_change.state == common_pb2.JOB_STATE_QUEUED

                async def chatter() -> None:  # a log line every 20 ms, as a busy job reports
                    while busy:
                        line = common_pb2.JobEvent(log=common_pb2.LogLine(message="step"))
                        await running.stores.events.append(job.job_id, line)
                        await asyncio.sleep(0.02)

                talking = asyncio.create_task(chatter())
                try:
                    if busy:  # the stream is busy before the key is revoked
                        await asyncio.wait_for(watch.read(), 5)
                    await ids.revoke(key.split("_")[1])
                    revoked_at = asyncio.get_running_loop().time()
                    with pytest.raises(grpc.aio.AioRpcError) as ended:
                        while asyncio.get_running_loop().time() - revoked_at < 3:
                            await asyncio.wait_for(watch.read(), 5)
                finally:
                    talking.cancel()
                assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "revoked" in (ended.value.details() or "")

    run(main)


def test_a_session_ends_when_the_key_that_opened_it_is_revoked(redis_url: str) -> None:
    """A session opened with a key that is then revoked must not keep its device until its
    idle timeout: the scheduler cancels it within about a heartbeat, its worker is told to
    stop it, and once it exited the device goes to the next job. A session opened with another
    key of the same tenant, and a managed job of the revoked key, go on."""
    from scheduler_helpers import get_job, scripted_worker, wait_for_state

    async def main() -> None:
        settings = SchedulerSettings(
            redis_url=redis_url, port=0, heartbeat_interval_s=0.2, lease_ttl_s=1.0
        )
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            ids = running.stores.identity
            key = await api_key(ids, tenant="acme", user="sam")
            other = await api_key(ids, tenant="acme", user="ann")
            worker = await worker_token(ids, worker_id="w-s")
            async with (
                aio_channel(running.address, credential=key) as sam_channel,
                aio_channel(running.address, credential=other) as ann_channel,
                aio_channel(running.address, credential=worker) as worker_channel,
            ):
                sam = scheduler_pb2_grpc.SchedulerServiceStub(sam_channel)
                ann = scheduler_pb2_grpc.SchedulerServiceStub(ann_channel)

                async def submit(stub, spec: JobSpec) -> common_pb2.Job:  # noqa: ANN001
                    request = scheduler_pb2.SubmitJobRequest(spec=to_proto(spec))
                    return (await stub.SubmitJob(request, timeout=5)).job

                session = await submit(sam, JobSpec(kind="session"))
                managed = await submit(sam, JobSpec(rl=RlConfig(env_name="letter", steps=1)))
                kept = await submit(ann, JobSpec(kind="session"))
                stub = scheduler_pb2_grpc.SchedulerServiceStub(worker_channel)
                async with scripted_worker(stub, "w-s", ["cpu:0"]) as w:
                    launch = (await w.next_command()).launch
                    assert launch.job.job_id == session.job_id
                    launched = scheduler_pb2.JobLaunched(job_id=session.job_id, attempt=1)
                    await w.send(launched=launched)
                    await wait_for_state(ann, session.job_id, common_pb2.JOB_STATE_RUNNING)
                    await ids.revoke(key.split("_")[1])
                    revoked_at = asyncio.get_running_loop().time()
                    stop = (await w.next_command(timeout_s=3.0)).stop
                    assert (stop.job_id, stop.attempt) == (session.job_id, 1)
                    assert asyncio.get_running_loop().time() - revoked_at < 2.0
                    ended = await get_job(ann, session.job_id)
                    assert ended.state == common_pb2.JOB_STATE_CANCELLED
                    assert "revoked" in ended.reason and key.split("_")[1] in ended.reason
                    exited = scheduler_pb2.JobExited(
                        job_id=session.job_id, attempt=1, exit_code=-15, reason="stopped"
                    )
                    await w.send(exited=exited)
                    # The device is free again: the next job in the queue is launched on it.
                    assert (await w.next_command()).launch.job.job_id == managed.job_id
                    for job_id in (managed.job_id, kept.job_id):
                        assert (await get_job(ann, job_id)).state != common_pb2.JOB_STATE_CANCELLED

    run(main, timeout_s=60)


def test_authenticate_answers_only_about_the_credential_it_is_given(
    redis_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            key = await api_key(running.stores.identity, tenant="acme", user="alice")
            async with aio_channel(running.address) as anonymous:
                stub = identity_pb2_grpc.IdentityServiceStub(anonymous)
                reply = await stub.Authenticate(
                    identity_pb2.AuthenticateRequest(credential=key), timeout=5
                )
                assert (reply.principal.tenant_id, reply.principal.user_id) == ("acme", "alice")
                for bad in (MALFORMED, UNKNOWN, key[:-1] + ("A" if key[-1] != "A" else "B")):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Authenticate(
                            identity_pb2.AuthenticateRequest(credential=bad), timeout=5
                        )
                    assert refused.value.code() == UNAUTH
            return key

    key = asyncio.run(main())
    out, err = capfd.readouterr()
    secret = key.split("_", 2)[2]
    assert secret not in out + err, "a key's secret reached a log line"
