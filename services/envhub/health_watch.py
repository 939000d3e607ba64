"""Active health checking of registered env instances (the standard grpc.health.v1 service).

Every ``interval_s`` EnvHub calls ``Health.Check`` (service "", the whole server) on every
registered instance that is not pinned (the built-ins run in EnvHub's own process), all at
once, each with a ``timeout_s`` deadline:

- SERVING: healthy (again, if it was not).
- NOT_SERVING, unreachable (UNAVAILABLE, DEADLINE_EXCEEDED) or any other error: a failed
  check; ``unhealthy_after`` failed checks in a row mark the instance unhealthy, and the
  registry routes no new episode to it. It stays registered (and listed) meanwhile.
- UNIMPLEMENTED: the server has no health service (an env server written in another language,
  say); it counts as healthy, and this is logged once per instance.

Episodes already on an unhealthy instance are left alone: if it is really dead their own calls
fail, and the rollout restarts them elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from opentinker.services.common.grpc_server import CHANNEL_OPTIONS
from opentinker.services.envhub.registry import Instance, Registry

log = structlog.get_logger("opentinker.envhub")

_SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class _Verdict:
    """The outcome of one Health.Check: ``problem`` is None when the server counts as healthy."""

    problem: str | None
    has_health_service: bool = True


@dataclass
class _Record:
    """What the watch remembers of one instance between rounds."""

    failed_checks: int = 0
    told_no_health_service: bool = False


class HealthWatch:
    """Checks instances' health in the background and records it in the registry.

    interval_s: seconds between the starts of two rounds (0 = never check).
    unhealthy_after: failed checks in a row that make an instance unhealthy (>= 1).
    timeout_s: deadline of one Health.Check call.
    """

    def __init__(
        self, registry: Registry, *, interval_s: float, unhealthy_after: int, timeout_s: float
    ) -> None:
        self._registry = registry
        self._interval_s = interval_s
        self._unhealthy_after = unhealthy_after
        self._timeout_s = timeout_s
        self._records: dict[str, _Record] = {}  # by instance id
        self._channels: dict[str, grpc.aio.Channel] = {}  # by address
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start checking in the running event loop (no-op when disabled or started)."""
        if self._interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="envhub-health-watch")

    async def stop(self) -> None:
        """Stop checking and close the health channels."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)

    async def check_all(self) -> None:
        """One round: check every non-pinned instance (each address once, all concurrently)."""
        instances = [i for i in self._registry.instances() if not i.pinned]
        addresses = sorted({i.address for i in instances})
        verdicts = await asyncio.gather(*map(self._probe, addresses))
        by_address = dict(zip(addresses, verdicts, strict=True))
        for instance in instances:
            self._record(instance, by_address[instance.address])
        live_ids = {i.instance_id for i in instances}
        self._records = {k: r for k, r in self._records.items() if k in live_ids}
        for address in set(self._channels) - set(addresses):
            await self._drop_channel(address)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - a bug in one round must not end the watch
                log.exception("health_round_failed")
            await asyncio.sleep(max(0.0, self._interval_s - (time.monotonic() - started)))

    async def _probe(self, address: str) -> _Verdict:
        stub = health_pb2_grpc.HealthStub(self._channel(address))
        request = health_pb2.HealthCheckRequest(service="")
        try:
            reply = await stub.Check(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return _Verdict(problem=None, has_health_service=False)
            # Dial afresh next round rather than wait out the channel's reconnect backoff.
            await self._drop_channel(address)
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return _Verdict(f"Health.Check did not answer within {self._timeout_s:g} s")
            return _Verdict(f"Health.Check failed: {err.code().name}: {err.details()}")
        if reply.status != _SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return _Verdict(f"Health.Check says {status}")
        return _Verdict(problem=None)

    def _record(self, instance: Instance, verdict: _Verdict) -> None:
        """Count the check and log (and record in the registry) a change of health."""
        record = self._records.setdefault(instance.instance_id, _Record())
        if not verdict.has_health_service and not record.told_no_health_service:
            record.told_no_health_service = True
            self._log(instance).info("instance_has_no_health_service_counted_healthy")
        if verdict.problem is None:
            record.failed_checks = 0
            if not instance.healthy:
                self._registry.set_healthy(instance.instance_id, True)
                self._log(instance).info("instance_healthy_again")
            return
        record.failed_checks += 1
        if instance.healthy and record.failed_checks >= self._unhealthy_after:
            self._registry.set_healthy(instance.instance_id, False)
            self._log(instance).warning(
                "instance_unhealthy", problem=verdict.problem, failed_checks=record.failed_checks
            )

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            # Its own subchannel, so that a fresh channel really dials again (gRPC otherwise
            # shares one connection, and its reconnect backoff, per address).
            options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            self._channels[address] = grpc.aio.insecure_channel(address, options=options)
        return self._channels[address]

    async def _drop_channel(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    @staticmethod
    def _log(instance: Instance) -> structlog.typing.FilteringBoundLogger:
        return log.bind(
            env=instance.env_name, address=instance.address, instance_id=instance.instance_id
        )
