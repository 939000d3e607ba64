"""The worker agent: one ConnectWorker stream to the scheduler, and the jobs it launches here.

Loop: connect → register devices → heartbeat every interval, launch/stop jobs as told, report
JobLaunched/JobExited → on a dropped stream stop every job (the scheduler re-queues them) and
reconnect with exponential backoff. ``run(stop)`` returns after ``stop`` is set, every job
stopped and reported, and the scheduler told that the worker is closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.errors import ConfigError
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.worker.devices import Device
from opentinker.services.worker.job_run import Exit, JobRun
from opentinker.services.worker.settings import WorkerSettings

log = structlog.get_logger(__name__)


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``event``; True if it is set. Not ``asyncio.wait_for``:
    before Python 3.12 it can swallow a cancellation, and a loop built on it never stops."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    return event.is_set()


class SchedulerLost(ConnectionError):
    """The stream to the scheduler ended or went silent."""


class WorkerAgent:
    def __init__(self, settings: WorkerSettings, devices: list[Device]) -> None:
        self.settings = settings
        self.devices = devices
        self.log = log.bind(worker_id=settings.worker_id, scheduler=settings.scheduler_address)
        self.connected = asyncio.Event()  # set while registered (tests wait on it)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve the scheduler until ``stop`` is set, reconnecting with backoff."""
        backoff = self.settings.reconnect_initial_s
        while not stop.is_set():
            try:
                connection = _Connection(self, stop)
            except ConfigError as err:  # e.g. the token file is not written yet: wait for it
                self.log.warning("no_worker_token", error=err.message, retry_in_s=backoff)
                await wait_event(stop, backoff)
                backoff = min(backoff * 2, self.settings.reconnect_max_s)
                continue
            try:
                await connection.serve()
                backoff = self.settings.reconnect_initial_s
            except Exception as err:  # any failure of the stream: drop it and reconnect
                self.log.warning("scheduler_unreachable", error=_describe(err), retry_in_s=backoff)
                if connection.registered:
                    backoff = self.settings.reconnect_initial_s
            finally:
                self.connected.clear()
                await connection.close()
            if stop.is_set():
                break
            await wait_event(stop, backoff)
            backoff = min(backoff * 2, self.settings.reconnect_max_s)


