"""What one gateway process holds: settings, callers' scheduler clients, open training
models and the futures in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict

from opentinker.common.v1 import common_pb2
from opentinker.connection import Connection
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.gateway.futures import FutureStore
from opentinker.services.gateway.models import Models
from opentinker.services.gateway.sessions import Sessions
from opentinker.services.gateway.settings import GatewaySettings
from opentinker.services.gateway.signing import signing_secret
from opentinker.services.gateway.stops import Tokenizers
from opentinker.services.gateway.tenancy import Caller, Tenancy

IDEMPOTENCY_KEEP = 4096  # answers remembered for retried requests (X-Idempotency-Key)


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.tenancy = Tenancy(
            settings.scheduler_address, cache_s=settings.key_cache_s, timeout=30.0
        )
        self.models = Models(order_wait_s=settings.order_wait_s)
        self.futures = FutureStore(long_poll_s=settings.long_poll_s)
        self.sessions = Sessions(expiry_s=settings.session_expiry_s)
        self.answered: OrderedDict[tuple[str, str], dict] = OrderedDict()
        self.download_secret = signing_secret(settings)
        self.tokenizers = Tokenizers()  # for stop strings and the OpenAI-compatible routes
        # The OpenAI-compatible routes' own session per tenant (its samplers close with it
        # when the tenant's calls stop for session_expiry_s), and one lock per (tenant,
        # model) so concurrent first calls start one sampler.
        self.openai_sessions: dict[str, str] = {}
        self.openai_locks: dict[tuple[str, str], asyncio.Lock] = {}

    def remember(self, tenant: str, key: str, answer: dict) -> None:
        self.answered[(tenant, key)] = answer
        while len(self.answered) > IDEMPOTENCY_KEEP:
            self.answered.popitem(last=False)

    def job_model(self, caller: Caller, job_id: str) -> common_pb2.ModelSpec:
        """The model a session job of the caller trained (NOT_FOUND for others')."""
        request = scheduler_pb2.GetJobRequest(job_id=job_id)
        conn = Connection(self.settings.scheduler_address, api_key=caller.key, timeout=30.0)
        try:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(conn.channel)
            return conn.call(stub.GetJob, request, None).job.spec.model
        finally:
            conn.close()

    def close(self) -> None:
        for model in self.models.all():
            with contextlib.suppress(Exception):  # it may have ended already (idle timeout)
                model.session.close()
        self.tenancy.close()
