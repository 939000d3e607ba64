"""The worker agent: one ConnectWorker stream to the scheduler, and the jobs it launches here.

Loop: connect → register devices and announce what it still holds → heartbeat every interval,
launch/stop jobs as told, report JobLaunched/JobExited → on a dropped stream reconnect with
exponential backoff, keeping its jobs running (held.py). The scheduler adopts what it still owns
and says stop for the rest. Jobs are stopped only when the scheduler says so, when the agent
stops, or when no scheduler could be reached for ``orphan_grace_s`` (by then it has re-queued
them). A scheduler that answers that Redis lost its state (STATE_LOST) has re-queued nothing:
each such answer restarts that clock, so the jobs run on (and write their checkpoints) until an
operator restores Redis's data (the scheduler adopts them on re-registration) or re-bootstraps
(the scheduler, knowing no such job, says stop). ``run(stop)`` returns after ``stop`` is set,
every job stopped, and then the scheduler told that the worker is closing with its processes
gone (so it frees their devices at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.errors import STATE_LOST_REASON, ConfigError, from_rpc_error
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.common.waiting import wait_event
from opentinker.services.worker.device_handover import Holders, holders_of, run_when_free
from opentinker.services.worker.devices import (
    Device,
    cpu_share_of,
    cpu_share_path,
    cpu_thread_env,
    publish_cpu_share,
)
from opentinker.services.worker.held import HeldAttempts, HeldRun
from opentinker.services.worker.job_run import Exit, JobRun
from opentinker.services.worker.job_user import JobUsers
from opentinker.services.worker.rendezvous import rendezvous_env
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.shared_rollouts import SharedRollouts
from opentinker.services.worker.spares import SparePool
from opentinker.services.worker.trainer_hosts import TrainerHosts

log = structlog.get_logger(__name__)


class SchedulerLost(ConnectionError):
    """The stream to the scheduler ended or went silent."""


class WorkerAgent:
    def __init__(self, settings: WorkerSettings, devices: list[Device]) -> None:
        self.settings = settings
        self.devices = devices
        self.log = log.bind(worker_id=settings.worker_id, scheduler=settings.scheduler_address)
        self.connected = asyncio.Event()  # set while registered (tests wait on it)
        self.held = HeldAttempts(retention_s=settings.orphan_grace_s)
        self._connection: _Connection | None = None  # the registered stream, if any
        self._lost_since: float | None = None  # monotonic; set while jobs wait for a scheduler
        self._flush_lock = asyncio.Lock()
        self._stopping = False
        # Job processes' share of the CPU: (cores - reserved) // jobs running now, re-published
        # on each launch and exit (cpu_share.py).
        self._cpu_share = cpu_share_of(
            devices, cpu_share_path(settings), reserved=settings.cpu_cores_reserved
        )
        self._thread_env = cpu_thread_env(devices, self._cpu_share)
        # Jobs under uids of their own (job_user.py) take no spare and no shared rollout: those
        # run as the agent.
        self.job_users = JobUsers(*settings.job_uids)
        own_uid = not self.job_users.enabled
        self.spares = (
            SparePool(settings, self._thread_env) if settings.warm_spares > 0 and own_uid else None
        )
        self.trainer_hosts = TrainerHosts(settings)  # used for sessions the scheduler hosts
        self.shared_rollouts = (
            SharedRollouts(settings, {**os.environ, "PYTHONUNBUFFERED": "1", **self._thread_env})
            if settings.shared_lora_capacity > 0 and own_uid
            else None
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Serve the scheduler until ``stop`` is set, reconnecting with backoff."""
        watchdog = asyncio.create_task(self._stop_orphans(stop))
        spares = asyncio.create_task(self.spares.maintain(stop)) if self.spares else None
        backoff = self.settings.reconnect_initial_s
        try:
            while not stop.is_set():
                try:
                    connection = _Connection(self, stop)
                except ConfigError as err:  # e.g. the token file is not written yet: wait
                    self.log.warning("no_worker_token", error=err.message, retry_in_s=backoff)
                    await wait_event(stop, backoff)
                    backoff = min(backoff * 2, self.settings.reconnect_max_s)
                    continue
                try:
                    await connection.serve()
                    backoff = self.settings.reconnect_initial_s
                except Exception as err:  # any failure of the stream: drop it and reconnect
                    self.log.warning(
                        "scheduler_unreachable", error=_describe(err), retry_in_s=backoff
                    )
                    if _state_lost(err) and self._lost_since is not None:
                        # Nothing re-queued our jobs: keep them until restore or re-bootstrap.
                        self._lost_since = time.monotonic()
                        self.log.error(
                            "scheduler_state_lost_jobs_kept",
                            jobs=len(self.held.runs),
                            hint="an operator restores Redis's data or re-bootstraps",
                        )
                    if connection.registered:
                        backoff = self.settings.reconnect_initial_s
                finally:
                    await self._drop(connection)
                if stop.is_set():
                    break
                await wait_event(stop, backoff)
                backoff = min(backoff * 2, self.settings.reconnect_max_s)
        finally:
            watchdog.cancel()
            self._stopping = True  # the scheduler re-queues our jobs: their exits are not sent
            await self.stop_jobs(list(self.held.runs.values()), "worker agent shutting down")
            if spares is not None and self.spares is not None:
                spares.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await spares
                await self.spares.close()
            if self.shared_rollouts is not None:
                await self.shared_rollouts.close()
            await self.trainer_hosts.close()

    async def _drop(self, connection: _Connection) -> None:
        if self._connection is connection:
            self._connection = None
            self.connected.clear()
            self._lost_since = time.monotonic()
            if self.held.runs:
                self.log.warning("jobs_kept_while_reconnecting", jobs=len(self.held.runs))
        await connection.close()

    def registered(self, connection: _Connection) -> None:
        self._connection = connection
        self._lost_since = None
        self.connected.set()

    async def _stop_orphans(self, stop: asyncio.Event) -> None:
        """No scheduler for ``orphan_grace_s``: it has re-queued our jobs, so stop them."""
        grace = self.settings.orphan_grace_s
        while not await wait_event(stop, min(1.0, grace / 4)):
            lost = self._lost_since
            if lost is None or time.monotonic() - lost < grace:
                continue
            orphans = [held for held in self.held.runs.values() if not held.orphaned]
            if orphans:
                self.log.warning("orphaned_jobs_stopped", jobs=len(orphans), grace_s=grace)
                for held in orphans:
                    held.orphaned = True
                    held.run.stop(f"no scheduler reachable for {grace:.0f} s")

    def launch(self, launch: scheduler_pb2.LaunchJob) -> None:
        job = launch.job
        key = (job.job_id, job.attempt)
        if self._stopping:  # the `closing` that follows re-queues the job
            self.log.warning("launch_refused_while_stopping", job_id=job.job_id)
            return
        if key in self.held.runs:
            self.log.warning("duplicate_launch", job_id=job.job_id, attempt=job.attempt)
            return
        run = JobRun(
            job,
            lease_id=launch.lease_id,
            device_ids=list(launch.device_ids),
            job_token=launch.job_token,
            settings=self.settings,
            on_launched=lambda: self._launched(key),
            spares=self.spares,
            extra_env={
                **self._thread_env,
                **rendezvous_env(
                    launch, local_host=self.settings.rendezvous_host or self.settings.hostname
                ),
            },
            shared=self.shared_rollouts,
            user=self.job_users.take(key),
            hosted=(self.trainer_hosts, launch),
        )
        holders = holders_of(run, self.held.runs, self.shared_rollouts)  # e.g. still stopping
        task = asyncio.create_task(self._run_and_report(key, run, holders))
        self.held.runs[key] = HeldRun(run, task)
        self._share_cpu()

    def _share_cpu(self) -> None:
        if self._cpu_share is not None:
            publish_cpu_share(self._cpu_share, len(self.held.runs), self.log)

    async def _launched(self, key: tuple[str, int]) -> None:
        held = self.held.runs.get(key)
        if held is not None:
            held.launched = True
        # Unsent (no stream now), the next registration announces it as launched
        await self.send_if_connected(
            launched=scheduler_pb2.JobLaunched(job_id=key[0], attempt=key[1])
        )

    async def send_if_connected(self, **payload: Any) -> None:
        connection = self._connection
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.send(**payload)

    async def _run_and_report(self, key: tuple[str, int], run: JobRun, holders: Holders) -> None:
        try:
            outcome = await run_when_free(run, holders, say=self.send_if_connected)
        except Exception as err:  # a launch problem (bad command, disk full) fails the attempt
            run.log.exception("job_run_failed")
            outcome = Exit(-1, f"worker could not run the job: {err!r}")
        held = self.held.runs.pop(key)
        self.job_users.give_back(key)
        self._share_cpu()
        run.log.info("job_exited", exit_code=outcome.exit_code, reason=outcome.reason)
        if held.orphaned or self._stopping:
            return  # the scheduler re-queues the job itself
        self.held.record_exit(key, held, outcome)
        await self.flush_exits()

    async def flush_exits(self) -> None:
        """Send every exit not yet sent on the current stream (kept if it breaks)."""
        async with self._flush_lock:
            connection = self._connection
            for (job_id, attempt), pending in self.held.unsent():
                if connection is None:
                    return
                exited = scheduler_pb2.JobExited(
                    job_id=job_id,
                    attempt=attempt,
                    exit_code=pending.exit.exit_code,
                    reason=pending.exit.reason,
                )
                try:
                    await connection.send(exited=exited)
                except Exception:  # the stream broke: the next registration sends it
                    return
                pending.sent_at = time.monotonic()

    def stop_attempts(self, stop: scheduler_pb2.StopJob) -> None:
        matching = self.held.matching(stop.job_id, stop.attempt)
        if not matching:
            self.log.info("stop_for_unknown_job", job_id=stop.job_id, attempt=stop.attempt)
        for held in matching:
            held.run.stop(stop.reason or "stopped by the scheduler")

    async def stop_jobs(self, runs: list[HeldRun], reason: str) -> None:
        for held in runs:
            held.run.stop(reason)
        await asyncio.gather(*(held.task for held in runs), return_exceptions=True)

    async def stop_before_closing(self) -> bool:
        """Stop every job, their exits unreported (the scheduler re-queues the jobs, it does
        not fail them); True when no job process is left. No launch starts from now on."""
        self._stopping = True
        runs = list(self.held.runs.values())
        started = time.monotonic()
        await self.stop_jobs(runs, "worker agent shutting down")
        stopped = not self.held.runs
        self.log.info(
            "jobs_stopped_before_closing",
            jobs=[f"{h.run.job.job_id}#{h.run.job.attempt}" for h in runs],
            stopped_s=round(time.monotonic() - started, 3),
            all_exited=stopped,
        )
        return stopped