class _Connection:
    """One ConnectWorker stream and the jobs launched through it."""

    def __init__(self, agent: WorkerAgent, stop: asyncio.Event) -> None:
        self.agent = agent
        self.settings = agent.settings
        self.stop = stop
        self.registered = False
        self.channel = aio_channel(
            self.settings.scheduler_address, credential=self.settings.credential()
        )
        self.call: grpc.aio.StreamStreamCall = scheduler_pb2_grpc.SchedulerServiceStub(
            self.channel
        ).ConnectWorker()
        self.runs: dict[str, tuple[JobRun, asyncio.Task[None]]] = {}
        self._seq = 0
        self._write_lock = asyncio.Lock()
        self._heartbeat_interval_s = 1.0
        self._reporting = True  # False once the stream is being dropped: exits are not sent
        self._silence_limit_s = self.settings.connect_timeout_s

    async def send(self, **payload: object) -> None:
        async with self._write_lock:
            self._seq += 1
            message = scheduler_pb2.ConnectWorkerRequest(seq=self._seq, **payload)
            await asyncio.wait_for(
                self.call.write(message), timeout=self.settings.connect_timeout_s
            )

    async def serve(self) -> None:
        await self._register()
        heartbeats = asyncio.create_task(self._heartbeats())
        stop_wait = asyncio.create_task(self.stop.wait())
        try:
            while True:
                read = asyncio.create_task(self.call.read())
                done, _ = await asyncio.wait(
                    {read, stop_wait, heartbeats},
                    timeout=self._silence_limit_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if stop_wait in done:
                    # Not read.cancel(): cancelling a read cancels the whole call in grpc.aio,
                    # and the scheduler would never see our `closing`.
                    await self._close_gracefully(read)
                    return
                if heartbeats in done:
                    read.cancel()
                    raise SchedulerLost(
                        f"heartbeat failed: {_describe(heartbeats.exception() or SchedulerLost())}"
                    )
                if read not in done:
                    read.cancel()
                    raise SchedulerLost(
                        f"no message from the scheduler for {self._silence_limit_s:.0f} s"
                    )
                message = read.result()
                if message is grpc.aio.EOF:
                    raise SchedulerLost("the scheduler ended the stream")
                if not await self._handle(message):
                    return
        finally:
            heartbeats.cancel()
            stop_wait.cancel()

    async def _register(self) -> None:
        s = self.settings
        devices = [
            scheduler_pb2.Device(device_id=d.device_id, kind=d.kind, memory_bytes=d.memory_bytes)
            for d in self.agent.devices
        ]
        await self.send(
            register=scheduler_pb2.RegisterWorker(
                worker_id=s.worker_id, hostname=s.hostname, devices=devices
            )
        )
        first = await asyncio.wait_for(self.call.read(), timeout=s.connect_timeout_s)
        if first is grpc.aio.EOF or not first.HasField("registered"):
            raise SchedulerLost(f"the scheduler did not acknowledge registration: {first}")
        self._heartbeat_interval_s = first.registered.heartbeat_interval_s or 1.0
        # Silent for longer than a lease TTL means the scheduler has given up on us anyway.
        self._silence_limit_s = max(first.registered.lease_ttl_s, 2 * self._heartbeat_interval_s)
        self.registered = True
        self.agent.connected.set()
        self.agent.log.info("registered", devices=[d.device_id for d in self.agent.devices])

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval_s)
            await self.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))

    async def _handle(self, message: scheduler_pb2.ConnectWorkerResponse) -> bool:
        """Act on one scheduler message; False when the scheduler closes the session."""
        kind = message.WhichOneof("payload")
        if kind == "launch":
            self._launch(message.launch)
        elif kind == "stop":
            entry = self.runs.get(message.stop.job_id)
            if entry is None:
                self.agent.log.info("stop_for_unknown_job", job_id=message.stop.job_id)
            else:
                entry[0].stop(message.stop.reason or "stopped by the scheduler")
        elif kind == "closing":
            raise SchedulerLost(f"the scheduler closed the session: {message.closing.reason}")
        return True

    def _launch(self, launch: scheduler_pb2.LaunchJob) -> None:
        job = launch.job
        if job.job_id in self.runs:
            self.agent.log.warning("duplicate_launch", job_id=job.job_id)
            return

        async def launched() -> None:
            await self.send(
                launched=scheduler_pb2.JobLaunched(job_id=job.job_id, attempt=job.attempt)
            )

        run = JobRun(
            job,
            lease_id=launch.lease_id,
            device_ids=list(launch.device_ids),
            job_token=launch.job_token,
            settings=self.settings,
            on_launched=launched,
        )
        self.runs[job.job_id] = (run, asyncio.create_task(self._run_and_report(run)))

    async def _run_and_report(self, run: JobRun) -> None:
        try:
            outcome = await run.run()
        except Exception as err:  # a launch problem (bad command, disk full) fails the attempt
            run.log.exception("job_run_failed")
            outcome = Exit(-1, f"worker could not run the job: {err!r}")
        finally:
            self.runs.pop(run.job.job_id, None)
        run.log.info("job_exited", exit_code=outcome.exit_code, reason=outcome.reason)
        if not self._reporting:
            return  # the stream is being dropped: the scheduler re-queues the job itself
        with contextlib.suppress(Exception):
            await self.send(
                exited=scheduler_pb2.JobExited(
                    job_id=run.job.job_id,
                    attempt=run.job.attempt,
                    exit_code=outcome.exit_code,
                    reason=outcome.reason,
                )
            )

    async def stop_all_jobs(self, reason: str) -> None:
        entries = list(self.runs.values())
        for run, _ in entries:
            run.stop(reason)
        await asyncio.gather(*(task for _, task in entries), return_exceptions=True)

    async def _close_gracefully(self, pending_read: asyncio.Task[object]) -> None:
        """Tell the scheduler first, so it re-queues our jobs rather than failing them."""
        self._reporting = False
        with contextlib.suppress(Exception):
            await self.send(
                closing=scheduler_pb2.WorkerClosing(reason="worker agent shutting down")
            )
            await asyncio.wait_for(
                self.call.done_writing(), timeout=self.settings.connect_timeout_s
            )
            # Let the scheduler act on `closing` and end the stream before it is cancelled.
            await asyncio.wait_for(
                self._drain(pending_read), timeout=self.settings.connect_timeout_s
            )

    async def _drain(self, pending_read: asyncio.Task[object]) -> None:
        message = await pending_read
        while message is not grpc.aio.EOF:
            message = await self.call.read()

    async def close(self) -> None:
        """Drop the stream and stop every job launched through it: no process outlives it."""
        self._reporting = False
        self.call.cancel()
        await self.stop_all_jobs("lost connection to the scheduler")
        with contextlib.suppress(Exception):  # bounded: a stuck channel must not hold us
            await asyncio.wait_for(self.channel.close(), self.settings.connect_timeout_s)


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err) or type(err).__name__
