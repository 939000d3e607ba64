"""Dashboard settings, read from OPENTINKER_DASHBOARD_* variables and validated at start-up."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DashboardSettings(BaseSettings):
    """Where the dashboard listens and which scheduler and envhub it shows."""

    model_config = SettingsConfigDict(
        env_prefix="OPENTINKER_DASHBOARD_", extra="ignore", frozen=True
    )

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535, description="0 = any free port.")
    address_file: str = Field(
        "",
        description="once listening, write host:port here (a launcher that starts it on "
        "port 0 learns the port it got)",
    )
    scheduler_address: str = Field("127.0.0.1:50051", min_length=1)
    envhub_address: str = Field("127.0.0.1:50052", min_length=1)
    ca_file: str | None = Field(None, description="CA of a scheduler/envhub serving TLS.")
    call_timeout_s: float = Field(10.0, gt=0, description="Deadline of each API call.")
    stream_hold_s: float = Field(
        25.0,
        gt=0,
        description="Seconds one event-stream response stays open; the browser then resumes "
        "from the last event it has (Last-Event-ID), so no history is sent twice.",
    )
    max_event_streams: int = Field(
        200,
        ge=1,
        description="Job pages streaming events at once (a thread each while it waits for the "
        "next event); more wait for one to end. Other pages never wait for them.",
    )
    session_idle_s: float = Field(12 * 3600.0, gt=0, description="Sign-ins expire after this.")
    log_level: str = "INFO"
