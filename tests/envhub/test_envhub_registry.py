"""EnvHub's registry (unit): register, renew, expire, route, page; a hand-driven clock
instead of sleeping."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from opentinker.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from opentinker.services.envhub.registry import InMemoryRegistry, page
from opentinker.services.envhub.settings import EnvHubSettings

TOKEN = "t" * 43  # an env token (what an env server registers with)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_registry_register_renew_expire() -> None:
    clock = Clock()
    registry = InMemoryRegistry(ttl_s=10, clock=clock)
    a = registry.register("letter", "127.0.0.1:1", 4, env_token=TOKEN)
    b = registry.register("letter", "127.0.0.1:2", 4, env_token=TOKEN)
    builtin = registry.register("letter", "127.0.0.1:3", 4, pinned=True, env_token=TOKEN)
    clock.now += 8
    registry.renew(a.instance_id)
    clock.now += 8  # b missed its renewals for 16 s > ttl; a renewed 8 s ago
    assert {i.instance_id for i in registry.instances()} == {a.instance_id, builtin.instance_id}
    with pytest.raises(NotFoundError, match="register again"):
        registry.renew(b.instance_id)
    registry.deregister(a.instance_id)
    registry.deregister("unknown")  # harmless
    assert [i.instance_id for i in registry.instances()] == [builtin.instance_id]


@pytest.mark.unit
def test_registry_same_address_replaces_and_bad_registrations_are_refused() -> None:
    registry = InMemoryRegistry(ttl_s=10, clock=Clock())
    first = registry.register("letter", "127.0.0.1:1", 4, env_token=TOKEN)
    second = registry.register("letter", "127.0.0.1:1", 4, env_token=TOKEN)
    assert [i.instance_id for i in registry.instances()] == [second.instance_id]
    assert first.instance_id != second.instance_id
    with pytest.raises(InvalidArgumentError) as info:
        registry.register("bad name", "nowhere", -1, env_token="secret")
    for words in ("env_name", "address", "capacity", "env_token"):  # every problem at once
        assert words in str(info.value)
    assert "secret" not in str(info.value)  # a refused token is not quoted back
    assert TOKEN not in repr(second)  # nor is a kept one shown (logs, tracebacks)


@pytest.mark.unit
def test_registry_routes_to_least_loaded_with_room() -> None:
    registry = InMemoryRegistry(ttl_s=10, clock=Clock())
    small = registry.register("letter", "127.0.0.1:1", 1, env_token=TOKEN)
    big = registry.register("letter", "127.0.0.1:2", 3, env_token=TOKEN)
    picks = [registry.acquire("letter", tenant="").instance_id for _ in range(4)]
    assert sorted(picks) == sorted([small.instance_id] + [big.instance_id] * 3)
    with pytest.raises(ResourceExhaustedError, match="capacity"):
        registry.acquire("letter", tenant="")
    registry.release(small.instance_id)
    assert registry.acquire("letter", tenant="").instance_id == small.instance_id
    with pytest.raises(NotFoundError, match=r"'chess'.*registered: \['letter'\]"):
        registry.acquire("chess", tenant="")


@pytest.mark.unit
def test_a_tenants_own_env_shadows_a_shared_one_of_the_same_name_and_never_mixes() -> None:
    registry = InMemoryRegistry(ttl_s=10, clock=Clock())
    shared = registry.register("echo", "127.0.0.1:1", 0, shared=True, env_token=TOKEN)
    acme = registry.register("echo", "127.0.0.1:2", 0, tenant_id="acme", env_token=TOKEN)
    globex = registry.register("echo", "127.0.0.1:3", 0, tenant_id="globex", env_token=TOKEN)
    # Each tenant is routed to its own registration only; a tenant without one to the shared.
    assert {registry.acquire("echo", tenant="acme").instance_id for _ in range(5)} == {
        acme.instance_id
    }
    assert registry.routable("echo", tenant="globex") == [globex]
    assert registry.routable("echo", tenant="initech") == [shared]
    # An admin's episodes are routed by the admin's own tenant too, never into another's env.
    assert registry.routable("echo", tenant="system") == [shared]
    # Listing is wider than routing: an admin sees every registration.
    assert len(registry.instances("echo")) == 3


@pytest.mark.unit
def test_pagination_walks_every_instance_once() -> None:
    registry = InMemoryRegistry(ttl_s=10, clock=Clock())
    for n in range(7):
        registry.register(f"env{n % 3}", f"127.0.0.1:{n + 1}", 0, env_token=TOKEN)
    seen, token = [], ""
    while True:
        batch, token = page(registry.instances(), page_size=3, page_token=token)
        seen += [i.instance_id for i in batch]
        if not token:
            break
    assert seen == [i.instance_id for i in registry.instances()]
    with pytest.raises(InvalidArgumentError, match="page_token"):
        page(registry.instances(), page_size=3, page_token="garbage")


@pytest.mark.unit
def test_settings_are_checked_together() -> None:
    with pytest.raises(ValidationError) as info:
        EnvHubSettings(renew_interval_s=5, registration_ttl_s=5, builtin_envs=["chess"])
    assert "registration_ttl_s" in str(info.value) and "chess" in str(info.value)
    assert EnvHubSettings().port == 50052
