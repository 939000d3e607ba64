"""A shared LoRA host: one base model in one trainer process, many sessions' adapters on it.

Each session (a tenant's ``create_lora_training_client``) gets its own peft adapter on the
one frozen base -- its own rank, alpha and target modules (MLP and the unembedding included
when asked) -- its own AdamW and its own RNG (``host_tenant.TenantPolicy``). Their model
work runs in fair turns (``host_turns.FairTurns``): one unit at a time, round-robin across
the sessions with work waiting.

Isolation, by construction and tested (tests/sessions/test_shared_lora_host.py): a unit runs with
only its session's adapter active and trainable (peft ``set_adapter``), so its graph holds no other
adapter and no base weight that needs a gradient; each AdamW holds only its session's
parameters; the torch RNG is swapped to the session's own state for its unit (dropout, the
adapter's initial weights) and back after. A session trained here is bit-for-bit the same
session trained alone on the host.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import peft
import structlog
import torch
import transformers
from transformers import AutoTokenizer, PreTrainedModel

from opentinker.errors import FailedPreconditionError, InvalidArgumentError
from opentinker.services.modeling.adapters import load_init_adapter, peft_lora_config
from opentinker.services.modeling.placement import dtype_for_device
from opentinker.services.modeling.vision_inputs import load_language_model
from opentinker.services.trainer.session.host_tenant import (
    RngState,
    TenantPolicy,
    adapter_name_for,
    probe_ids,
)
from opentinker.services.trainer.session.host_turns import FairTurns, TurnUsage
from opentinker.spec import ModelSpec

log = structlog.get_logger(__name__)
T = TypeVar("T")
DEFAULT_MAX_SESSIONS = 16


class SharedLoraHost:
    """One base model (``base_model`` on ``device``) and the sessions' adapters on it."""

    def __init__(
        self, base_model: str, *, device: str = "cpu", max_sessions: int = DEFAULT_MAX_SESSIONS
    ) -> None:
        if max_sessions < 1:
            raise InvalidArgumentError(f"max_sessions must be >= 1, got {max_sessions}")
        transformers.utils.logging.disable_progress_bar()
        self.base_model, self.max_sessions = base_model, max_sessions
        self.device = torch.device(device)
        self.dtype = dtype_for_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(base_model)
        base: PreTrainedModel = load_language_model(base_model, dtype=self.dtype)
        self.base = base.to(self.device)  # type: ignore[arg-type]  # transformers' narrow .to()
        self.base.requires_grad_(False)
        self.model: peft.PeftModel | None = None  # wrapped at the first session
        self.probe_token_ids = probe_ids(self.tokenizer)
        self.sessions: dict[str, TenantPolicy] = {}
        self._lock = threading.RLock()
        self._depth = 0  # nesting of ``activated`` in the thread holding the lock
        self._active: str | None = None
        self.turns = FairTurns(self._run_unit)
        self.log = log.bind(base_model=base_model)

    @property
    def room(self) -> int:
        """How many more sessions fit."""
        return self.max_sessions - len(self.sessions)

    def add_session(self, session_id: str, spec: ModelSpec, *, seed: int) -> TenantPolicy:
        """A new adapter for ``session_id`` (``spec.lora``; initial weights drawn from
        ``seed``, the same whatever other sessions are here). FAILED_PRECONDITION when the
        host is full or the spec is not a LoRA of this host's base."""
        self._check_spec(session_id, spec)
        adapter = adapter_name_for(session_id)
        config = peft_lora_config(spec.lora)
        with self._lock:
            if session_id in self.sessions:
                raise FailedPreconditionError(f"session {session_id} is already on this host")
            if self.room <= 0:
                raise FailedPreconditionError(
                    f"this host of {self.base_model} is full ({self.max_sessions} sessions)",
                    reason="HOST_FULL",
                )
            outer = rng_state(self.device)
            try:
                torch.manual_seed(seed)  # seeds CUDA's generators too
                model = self._add_adapter(adapter, config)
                if spec.init_adapter is not None:
                    load_init_adapter(model, spec, self.device, adapter_name=adapter)
                rng = rng_state(self.device)
            finally:
                set_rng_state(self.device, outer)
            tenant = TenantPolicy(
                self, session_id=session_id, adapter=adapter, spec=spec, rng_state=rng
            )
            self.sessions[session_id] = tenant
        self.log.info("session_joined", session_id=session_id, rank=spec.lora.rank)
        return tenant

    def _check_spec(self, session_id: str, spec: ModelSpec) -> None:
        if spec.finetune != "lora":
            raise InvalidArgumentError(
                f"session {session_id}: a shared host trains LoRA adapters only; a full "
                "fine-tuning session takes a whole device",
                reason="NOT_LORA",
            )
        if spec.base_model != self.base_model:
            raise InvalidArgumentError(
                f"session {session_id}: model.base_model {spec.base_model!r} is not this "
                f"host's base {self.base_model!r}",
                reason="OTHER_BASE",
            )

    def _add_adapter(self, adapter: str, config: peft.LoraConfig) -> peft.PeftModel:
        if self.model is None:
            model = peft.get_peft_model(self.base, config, adapter_name=adapter)
            assert isinstance(model, peft.PeftModel)  # a LoraConfig wraps as a PeftModel
            self.model = model
        else:
            self.model.add_adapter(adapter, config)
        self._active = None  # peft moved the active adapter: set it again at the next unit
        self.model.train()
        return self.model

    def remove_session(self, session_id: str) -> None:
        """Drop the session's adapter and optimizer (its turns' usage stays readable)."""
        self.turns.forget(session_id)
        with self._lock:
            tenant = self.sessions.pop(session_id, None)
            if tenant is None or self.model is None:
                return
            tenant.optimizer.state.clear()
            if self.sessions:
                self.model.delete_adapter(tenant.adapter)
                self._active = None
            else:  # the last one: the base alone again, ready for the next first adapter
                self.base = self.model.unload()  # type: ignore[assignment]
                self.model = None
        self.log.info("session_left", session_id=session_id)

    async def run(self, session_id: str, fn: Callable[[], T]) -> T:
        """``fn`` as one unit of the session's model work, in its fair turn."""
        if session_id not in self.sessions:
            raise FailedPreconditionError(f"session {session_id} is not on this host")
        return await self.turns.run(session_id, fn)

    def usage(self, session_id: str) -> TurnUsage:
        return self.turns.usage.get(session_id, TurnUsage())

    def _run_unit(self, session_id: str, fn: Callable[[], T]) -> T:
        with self.activated(session_id):
            return fn()

    @contextlib.contextmanager
    def activated(self, session_id: str) -> Iterator[TenantPolicy]:
        """Hold the model for ``session_id``: its adapter active and the only one trainable,
        the torch RNG its own (saved back after). Re-entrant in the holding thread."""
        with self._lock:
            tenant = self.sessions.get(session_id)
            if tenant is None:
                raise FailedPreconditionError(f"session {session_id} is not on this host")
            if self._depth:
                if self._active != tenant.adapter:
                    raise RuntimeError(f"nested use of {session_id} inside {self._active}")
                self._depth += 1
                try:
                    yield tenant
                finally:
                    self._depth -= 1
                return
            assert self.model is not None
            if self._active != tenant.adapter:
                self.model.set_adapter(tenant.adapter)  # only it requires grad now
                self._active = tenant.adapter
            outer = rng_state(self.device)
            set_rng_state(self.device, tenant.rng_state)
            self._depth = 1
            try:
                yield tenant
            finally:
                self._depth = 0
                tenant.rng_state = rng_state(self.device)
                set_rng_state(self.device, outer)


def rng_state(device: torch.device) -> RngState:
    """torch's generator state on the CPU, and on ``device`` when it is a GPU."""
    on_gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), on_gpu


def set_rng_state(device: torch.device, state: RngState) -> None:
    cpu, on_gpu = state
    torch.set_rng_state(cpu)
    if on_gpu is not None:
        torch.cuda.set_rng_state(on_gpu, device)
