"""Settings of the rollout service (environment variables OPENTINKER_ROLLOUT_*)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from opentinker.grpc_options import SERVER_KEEPALIVE_S

# Sequences per transformers generate call: a GRPO batch of 16 prompts x 8 samples goes in one
# call (in two calls of 64 the demo generated in 0.064 s a step instead of 0.054:
# OPENTINKER_ROLLOUT_MAX_BATCH_SIZE=64 bench/vs_inprocess.py --staleness 0 --max-steps 300
# against the default).
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_ENVHUB_RECONNECT_S = 60.0


class RolloutSettings(BaseSettings):
    """Where the rollout listens, where EnvHub is, and how long it waits for environments."""

    model_config = SettingsConfigDict(env_prefix="OPENTINKER_ROLLOUT_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 = any free port")
    envhub_address: str = Field("", description="host:port of EnvHub")
    env_timeout_s: float = Field(15.0, gt=0, description="deadline of every wait on EnvHub")
    envhub_reconnect_s: float = Field(
        DEFAULT_ENVHUB_RECONNECT_S,
        gt=0,
        description="how long EnvHub may stay away (died, restarting) before a batch fails",
    )
    env_heartbeat_s: float = Field(
        5.0, ge=0, description="heartbeats on the EnvHub stream; 0 = none"
    )
    device: str = Field("", description='"cpu", "cuda", "cuda:1"; empty = CUDA when there is one')
    max_batch_size: int = Field(
        DEFAULT_MAX_BATCH_SIZE, ge=1, description="sequences per transformers generate call"
    )
    # Agent programs (RlConfig.agent) run a tenant's code (a callable it names, a command) in
    # the rollout, on the worker, as the worker's user: off unless the operator trusts every
    # tenant of the pool with that. A job naming one is refused otherwise.
    agent_programs: bool = False
    max_env_error_fraction: float = Field(
        0.5, ge=0, le=1, description="a batch with more ENV_ERROR episodes than this fails"
    )
    max_episode_retries: int = Field(
        2, ge=0, description="restarts of an episode whose env instance died (0 = none)"
    )
    max_observation_chars: int = Field(
        16384, ge=1, description="a longer env observation ends its episode with ENV_ERROR"
    )
    reset_ahead: bool = Field(
        True,
        description="reset the next training batch's episodes while the trainer trains on "
        "this one (batch_ahead.py)",
    )
    reset_ahead_probe_s: float = Field(
        300.0,
        gt=0,
        description="a batch reset ahead only in part (its env was at capacity) is tried "
        "whole again after this long, then twice as long each time it still does not fit, "
        "so env capacity registered later is used (batch_ahead.py)",
    )
    prefix_cache_mb: int = Field(
        256,
        ge=0,
        description="(transformers engine) keys and values a multi-turn job's episodes keep "
        "between their turns, so a turn computes only its new tokens (prefix_cache.py); 0 = off",
    )
    agent_loop: Literal["async", "lockstep"] = Field(
        "async",
        description="async: each episode generates again as soon as its env replied (engine "
        "calls re-batched from the ready episodes); lockstep: all generate, then all env steps",
    )
    batch_wait_s: float | None = Field(
        None,
        ge=0,
        description="(async) the longest ready episodes wait for others to join an engine "
        "call; unset = half the batch's mean engine call",
    )
    engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto",
        description="generation engine: auto = vLLM when the job holds CUDA devices and vllm "
        "is installed, else transformers (engine_choice.py)",
    )
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=0.95,
        description="(vLLM) share of the GPU's memory vLLM takes for weights and KV cache; the "
        "trainer shares the GPU on one node, so leave it room",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="(vLLM) GPUs one engine spans")
    vllm_enforce_eager: bool = Field(
        False, description="(vLLM) no CUDA graphs: starts seconds faster, decodes slower"
    )
    vllm_in_process: bool = Field(
        True,
        description="(vLLM, one GPU) run vLLM's engine in this process, so full-weight updates "
        "reach it by reference instead of serialised to its engine process",
    )
    vllm_seed_per_request: bool = Field(
        False,
        description="(vLLM) a seed per request (derived from the call's), so a row's sample "
        "depends on its seed alone; vLLM draws such rows one at a time (a kernel launch per "
        "row and token), unseeded ones together from the engine's generator (seeded 0)",
    )
    vllm_max_model_len: int = Field(
        0, ge=0, description="(vLLM) longest sequence (prompt + completion); 0 = the model's own"
    )
    trainer_keepalive_s: float = Field(
        SERVER_KEEPALIVE_S,
        ge=1,
        description="how often the rollout pings its trainer when the stream is silent; one "
        "that does not answer within half of it is lost: a private rollout then exits "
        "(exit_codes.PEER_LOST) and the worker ends the attempt as lost, killing the trainer",
    )
    log_level: str = "INFO"
    # Sent to EnvHub on every call, and the only credential the rollout admits: the job token
    # (from the launch file) when a worker starts it; an API key when started by hand.
    credential: str = Field(
        "",
        repr=False,
        validation_alias=AliasChoices(
            "credential", "OPENTINKER_ROLLOUT_CREDENTIAL", "OPENTINKER_API_KEY"
        ),
    )

    @classmethod
    def with_overrides(cls, **values: object) -> RolloutSettings:
        """Settings from the environment, with the values given here (None = not given) on top."""
        given = {key: value for key, value in values.items() if value is not None}
        return cls.model_validate(given)  # validated like the environment's values
