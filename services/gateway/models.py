"""Tinker training models, each a trainer session job of the caller, reached through the SDK's
TrainingSession (one ordered worker per session). The gateway holds the open connections,
nothing the mesh cannot tell again: a model id names its session job
(``<tinker session>:train:<n>`` -> job), checkpoints are named by the job (``tinker://<job
id>/weights/<name>`` is the trainer's state ``<job id>/states/<name>``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from opentinker.errors import InvalidArgumentError, NotFoundError
from opentinker.services.gateway.ordering import SeqGate
from opentinker.services.gateway.stability import StabilityRecords
from opentinker.services.gateway.tenancy import Caller
from opentinker.training_session import TrainingSession

STATE_KIND, SAMPLER_KIND, EXTERNAL_KIND = "weights", "sampler_weights", "external_weights"
EXTERNAL_PREFIX = "ext."  # the trainer's state name of external weights: ext.<name>
SAMPLER_PREFIX = "sampler."  # .. of named sampler weights (sampleable after the run)


@dataclass
class TrainingModel:
    model_id: str
    tenant_id: str
    base_model: str  # the name the user gave (see GatewaySettings.base_models)
    lora_rank: int
    session: TrainingSession
    gate: SeqGate
    samplers: int = field(default=0)  # sampling sessions made from it
    sampler_names: dict[str, float] = field(default_factory=dict)  # named sampler saves: unix s
    # The policy version each sampler snapshot is (the trainer keeps its weights): by
    # sampling session id, and by sampler_weights name.
    sampler_versions: dict[str, int] = field(default_factory=dict)
    named_versions: dict[str, int] = field(default_factory=dict)
    stability: StabilityRecords = field(default_factory=StabilityRecords)  # stable_reinforce

    @property
    def job_id(self) -> str:
        return self.session.job_id


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<job id>/<kind>/<name>``: a checkpoint of the session job ``job_id``."""

    job_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str) -> TinkerPath:
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or not all(parts):
            raise InvalidArgumentError(
                f"path: {path!r} is not tinker://<training run>/<weights|sampler_weights>/<name>"
            )
        if any(set(part) <= {"."} or "\\" in part for part in parts):
            raise InvalidArgumentError(f"path: {path!r}: a part is only dots or has a backslash")
        if parts[1] not in (STATE_KIND, SAMPLER_KIND, EXTERNAL_KIND):
            raise InvalidArgumentError(f"path: {path!r}: unknown checkpoint kind {parts[1]!r}")
        return cls(*parts)

    def __str__(self) -> str:
        return f"tinker://{self.job_id}/{self.kind}/{self.name}"

    @property
    def trainer_name(self) -> str:
        """The trainer's state name (external weights are states too, named ext.<name>, and
        so are named sampler weights, sampler.<name>)."""
        prefix = {EXTERNAL_KIND: EXTERNAL_PREFIX, SAMPLER_KIND: SAMPLER_PREFIX}.get(self.kind, "")
        return f"{prefix}{self.name}"

    @property
    def trainer_state(self) -> str:
        """The trainer's LoadState path (relative to its checkpoint root)."""
        return f"{self.job_id}/states/{self.trainer_name}"


class Models:
    def __init__(self, *, order_wait_s: float) -> None:
        self.order_wait_s = order_wait_s
        self._by_id: dict[str, TrainingModel] = {}
        self._by_job: dict[str, TrainingModel] = {}
        self._starting: dict[str, asyncio.Event] = {}

    def add(self, model: TrainingModel) -> None:
        self._by_id[model.model_id] = model
        self._by_job[model.job_id] = model
        if (started := self._starting.pop(model.model_id, None)) is not None:
            started.set()

    def starting(self, model_id: str) -> None:
        """``model_id`` is being created: calls for it wait (see ``get``) instead of failing."""
        self._starting.setdefault(model_id, asyncio.Event())

    def failed(self, model_id: str) -> None:
        if (started := self._starting.pop(model_id, None)) is not None:
            started.set()

    async def get(self, model_id: str, caller: Caller) -> TrainingModel:
        """The caller's model (waiting for one still starting); NotFoundError otherwise."""
        if (started := self._starting.get(model_id)) is not None:
            await started.wait()
        model = self._by_id.get(model_id)
        if model is None or model.tenant_id != caller.tenant_id:
            raise NotFoundError(f"model_id: no training model {model_id!r} of yours")
        return model

    def live_job(self, job_id: str) -> TrainingModel | None:
        return self._by_job.get(job_id)

    def by_job(self, job_id: str, caller: Caller) -> TrainingModel:
        model = self._by_job.get(job_id)
        if model is None or model.tenant_id != caller.tenant_id:
            raise NotFoundError(f"no live training run {job_id!r} of yours")
        return model

    def new_sampler(self, model: TrainingModel, version: int) -> str:
        """A sampling session of ``model``'s weights as served as policy ``version`` (a
        snapshot: it samples them for as long as it lives, whatever the model trains)."""
        model.samplers += 1
        sampler = f"{model.job_id}:sample:{model.samplers}"
        model.sampler_versions[sampler] = version
        return sampler

    def sampler(self, sampling_session_id: str, caller: Caller) -> tuple[TrainingModel, int]:
        """The model a sampling session samples from (``<job id>:sample:<n>``) and the
        policy version of its snapshot."""
        model = self.by_job(sampling_session_id.split(":", 1)[0], caller)
        version = model.sampler_versions.get(sampling_session_id)
        if version is None:
            raise NotFoundError(f"sampling_session_id: no sampler {sampling_session_id!r} of yours")
        return model, version

    def remove(self, model: TrainingModel) -> None:
        self._by_id.pop(model.model_id, None)
        self._by_job.pop(model.job_id, None)

    def all(self) -> list[TrainingModel]:
        return list(self._by_id.values())
