"""EnvHub, the trainer and the rollout, called as every kind of caller: each admits exactly its
callers (a user's key for EnvHub, within its tenant; the job's own token for a job's trainer
and rollout), says why it refuses the others, and keeps known credentials while the scheduler
that vouches for them is away. Real servers, real Redis.
"""

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest
from async_guard import run
from identity_helpers import api_key
from isolation_helpers import DENIED, MALFORMED, NOT_FOUND, OK, UNAUTH, UNKNOWN, outcome

from opentinker.common.v1 import common_pb2
from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc
from opentinker.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from opentinker.services.common.auth import OwnCredentialAuthenticator
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.envhub.server import EnvHubDeps
from opentinker.services.envhub.server import create_server as create_envhub
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.service import create_server as create_rollout
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.services.trainer.rl.loop import TrainerStatus
from opentinker.services.trainer.service import create_server as create_trainer
from opentinker.services.trainer.settings import TrainerSettings

pytestmark = pytest.mark.integration


def test_envhub_rpcs_check_the_caller_and_keep_tenants_apart(identities) -> None:  # noqa: ANN001
    from opentinker.env_server import serve
    from opentinker.services.envhub.games.letter_env import LetterGame

    async def main() -> None:
        settings = EnvHubSettings(
            port=0, builtin_envs=["letter"], scheduler_address=identities.scheduler_address
        )
        deps = EnvHubDeps.create(settings)
        server, port = await create_envhub(settings, deps)
        address = f"127.0.0.1:{port}"
        private = await asyncio.to_thread(
            serve,
            LetterGame,
            name="acme-letters",
            envhub_address=address,
            api_key=identities.user_key,
            block=False,
        )
        try:
            await _check_envhub(address, identities)
        finally:
            await asyncio.to_thread(private.stop, 0.2)
            await server.stop(0)
            await deps.close()

    run(main, timeout_s=90)


async def _check_envhub(address: str, ids) -> None:  # noqa: ANN001
    def stub(ch: grpc.aio.Channel) -> envhub_pb2_grpc.EnvHubServiceStub:
        return envhub_pb2_grpc.EnvHubServiceStub(ch)

    async def names(key: str) -> set[str]:
        async with aio_channel(address, credential=key) as ch:
            reply = await stub(ch).ListEnvironments(envhub_pb2.ListEnvironmentsRequest(), timeout=5)
        return {i.env_name for i in reply.instances}

    async def open_episodes(key: str, env_name: str, job_id: str = "job-x") -> object:
        async with aio_channel(address, credential=key) as ch:
            call = stub(ch).RunEpisodes(timeout=5)
            open_ = envhub_pb2.OpenEpisodes(job_id=job_id, env_name=env_name)
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(envhub_pb2.RunEpisodesRequest(seq=1, open=open_))
            reply = await call.read()
            call.cancel()
            return reply

    # Private to acme; the built-in is shared with everyone.
    assert await names(ids.user_key) == {"acme-letters", "letter"}
    assert await names(ids.other_tenant_key) == {"letter"}
    assert await names(ids.admin_key) == {"acme-letters", "letter"}
    assert (await open_episodes(ids.user_key, "acme-letters")).HasField("opened")
    assert (await open_episodes(ids.other_tenant_key, "letter")).HasField("opened")
    with pytest.raises(grpc.aio.AioRpcError) as hidden:
        await open_episodes(ids.other_tenant_key, "acme-letters")
    assert hidden.value.code() == NOT_FOUND and "acme-letters" in hidden.value.details()
    # A job token runs episodes of its own job only, in its tenant.
    token = ids.job_token("job-9")
    assert (await open_episodes(token, "acme-letters", job_id="job-9")).HasField("opened")
    with pytest.raises(grpc.aio.AioRpcError) as other_job:
        await open_episodes(token, "acme-letters", job_id="job-1")
    assert other_job.value.code() == DENIED
    # No key, a bad key, a worker token: refused on every method.
    register = envhub_pb2.RegisterEnvironmentRequest(
        env_name="x", address="127.0.0.1:1", capacity=1
    )
    refusals = ((UNKNOWN, UNAUTH), (MALFORMED, UNAUTH), (ids.worker_token, DENIED), ("", UNAUTH))
    for key, want in refusals:
        async with aio_channel(address, credential=key) as ch:
            for call in (
                stub(ch).RegisterEnvironment(register, timeout=5),
                stub(ch).RenewRegistration(envhub_pb2.RenewRegistrationRequest(), timeout=5),
                stub(ch).DeregisterEnvironment(
                    envhub_pb2.DeregisterEnvironmentRequest(), timeout=5
                ),
                stub(ch).ListEnvironments(envhub_pb2.ListEnvironmentsRequest(), timeout=5),
            ):
                code, _ = await outcome(lambda _ch, c=call: c, ch)
                assert code == want, (key[:6], code)
        if key:
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                await open_episodes(key, "letter")
            assert streamed.value.code() == want
    # Sharing an env with every tenant is an admin's decision.
    shared = envhub_pb2.RegisterEnvironmentRequest(
        env_name="x", address="127.0.0.1:1", capacity=1, shared=True
    )
    async with aio_channel(address, credential=ids.user_key) as ch:
        code, _ = await outcome(lambda c: stub(c).RegisterEnvironment(shared, timeout=5), ch)
        assert code == DENIED
    # Another tenant cannot drop or renew acme's registration.
    async with aio_channel(address, credential=ids.admin_key) as ch:
        listed = await stub(ch).ListEnvironments(envhub_pb2.ListEnvironmentsRequest(), timeout=5)
    acme_id = next(i.instance_id for i in listed.instances if i.env_name == "acme-letters")
    async with aio_channel(address, credential=ids.other_tenant_key) as ch:
        code, _ = await outcome(
            lambda c: stub(c).RenewRegistration(
                envhub_pb2.RenewRegistrationRequest(instance_id=acme_id), timeout=5
            ),
            ch,
        )
        assert code == NOT_FOUND
        await stub(ch).DeregisterEnvironment(
            envhub_pb2.DeregisterEnvironmentRequest(instance_id=acme_id), timeout=5
        )
    assert "acme-letters" in await names(ids.user_key)


