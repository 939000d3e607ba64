"""EnvHub settings, read from OPENTINKER_* environment variables and validated at start-up."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from opentinker.services.envhub.builtin_envs import BUILTIN_GAMES, DEFAULT_BUILTIN_ENVS


class EnvHubSettings(BaseSettings):
    """Where EnvHub listens, how it keeps registrations and checks their health, and which
    built-in envs it hosts."""

    model_config = SettingsConfigDict(env_prefix="OPENTINKER_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(50052, ge=0, le=65535, description="0 = any free port.")
    address_file: str = Field(
        "",
        description="once serving, write host:port here (a launcher that starts it on port 0 "
        "learns the port it got; nothing is picked in advance for another process to take)",
    )
    renew_interval_s: float = Field(2.0, gt=0, description="Told to env servers on register.")
    registration_ttl_s: float = Field(10.0, gt=0, description="Missed renewals drop after this.")
    env_call_timeout_s: float = Field(10.0, gt=0, description="Deadline of every env call.")
    # Below the rollout's deadline on every EnvHub call (RolloutSettings.env_timeout_s, 15 s):
    # a rollout that gave up on a waiting Reset restarts the episode, and the abandoned Reset
    # would otherwise keep waiting (then take a slot nobody uses) while the new one queues too.
    capacity_wait_s: float = Field(
        10.0,
        ge=0,
        description="How long a Reset waits for a slot when every instance of its env is at "
        "capacity (jobs sharing an env queue for it) before failing RESOURCE_EXHAUSTED.",
    )
    env_return_grace_s: float = Field(
        5.0,
        ge=0,
        description="How long opening an env, or a Reset, waits for an env whose server died "
        "(dropped as dead, or its renewals stopped) to register again before failing "
        "NOT_FOUND naming the dead server's address and last error.",
    )
    max_observation_chars: int = Field(
        16384, ge=1, description="A longer env observation fails its episode (EpisodeFailed)."
    )
    max_observation_images: int = Field(
        4, ge=0, description="More images in one env observation fail its episode."
    )
    max_image_bytes: int = Field(
        1 << 20, ge=1, description="A larger image (encoded bytes) fails its episode."
    )
    health_check_interval_s: float = Field(
        2.0, ge=0, description="Seconds between gRPC health checks of env instances; 0 = none."
    )
    health_check_timeout_s: float = Field(1.0, gt=0, description="Deadline of one check.")
    unhealthy_after: int = Field(
        2, ge=1, description="Failed checks in a row that stop new episodes going to an instance."
    )
    builtin_envs: list[str] = Field(default_factory=lambda: list(DEFAULT_BUILTIN_ENVS))
    builtin_capacity: int = Field(256, ge=0, description="Episodes per built-in env; 0 = any.")
    scheduler_address: str = Field(
        "127.0.0.1:50051",
        min_length=1,
        description="The scheduler, whose IdentityService checks every caller's credential.",
    )
    credential_recheck_s: float = Field(
        2.0,
        gt=0,
        description="A stream (RunEpisodes) asks the scheduler again this often whether its "
        "caller's credential still holds, and ends UNAUTHENTICATED once it was revoked (or, a "
        "job token, its attempt ended); one IdentityService call per stream each time.",
    )
    log_level: str = "INFO"

    @model_validator(mode="after")
    def _check(self) -> EnvHubSettings:
        problems = []
        if self.registration_ttl_s <= self.renew_interval_s:
            problems.append(
                f"registration_ttl_s ({self.registration_ttl_s:g}) must exceed renew_interval_s "
                f"({self.renew_interval_s:g}), or every registration lapses between renewals"
            )
        unknown = sorted(set(self.builtin_envs) - set(BUILTIN_GAMES))
        if unknown:
            problems.append(
                f"builtin_envs names unknown environments {unknown}; known: {sorted(BUILTIN_GAMES)}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self
