"""Which environment servers are alive, and which one takes the next episode.

The registry is in memory on purpose: nothing in it must survive an EnvHub restart, because
every env server re-registers as soon as its renewal is answered NOT_FOUND. Registrations
that miss renewals for ``ttl_s`` are dropped (checked lazily on every access). Built-in
environments are registered ``pinned`` (hosted in-process, never expire). An instance marked
unhealthy (by ``health_watch``) stays listed but takes no new episodes.

Every instance carries the env token its server registered with (env_auth.py): EnvHub
presents it on each call to that instance's address, and nowhere else. It is kept out of
``repr`` and never returned or logged.
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from opentinker.env_auth import env_token_problem
from opentinker.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError

ENV_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+$")
MAX_PAGE_SIZE = 1000


@dataclass
class Instance:
    """One registered env server.

    capacity: concurrent episodes it accepts (0 = unlimited).
    active_episodes: episodes EnvHub has routed to it and not yet closed.
    registered_unix_s: wall-clock registration time; renewed_s: monotonic time of last renewal.
    healthy: False while its gRPC health checks fail; it then takes no new episodes.
    tenant_id: the tenant that registered it ("" for built-ins); shared: every tenant may use it.
    env_token: what EnvHub presents on its calls to it (secret: not in repr).
    """

    instance_id: str
    env_name: str
    address: str
    capacity: int
    registered_unix_s: float
    renewed_s: float
    active_episodes: int = 0
    pinned: bool = False
    healthy: bool = True
    tenant_id: str = ""
    shared: bool = False
    env_token: str = field(default="", repr=False)

    def visible_to(self, tenant: str | None) -> bool:
        """May ``tenant`` (None = an admin: every tenant) use this instance?"""
        return tenant is None or self.shared or self.tenant_id == tenant

    @property
    def has_room(self) -> bool:
        return self.capacity == 0 or self.active_episodes < self.capacity

    @property
    def load(self) -> float:
        return self.active_episodes / self.capacity if self.capacity else 0.0


class Registry(Protocol):
    """What EnvHub needs from a registry; ``InMemoryRegistry`` is the implementation.

    ``tenant`` arguments scope a call to what that tenant may see (its own instances and the
    shared ones); None is an admin's view (everything). An instance out of view is NOT_FOUND.
    """

    def register(
        self,
        env_name: str,
        address: str,
        capacity: int,
        *,
        env_token: str,
        pinned: bool = False,
        tenant_id: str = "",
        shared: bool = False,
    ) -> Instance: ...
    def renew(self, instance_id: str, *, tenant: str | None = None) -> None: ...
    def deregister(self, instance_id: str, *, tenant: str | None = None, why: str = "") -> None: ...
    def departed(self, env_name: str, *, tenant: str | None = None) -> Departure | None: ...
    def instances(
        self, env_name: str | None = None, *, tenant: str | None = None
    ) -> list[Instance]: ...
    def routable(self, env_name: str, *, tenant: str) -> list[Instance]: ...
    def acquire(self, env_name: str, *, tenant: str) -> Instance: ...
    def release(self, instance_id: str) -> None: ...
    def set_healthy(self, instance_id: str, healthy: bool) -> None: ...


@dataclass(frozen=True)
class Departure:
    """The last instance of an env that left without deregistering itself: where it served,
    why EnvHub dropped it (its last error), and when (wall clock, unix s)."""

    address: str
    why: str
    at_unix_s: float
    tenant_id: str
    shared: bool

    def visible_to(self, tenant: str | None) -> bool:
        return tenant is None or self.shared or self.tenant_id in ("", tenant)


def not_registered(registry: Registry, env_name: str, tenant: str) -> NotFoundError:
    """NOT_FOUND for an env with no instance: the dead server's address and last error when
    one left lately (the cause, not the consequence), else the names registered."""
    gone = registry.departed(env_name, tenant=tenant)
    if gone is not None:
        ago = max(0.0, time.time() - gone.at_unix_s)
        return NotFoundError(
            f"environment {env_name!r} has no live instance: its server at {gone.address} "
            f"died {ago:.0f} s ago ({gone.why}); restart the env server (it registers again)",
            reason="ENV_SERVER_DIED",
        )
    registered = sorted({i.env_name for i in registry.instances(tenant=tenant)})
    return NotFoundError(
        f"no environment named {env_name!r} is registered; registered: {registered}",
        reason="ENV_NOT_FOUND",
    )


class InMemoryRegistry:
    """Registrations in a dict. Not thread-safe: used from EnvHub's one event loop."""

    def __init__(self, *, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._by_id: dict[str, Instance] = {}
        self._departed: dict[str, Departure] = {}  # env name -> its last dead instance

    def register(
        self,
        env_name: str,
        address: str,
        capacity: int,
        *,
        env_token: str,
        pinned: bool = False,
        tenant_id: str = "",
        shared: bool = False,
    ) -> Instance:
        """Add an instance of ``tenant_id`` that EnvHub calls with ``env_token``; one it
        registered before at the same env name and address is replaced."""
        problems = []
        if not ENV_NAME_PATTERN.match(env_name):
            problems.append(f"env_name {env_name!r} must be letters, digits, '_', '.', '-'")
        if address.rpartition(":")[2].isdigit() is False or not address.rpartition(":")[0]:
            problems.append(f"address {address!r} must be host:port")
        if capacity < 0:
            problems.append(f"capacity {capacity} must be >= 0 (0 = unlimited)")
        if (token_problem := env_token_problem(env_token)) is not None:
            problems.append(
                f"{token_problem}; the server must refuse calls without it (see "
                "'Authentication' in environment.proto)"
            )
        if problems:
            raise InvalidArgumentError("; ".join(problems), reason="BAD_REGISTRATION")
        for old in self.instances(env_name):
            if old.address == address and old.tenant_id == tenant_id:
                del self._by_id[old.instance_id]
        self._departed.pop(env_name, None)
        instance = Instance(
            instance_id=uuid.uuid4().hex,
            env_name=env_name,
            address=address,
            capacity=capacity,
            registered_unix_s=time.time(),
            renewed_s=self._clock(),
            pinned=pinned,
            tenant_id=tenant_id,
            shared=shared,
            env_token=env_token,
        )
        self._by_id[instance.instance_id] = instance
        return instance

    def renew(self, instance_id: str, *, tenant: str | None = None) -> None:
        self._expire()
        instance = self._by_id.get(instance_id)
        if instance is None or not _owned_by(instance, tenant):
            raise NotFoundError(
                f"no registration {instance_id!r} (expired or EnvHub restarted); register again",
                reason="INSTANCE_NOT_FOUND",
            )
        instance.renewed_s = self._clock()

    def deregister(self, instance_id: str, *, tenant: str | None = None, why: str = "") -> None:
        """Drop an instance ``tenant`` owns; harmless for an unknown one. ``why``: EnvHub
        drops it as dead (its last error), kept for ``departed``."""
        instance = self._by_id.get(instance_id)
        if instance is not None and _owned_by(instance, tenant):
            del self._by_id[instance_id]
            if why:
                self._depart(instance, why)

    def departed(self, env_name: str, *, tenant: str | None = None) -> Departure | None:
        """The last instance of ``env_name`` that died (dropped by EnvHub, or its renewals
        stopped), while none has registered since."""
        self._expire()
        gone = self._departed.get(env_name)
        return gone if gone is not None and gone.visible_to(tenant) else None

    def _depart(self, instance: Instance, why: str) -> None:
        self._departed[instance.env_name] = Departure(
            instance.address, why, time.time(), instance.tenant_id, instance.shared
        )

    def instances(
        self, env_name: str | None = None, *, tenant: str | None = None
    ) -> list[Instance]:
        """Live instances (of one env, or all) that ``tenant`` may use, sorted by env name then
        instance id."""
        self._expire()
        found = [
            i
            for i in self._by_id.values()
            if (env_name is None or i.env_name == env_name) and i.visible_to(tenant)
        ]
        return sorted(found, key=lambda i: (i.env_name, i.instance_id))

    def routable(self, env_name: str, *, tenant: str) -> list[Instance]:
        """The instances an episode of ``tenant`` may be routed to: its own registrations of
        ``env_name`` when it has any (they shadow a shared env of the same name), else the
        shared ones. Never another tenant's, and never a mix — admins included."""
        named = [i for i in self.instances(env_name) if i.visible_to(tenant)]
        own = [i for i in named if i.tenant_id == tenant and not i.shared]
        return own or named

    def acquire(self, env_name: str, *, tenant: str) -> Instance:
        """Take a slot on the least-loaded healthy instance of ``env_name`` that has room."""
        candidates = self.routable(env_name, tenant=tenant)
        if not candidates:
            raise not_registered(self, env_name, tenant)
        healthy = [i for i in candidates if i.healthy]
        if not healthy:
            # RESOURCE_EXHAUSTED rather than UNAVAILABLE: the episode router maps only
            # NotFound / ResourceExhausted to a failed episode, and this too may pass.
            raise ResourceExhaustedError(
                f"all {len(candidates)} instances of environment {env_name!r} fail their health "
                f"checks ({', '.join(i.address for i in candidates)}); fix or restart them",
                reason="ENV_UNHEALTHY",
            )
        with_room = [i for i in healthy if i.has_room]
        if not with_room:
            unhealthy = len(candidates) - len(healthy)
            raise ResourceExhaustedError(
                f"all {len(healthy)} healthy instances of environment {env_name!r} are at "
                f"capacity ({unhealthy} more fail their health checks); close finished "
                "episodes or register more instances",
                reason="ENV_AT_CAPACITY",
            )
        chosen = min(with_room, key=lambda i: (i.load, i.active_episodes))
        chosen.active_episodes += 1
        return chosen

    def release(self, instance_id: str) -> None:
        """Give back a slot taken by ``acquire``; harmless for a dropped instance."""
        instance = self._by_id.get(instance_id)
        if instance is not None and instance.active_episodes > 0:
            instance.active_episodes -= 1

    def set_healthy(self, instance_id: str, healthy: bool) -> None:
        """Record the outcome of health checks; harmless for a dropped instance."""
        instance = self._by_id.get(instance_id)
        if instance is not None:
            instance.healthy = healthy

    def _expire(self) -> None:
        cutoff = self._clock() - self._ttl_s
        for instance in list(self._by_id.values()):
            if not instance.pinned and instance.renewed_s < cutoff:
                del self._by_id[instance.instance_id]
                self._depart(
                    instance, f"it stopped renewing its registration for {self._ttl_s:g} s"
                )


def page(
    instances: list[Instance], *, page_size: int, page_token: str
) -> tuple[list[Instance], str]:
    """One page of ``instances`` (sorted by env name, instance id) and the next page's token."""
    if page_size < 0:
        raise InvalidArgumentError(f"page_size {page_size} must be >= 0 (0 = default)")
    size = min(page_size or 100, MAX_PAGE_SIZE)
    after: tuple[str, str] = ("", "")
    if page_token:
        try:
            env_name, instance_id = json.loads(base64.urlsafe_b64decode(page_token))
            after = (str(env_name), str(instance_id))
        except ValueError as exc:
            raise InvalidArgumentError(
                "page_token is not one this EnvHub returned; pass next_page_token as is"
            ) from exc
    rest = [i for i in instances if (i.env_name, i.instance_id) > after]
    chosen = rest[:size]
    if len(rest) <= size:
        return chosen, ""
    last = chosen[-1]
    token = base64.urlsafe_b64encode(json.dumps([last.env_name, last.instance_id]).encode())
    return chosen, token.decode()


def _owned_by(instance: Instance, tenant: str | None) -> bool:
    """May ``tenant`` (None = an admin) renew or drop ``instance``?"""
    return tenant is None or instance.tenant_id == tenant
