"""Tinker gateway settings, read from OPENTINKER_GATEWAY_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    """Where the gateway listens, which scheduler it fronts, and the base models it names."""

    model_config = SettingsConfigDict(env_prefix="OPENTINKER_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 = any free port.")
    scheduler_address: str = Field("127.0.0.1:50051", min_length=1)
    # Tinker base-model names -> what the pool loads (a local directory or a hub id), e.g.
    # OPENTINKER_GATEWAY_BASE_MODELS='{"Qwen/Qwen3-8B": "/models/qwen3-8b"}'. Capabilities list
    # these names; any other base_model is passed to the pool as it is.
    base_models: dict[str, str] = Field(default_factory=dict)
    long_poll_s: float = Field(20.0, gt=0, description="A retrieve_future waits this long.")
    order_wait_s: float = Field(120.0, gt=0, description="A call waits this for its turn.")
    session_start_timeout_s: float = Field(
        600.0, gt=0, description="create_model waits this for a device and the model load."
    )
    call_timeout_s: float = Field(600.0, gt=0, description="Deadline of one trainer call.")
    session_expiry_s: float = Field(
        120.0, gt=0, description="A session silent this long (no heartbeat) is closed."
    )
    # The workers' shared checkpoint root (OPENTINKER_CHECKPOINT_ROOT): training checkpoints
    # are listed, deleted and downloaded from here. None: those calls are refused.
    checkpoint_root: Path | None = None
    # The key download URLs are signed with (made once, random, mode 0600); None =
    # <checkpoint_root>/.gateway-download-secret. Gateways sharing it honour each other's URLs.
    download_secret_file: Path | None = None
    max_body_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="A request body past this is refused 413 (the SDK sends ~5 MB chunks).",
    )
    key_cache_s: float = Field(
        2.0, ge=0, description="A checked API key is trusted this long (a revoked one too)."
    )
    unembed_lora: bool = Field(
        False,
        description="honour a LoRA config's train_unembed (LoRA on lm_head): the pool's engines "
        "must serve it (transformers does; vLLM takes no LoRA on Qwen2's lm_head). Off: "
        "train_unembed (the SDK's default) is not trained, and the run's user_metadata says so",
    )
    log_level: str = "INFO"
