"""OpenTinker: agentic reinforcement learning as a service.

Everything a researcher needs on a machine without a GPU: the client of the scheduler, job
specs, the environment authoring API, and the generated protocol stubs
(``opentinker.<service>.v1``). Importing this package never imports torch.
"""

from opentinker.catalog import ModelInfo
from opentinker.client import Client
from opentinker.env_server import EnvServerHandle, serve
from opentinker.errors import (
    AuthenticationError,
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    JobFailedError,
    NotFoundError,
    OpenTinkerError,
    ResourceExhaustedError,
    UnavailableError,
)
from opentinker.game import AbstractGame, Role, StepResult, Tool
from opentinker.jobs import JobEvent, JobInfo
from opentinker.session_config import SessionConfig
from opentinker.spec import (
    InferenceConfig,
    JobSpec,
    LoraConfig,
    ModelSpec,
    RlConfig,
    SamplingParams,
)
from opentinker.spec_sft import SftConfig
from opentinker.training_session import AdamParams, Datum, TrainingSession

__version__ = "0.1.0"

__all__ = [
    "AbstractGame",
    "AdamParams",
    "AuthenticationError",
    "Client",
    "ConfigError",
    "Datum",
    "EnvServerHandle",
    "FailedPreconditionError",
    "InferenceConfig",
    "InvalidArgumentError",
    "JobEvent",
    "JobFailedError",
    "JobInfo",
    "JobSpec",
    "LoraConfig",
    "ModelInfo",
    "ModelSpec",
    "NotFoundError",
    "OpenTinkerError",
    "ResourceExhaustedError",
    "Role",
    "RlConfig",
    "SamplingParams",
    "SftConfig",
    "SessionConfig",
    "StepResult",
    "Tool",
    "TrainingSession",
    "UnavailableError",
    "serve",
]
