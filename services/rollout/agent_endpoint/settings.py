"""Where the agent endpoint listens and the address its episodes are told (environment
variables OPENTINKER_AGENT_ENDPOINT_*).

By default it listens on 127.0.0.1, for agent programs that run in the rollout's process or
as its child processes. An agent in a container or on another machine needs the endpoint on
an address it can reach: bind another interface (``HOST=0.0.0.0`` for all of them) and say
which name or address the agents should use (``ADVERTISE_HOST``: the base URL an episode is
given). Every episode keeps its own API key, so a reachable endpoint still serves each
episode's calls only to the holder of that episode's key.
"""

from __future__ import annotations

import ipaddress

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from opentinker.errors import ConfigError
from opentinker.spec import validation_message

ENV_PREFIX = "OPENTINKER_AGENT_ENDPOINT_"


class EndpointSettings(BaseSettings):
    """The endpoint's bind address and advertised host."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="address the endpoint binds (0.0.0.0 or :: = every interface)",
    )
    advertise_host: str = Field(
        "",
        description="host name or address put in each episode's base_url; empty = host "
        "(required when host is a wildcard such as 0.0.0.0)",
    )

    @model_validator(mode="after")
    def _advertised(self) -> EndpointSettings:
        if not self.advertise_host and _wildcard(self.host):
            raise ValueError(
                f"host {self.host!r} listens on every interface, which is no address an agent "
                f"can call: set {ENV_PREFIX}ADVERTISE_HOST to this machine's name or address"
            )
        return self

    @property
    def url_host(self) -> str:
        """The host of every episode's base_url."""
        return self.advertise_host or self.host

    @classmethod
    def load(cls, **values: object) -> EndpointSettings:
        """From the environment with ``values`` on top; ConfigError naming the variable."""
        try:
            return cls(**values)  # type: ignore[arg-type]
        except ValidationError as err:
            raise ConfigError(
                f"agent endpoint settings ({ENV_PREFIX}*): {validation_message(err)}"
            ) from err


def _wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False