class _Connection:
    """One ConnectWorker stream."""

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
        self._seq = 0
        self._write_lock = asyncio.Lock()
        self._heartbeat_interval_s = 1.0
        self._silence_limit_s = self.settings.connect_timeout_s

    async def send(self, **payload: Any) -> None:
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
        exits = asyncio.create_task(self.agent.flush_exits())
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
                self._handle(message)
        finally:
            heartbeats.cancel()
            stop_wait.cancel()
            exits.cancel()

    async def _register(self) -> None:
        s = self.settings
        devices = [
            scheduler_pb2.Device(device_id=d.device_id, kind=d.kind, memory_bytes=d.memory_bytes)
            for d in self.agent.devices
        ]
        held = self.agent.held.announce()
        await self.send(
            register=scheduler_pb2.RegisterWorker(
                worker_id=s.worker_id,
                hostname=s.hostname,
                devices=devices,
                held=held,
                rendezvous_host=s.rendezvous_host,
                rendezvous_port_base=s.rendezvous_ports[0],
                rendezvous_port_count=s.rendezvous_ports[1],
            )
        )
        first = await asyncio.wait_for(self.call.read(), timeout=s.connect_timeout_s)
        if first is grpc.aio.EOF or not first.HasField("registered"):
            raise SchedulerLost(f"the scheduler did not acknowledge registration: {first}")
        self._heartbeat_interval_s = first.registered.heartbeat_interval_s or 1.0
        # Silent for longer than a lease TTL means the scheduler has given up on us anyway.
        self._silence_limit_s = max(first.registered.lease_ttl_s, 2 * self._heartbeat_interval_s)
        self.registered = True
        self.agent.registered(self)
        self.agent.log.info(
            "registered",
            devices=[d.device_id for d in self.agent.devices],
            held=[f"{h.job_id}#{h.attempt}{' exited' if h.exited else ''}" for h in held],
        )

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval_s)
            await self.send(heartbeat=common_pb2.Heartbeat(time_unix_s=time.time()))

    def _handle(self, message: scheduler_pb2.ConnectWorkerResponse) -> None:
        """Act on one scheduler message."""
        kind = message.WhichOneof("payload")
        if kind == "launch":
            self.agent.launch(message.launch)
        elif kind == "stop":
            self.agent.stop_attempts(message.stop)
        elif kind == "closing":
            # Restarting, most likely: keep the jobs running and reconnect.
            raise SchedulerLost(f"the scheduler closed the session: {message.closing.reason}")

    async def _close_gracefully(self, pending_read: asyncio.Task[object]) -> None:
        """Stop our jobs, then say `closing` (so the scheduler re-queues them rather than
        failing them) and that their processes exited (so it frees their devices at once, with
        no drain). Heartbeats go on while they stop; messages are not read: a launch that comes
        meanwhile is never started, and the re-queue covers its job."""
        stopped = await self.agent.stop_before_closing()
        with contextlib.suppress(Exception):
            closing = scheduler_pb2.WorkerClosing(
                reason="stopped by its operator", jobs_stopped=stopped
            )
            await self.send(closing=closing)
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
        """Drop the stream; the jobs launched through it keep running."""
        self.call.cancel()
        with contextlib.suppress(Exception):  # bounded: a stuck channel must not hold us
            await asyncio.wait_for(self.channel.close(), self.settings.connect_timeout_s)


def _state_lost(err: BaseException) -> bool:
    """The scheduler refused us because Redis lost its state (scheduler/lost_state.py)."""
    return isinstance(err, grpc.aio.AioRpcError) and from_rpc_error(err).reason == STATE_LOST_REASON


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err) or type(err).__name__