def test_trainer_and_rollout_admit_only_their_own_job_token(
    identities,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    token = identities.job_token("job-9")

    async def main() -> None:
        rollout_settings = RolloutSettings(envhub_address="127.0.0.1:1", credential=token)
        rollout, rollout_port = await create_rollout(rollout_settings, job_id="job-9", attempt=1)
        trainer, trainer_port = await create_trainer(
            TrainerSettings(),
            TrainerStatus(job_id="job-9", finetune="lora"),
            authenticator=OwnCredentialAuthenticator(token, job_id="job-9", attempt=1),
        )
        try:
            others = {
                "none": ("", UNAUTH),
                "unknown": (UNKNOWN, UNAUTH),
                "user of the same tenant": (identities.user_key, UNAUTH),
                "another job": (identities.job_token("job-1"), UNAUTH),
                "admin": (identities.admin_key, UNAUTH),
            }
            for who, (key, want) in others.items():
                async with aio_channel(f"127.0.0.1:{trainer_port}", credential=key) as ch:
                    code, _ = await outcome(lambda c: rollout_stub_or_trainer(c, "trainer"), ch)
                    assert code == want, f"trainer as {who}: {code}"
                async with aio_channel(f"127.0.0.1:{rollout_port}", credential=key) as ch:
                    code, _ = await outcome(lambda c: rollout_stub_or_trainer(c, "rollout"), ch)
                    assert code == want, f"rollout as {who}: {code}"
            async with aio_channel(f"127.0.0.1:{trainer_port}", credential=token) as ch:
                code, reply = await outcome(lambda c: rollout_stub_or_trainer(c, "trainer"), ch)
                assert code is OK and reply.job_id == "job-9"
        finally:
            await rollout.stop(0)
            await trainer.stop(0)

    run(main)


async def rollout_stub_or_trainer(channel: grpc.aio.Channel, which: str) -> object:
    from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

    if which == "trainer":
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        return await stub.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5)
    call = rollout_pb2_grpc.RolloutServiceStub(channel).Rollout(timeout=5)
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):  # refused early
        await call.write(rollout_pb2.RolloutRequest(seq=1, heartbeat=common_pb2.Heartbeat()))
    reply = await call.read()
    call.cancel()
    return reply


