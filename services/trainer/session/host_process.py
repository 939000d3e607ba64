"""A shared LoRA host process: one base model, many tenants' LoRA sessions, one gRPC server.

    python -m opentinker.services.trainer.session.host_process --base-model M \
        --device-ids D [D ...] --scheduler-address A --address-file F [--max-sessions N]
    (the worker's credential for it in OPENTINKER_HOST_CREDENTIAL)

The worker (worker/trainer_hosts.py) starts it on the device the ledger holds for the host and
hands it each session placed there with OpenHostedSession, a stream that lives as long as the
session. Each session runs as a session job in a trainer of its own would (run.py's
``run_session``: its sampler on its rollout, its reports to the scheduler under its own job
token, its endpoint) but joins the one ``SharedLoraHost`` instead of loading a model, and its
calls come to this process's one server (host_servicer.py), routed by session id.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import structlog

from opentinker.grpc_options import host_port
from opentinker.services.common.auth import AuthInterceptor, IdentityServiceAuthenticator
from opentinker.services.common.grpc_server import aio_channel, create_aio_server, mark_serving
from opentinker.services.common.launch import LaunchConfig, write_atomic
from opentinker.services.common.logging import configure_logging
from opentinker.services.modeling.placement import placement_here
from opentinker.services.trainer.reporter import SchedulerReporter
from opentinker.services.trainer.rollout_link.rollout_address import RolloutAddress
from opentinker.services.trainer.service import ACCESS_RULES, SERVICE_NAME
from opentinker.services.trainer.session.host import DEFAULT_MAX_SESSIONS, SharedLoraHost
from opentinker.services.trainer.session.host_servicer import HostAuthenticator, HostServicer
from opentinker.services.trainer.session.run import run_session
from opentinker.services.trainer.session.servicer import SessionServicer
from opentinker.services.trainer.session.training_session import TrainingSession
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.spec import from_proto
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

log = structlog.get_logger(__name__)
CREDENTIAL_ENV = "OPENTINKER_HOST_CREDENTIAL"


class _Registration:
    """A hosted session's place on the host's server; ``stop`` takes it off (run.py stops the
    server it was given when the session ends)."""

    def __init__(self, sessions: HostedSessions, job_id: str) -> None:
        self._sessions, self._job_id = sessions, job_id

    async def stop(self, grace: float | None = None) -> None:
        self._sessions.leave(self._job_id)


class HostedSessions:
    """The sessions on this host: their servicers (what the server routes to) and runs."""

    def __init__(
        self, host: SharedLoraHost, settings: TrainerSettings, auth: HostAuthenticator
    ) -> None:
        self.host, self.settings, self.auth = host, settings, auth
        self.servicers: dict[str, SessionServicer] = {}
        self.port = 0  # set once the server is bound

    def leave(self, job_id: str) -> None:
        self.servicers.pop(job_id, None)
        self.auth.revoke(job_id)

    async def hosted(
        self, request: trainer_pb2.OpenHostedSessionRequest
    ) -> AsyncIterator[trainer_pb2.OpenHostedSessionResponse]:
        """Run the handed-over session: a message once it serves, the last when it ended. A
        cancelled stream (the worker stopped the job) ends the session at once."""
        launch = LaunchConfig.read(Path(request.launch_path))
        file = Path(request.rollout_address_file) if request.rollout_address_file else None
        rollout = RolloutAddress.given(request.rollout_address, file)
        if rollout is None:
            raise ValueError("OpenHostedSession needs rollout_address or rollout_address_file")
        serving = asyncio.Event()
        run = asyncio.create_task(self._run(launch, rollout, serving))
        try:
            waiting = asyncio.create_task(serving.wait())
            await asyncio.wait({run, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if serving.is_set():
                endpoint = host_port(self.settings.host, self.port)
                yield self._message(endpoint=endpoint)
            code = await run
        finally:
            if not run.done():
                run.cancel()
                await asyncio.wait({run})
        yield self._message(ended=True, exit_code=code)

    def _message(self, **fields) -> trainer_pb2.OpenHostedSessionResponse:
        n = len(self.host.sessions)
        return trainer_pb2.OpenHostedSessionResponse(sessions_hosted=n, **fields)

    async def _run(
        self, launch: LaunchConfig, rollout: RolloutAddress, serving: asyncio.Event
    ) -> int:
        job = launch.job
        spec = from_proto(job.spec)

        async def serve(settings, session: TrainingSession, authenticator):
            self.auth.admit(launch.job_token, job_id=job.job_id, attempt=job.attempt)
            self.servicers[job.job_id] = SessionServicer(session)
            serving.set()
            return _Registration(self, job.job_id), self.port

        address = launch.scheduler_address
        try:
            async with aio_channel(address, credential=launch.job_token) as channel:
                reporter = SchedulerReporter(
                    channel,
                    address=address,
                    job_id=job.job_id,
                    attempt=job.attempt,
                    timeout_s=self.settings.report_timeout_s,
                    retry_for_s=self.settings.report_retry_s,
                )
                return await run_session(
                    launch, spec, rollout, self.settings, reporter, serve, host=self.host
                )
        finally:
            self.leave(job.job_id)
            await asyncio.to_thread(self.host.remove_session, job.job_id)


async def serve_host(
    base_model: str,
    *,
    settings: TrainerSettings,
    scheduler_address: str,
    credential: str,
    address_file: Path,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
) -> None:
    """Load the base, serve until cancelled (SIGTERM from the worker)."""
    host = await asyncio.to_thread(
        SharedLoraHost, base_model, device=settings.device or "cpu", max_sessions=max_sessions
    )
    async with aio_channel(scheduler_address) as identity_channel:
        identity = IdentityServiceAuthenticator(identity_channel, address=scheduler_address)
        auth = HostAuthenticator(credential, identity)
        sessions = HostedSessions(host, settings, auth)
        server, port, health = create_aio_server(
            [SERVICE_NAME],
            host=settings.host,
            port=settings.port,
            interceptors=[AuthInterceptor(auth, ACCESS_RULES)],
        )
        servicer = HostServicer(sessions.servicers, sessions, auth.worker)
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)
        await server.start()
        await mark_serving(health, [SERVICE_NAME])
        sessions.port = port
        write_atomic(address_file, host_port(settings.host, port))
        log.info("shared_lora_host_serving", base_model=base_model, port=port, pid=os.getpid())
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop(grace=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description="OpenTinker shared LoRA host (one base model)")
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--device-ids", nargs="+", required=True, help="the host's lease")
    parser.add_argument("--scheduler-address", required=True)
    parser.add_argument("--address-file", type=Path, required=True, help="where host:port goes")
    parser.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS)
    args = parser.parse_args()
    settings = TrainerSettings()
    configure_logging("trainer-host", level=settings.log_level)
    device = placement_here(args.device_ids, override=settings.device).device
    settings = settings.model_copy(update={"device": device})
    credential = os.environ.get(CREDENTIAL_ENV, "")

    async def run() -> None:
        task = asyncio.create_task(
            serve_host(
                args.base_model,
                settings=settings,
                scheduler_address=args.scheduler_address,
                credential=credential,
                address_file=args.address_file,
                max_sessions=args.max_sessions,
            )
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):  # SIGTERM: the worker ends it
            await task

    asyncio.run(run())


if __name__ == "__main__":
    main()