def test_envhub_keeps_known_credentials_while_the_scheduler_is_away(redis_url: str) -> None:
    """A scheduler restart must not fail running jobs at EnvHub: credentials the scheduler
    accepted recently still work while it cannot answer; new ones wait for it; a revoked key is
    refused as soon as it can answer again."""

    async def main() -> None:
        from opentinker.services.launcher.processes import free_port

        port = free_port()
        settings = SchedulerSettings(redis_url=redis_url, port=port)
        hub_settings = EnvHubSettings(
            port=0, builtin_envs=["letter"], scheduler_address=f"127.0.0.1:{port}"
        )
        deps = EnvHubDeps.create(hub_settings)
        hub, hub_port = await create_envhub(hub_settings, deps)
        address = f"127.0.0.1:{hub_port}"

        async def listing(key: str) -> grpc.StatusCode | None:
            async with aio_channel(address, credential=key) as ch:
                stub = envhub_pb2_grpc.EnvHubServiceStub(ch)
                code, _ = await outcome(
                    lambda _c: stub.ListEnvironments(envhub_pb2.ListEnvironmentsRequest()), ch
                )
                return code

        try:
            async with running_scheduler(settings, stop_grace_s=0.2) as running:
                known = await api_key(running.stores.identity, tenant="acme", user="alice")
                unseen = await api_key(running.stores.identity, tenant="acme", user="carol")
                assert await listing(known) is OK
            # The scheduler is gone.
            assert await listing(known) is OK
            assert await listing(unseen) == grpc.StatusCode.UNAVAILABLE
            async with running_scheduler(settings, stop_grace_s=0.2) as running:
                await running.stores.identity.revoke(known.split("_")[1])
                for _ in range(100):  # until EnvHub's channel has reconnected (gRPC backoff)
                    if await listing(unseen) is OK:
                        break
                    await asyncio.sleep(0.1)
                assert await listing(unseen) is OK
                assert await listing(known) == UNAUTH
        finally:
            await hub.stop(0)
            await deps.close()

    run(main, timeout_s=60)


def test_a_revoked_key_or_an_ended_attempt_ends_its_envhub_stream(redis_url: str) -> None:
    """A credential is checked when a call starts, and a RunEpisodes stream lasts as long as its
    job: revoking the key that opened it, or ending the attempt whose job token opened it, must
    end it too (UNAUTHENTICATED, within EnvHub's credential_recheck_s), even while it is busy
    with new episodes. Before, such a stream served new episodes for good."""
    from opentinker.envhub.v1 import environment_pb2

    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            ids = running.stores.identity
            key = await api_key(ids, tenant="acme", user="erin")
            token = await ids.issue_job_token("job-r", 1, tenant_id="acme", user_id="erin")
            hub_settings = EnvHubSettings(
                port=0,
                builtin_envs=["letter"],
                scheduler_address=running.address,
                credential_recheck_s=0.3,
            )
            deps = EnvHubDeps.create(hub_settings)
            hub, hub_port = await create_envhub(hub_settings, deps)
            try:
                cases = [
                    (key, "job-u", lambda: ids.revoke(key.split("_")[1])),
                    (token, "job-r", lambda: ids.revoke_job_tokens("job-r")),
                ]
                for credential, job_id, revoke in cases:
                    async with aio_channel(f"127.0.0.1:{hub_port}", credential=credential) as ch:
                        call = envhub_pb2_grpc.EnvHubServiceStub(ch).RunEpisodes(timeout=30)
                        code, details = await _busy_until_cut_off(
                            call, job_id, revoke, environment_pb2
                        )
                    assert code == UNAUTH, (code, details)
                    assert "revoked" in details
            finally:
                await hub.stop(0)
                await deps.close()

    run(main, timeout_s=60)


async def _busy_until_cut_off(  # noqa: ANN001
    call, job_id: str, revoke, environment_pb2
) -> tuple[grpc.StatusCode, str]:
    """Open the stream, reset episodes back to back, revoke after the first: the status that
    ends the stream (within 3 s of the revocation)."""
    open_ = envhub_pb2.OpenEpisodes(job_id=job_id, env_name="letter")
    await call.write(envhub_pb2.RunEpisodesRequest(seq=1, open=open_))
    assert (await asyncio.wait_for(call.read(), 5)).HasField("opened")
    revoked_at = 0.0
    for n in range(1000):
        reset = environment_pb2.ResetRequest(episode_id=f"ep-{n}", seed=n)
        try:
            await call.write(envhub_pb2.RunEpisodesRequest(seq=n + 2, reset=reset))
            reply = await asyncio.wait_for(call.read(), 5)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            break  # the stream ended: its status follows
        assert reply.HasField("reset"), reply  # a new episode served
        if n == 0:
            await revoke()
            revoked_at = asyncio.get_running_loop().time()
        assert asyncio.get_running_loop().time() - revoked_at < 3, "still served 3 s after"
        await asyncio.sleep(0.05)
    return await call.code(), await call.details()
