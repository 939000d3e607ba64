"""Warm spares: trainer and rollout processes started before their job (modeling/spare.py).

Starting a job's processes costs an interpreter, the imports of torch/transformers/peft and a
model load, each time. The pool keeps, for each base model launched here recently (and each of
``settings.warm_models``), ``settings.warm_spares`` spare rollout and trainer processes that
have paid that already and wait on stdin for a job. ``take`` gives one away (the job run hands
it the launch file) and wakes the maintainer, which starts its replacement at once.

Isolation: nothing of a job (token, spec, devices, seed, weights) reaches a spare before
hand-over. A spare serves one job and exits with it, exactly like a cold-started process,
unless ``settings.spare_reuse`` and the job allows it (job_run.py: one device, a private
rollout, RL or SFT): then a process whose job ended well comes back (``give_back``, via
reusable.py), reloads the base model from its files, and is kept for the next job of the
*same tenant* and base model only (``take(..., tenant=...)``), at most as many of each kind
per tenant as its jobs can run at once (``kept_limit``). Short jobs then pay no process start.
Bounds: ``warm_models_max`` models at once, retired after ``spare_idle_s`` without a job; a
spare that dies is replaced, and a model whose spares keep dying is no longer warmed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass, field

import structlog

from opentinker.services.modeling.model_key import model_key
from opentinker.services.modeling.spare import REPORT_FD_ENV
from opentinker.services.worker.settings import WorkerSettings
from opentinker.services.worker.supervisor import ManagedProcess

log = structlog.get_logger(__name__)

KINDS = ("rollout", "trainer")
MAX_SPARE_DEATHS = 3  # spares of one model dying before their job: stop warming it


@dataclass
class _Model:
    """One warm base model: its waiting spares of each kind."""

    key: str
    last_used: float  # monotonic
    pinned: bool = False  # in settings.warm_models: never retired
    deaths: int = 0
    spares: dict[str, list[ManagedProcess]] = field(default_factory=lambda: {k: [] for k in KINDS})
    # (tenant, kind) -> processes that served a job of that tenant and wait for its next one
    used: dict[tuple[str, str], list[ManagedProcess]] = field(default_factory=dict)

    def everyone(self) -> list[ManagedProcess]:
        return [p for k in KINDS for p in self.spares[k]] + [
            p for ps in self.used.values() for p in ps
        ]


class SparePool:
    """The worker's warm spares. ``maintain(stop)`` runs beside the agent; ``close()`` ends."""

    def __init__(self, settings: WorkerSettings, env: dict[str, str] | None = None) -> None:
        """``env``: extra environment of the spare processes (devices.cpu_thread_env)."""
        self.settings = settings
        self._env = env or {}
        self.dir = (settings.run_root / "spares").resolve()
        self._models: dict[str, _Model] = {}
        self._numbers = itertools.count(1)
        self._wake = asyncio.Event()
        self.warm_starts = 0  # spares given to jobs (the bench and tests read it)
        self.reused = 0  # processes given back after a job, for the tenant's next
        self._retiring: set[asyncio.Future[None]] = set()
        now = time.monotonic()
        for name in settings.warm_models:
            key = model_key(name)
            self._models[key] = _Model(key, now, pinned=True)

    @property
    def reuse(self) -> bool:
        return self.settings.spare_reuse

    def take(self, kind: str, base_model: str, tenant: str = "") -> ManagedProcess | None:
        """A live spare of ``kind`` that preloaded ``base_model``, or None (start cold): one
        that served ``tenant`` before if there is one (a reusable job's), else a fresh one.
        Either way the model counts as used, so spares are (re)made for it."""
        key = model_key(base_model)
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = _Model(key, time.monotonic())
        model.last_used = time.monotonic()
        self._wake.set()
        for waiting in (model.used.get((tenant, kind), []) if tenant else [], model.spares[kind]):
            while waiting:
                process = waiting.pop(0)
                if process.running:
                    self.warm_starts += 1
                    model.deaths = 0
                    return process
        return None

    def kept_limit(self, *, on_cpu: bool) -> int:
        """The most processes of a kind kept for one tenant on one set of devices: as many as
        its jobs that can run there at once (the CPU slots; one job on a GPU), at least
        ``warm_spares``. Fewer, and a tenant's concurrent short jobs would end processes that
        its next jobs then wait for spares to replace."""
        at_once = self.settings.num_cpu_slots if on_cpu else 1
        return max(1, self.settings.warm_spares, at_once)

    def give_back(
        self,
        kind: str,
        base_model: str,
        tenant: str,
        process: ManagedProcess,
        *,
        limit: int | None = None,
    ) -> None:
        """A reusable spare whose job (of ``tenant``) ended well: kept for that tenant's next
        job of the model, unless the model is no longer warm or ``limit`` wait already
        (``kept_limit``; default ``warm_spares``)."""
        model = self._models.get(model_key(base_model))
        waiting = model.used.setdefault((tenant, kind), []) if model else []
        limit = self.settings.warm_spares if limit is None else limit
        if model is None or len(waiting) >= max(1, limit):
            log.info("spare_not_kept", kind=kind, model=base_model, pid=process.pid)
            task = asyncio.ensure_future(_stop_all([process], self.settings.stop_grace_s))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            return
        waiting.append(process)
        self.reused += 1
        log.info("spare_kept", kind=kind, model=model.key, tenant=tenant, pid=process.pid)

    def waiting(self) -> dict[str, list[ManagedProcess]]:
        """Kind -> the fresh spares waiting for a job now, over every warm model."""
        return {k: [p for m in self._models.values() for p in m.spares[k]] for k in KINDS}

    async def maintain(self, stop: asyncio.Event, interval_s: float = 2.0) -> None:
        """Retire idle models, replace dead spares, start missing ones; until ``stop``."""
        while not stop.is_set():
            self._wake.clear()
            try:
                await self._tend()
            except Exception:  # a spare that cannot start must not stop the agent
                log.exception("spares_not_tended")
            if stop.is_set():
                break
            waits = {asyncio.create_task(self._wake.wait()), asyncio.create_task(stop.wait())}
            await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()

    async def _tend(self) -> None:
        now = time.monotonic()
        keep = sorted(self._models.values(), key=lambda m: (m.pinned, m.last_used), reverse=True)
        for rank, model in enumerate(keep):
            idle = now - model.last_used > self.settings.spare_idle_s and not model.pinned
            if idle or rank >= self.settings.warm_models_max:
                await self._retire(model, "idle" if idle else "more models than warm_models_max")
                continue
            for kind in KINDS:
                await self._refill(model, kind)

    async def _refill(self, model: _Model, kind: str) -> None:
        for used in model.used.values():  # a reused one that died: its tenant starts fresh
            used[:] = [p for p in used if p.running]
        waiting = model.spares[kind]
        for process in [p for p in waiting if not p.running]:
            waiting.remove(process)
            model.deaths += 1
            log.warning(
                "spare_died", kind=kind, model=model.key, code=process.returncode,
                log=str(process.log_path), deaths=model.deaths,
            )  # fmt: skip
        if model.deaths >= MAX_SPARE_DEATHS:
            return
        while len(waiting) < self.settings.warm_spares:
            waiting.append(await self._start(kind, model.key))

    async def _start(self, kind: str, key: str) -> ManagedProcess:
        s = self.settings
        command = s.rollout_command if kind == "rollout" else s.trainer_command
        number = next(self._numbers)
        process = await ManagedProcess.start(
            f"spare-{kind}",
            [*command, "--spare", "--preload-model", key],
            log_path=self.dir / f"{kind}-{number}.log",
            # CUDA_VISIBLE_DEVICES: at hand-over
            env={**os.environ, **self._env, "PYTHONUNBUFFERED": "1"},
            cwd=self.dir,
            stdin_pipe=True,
            report_pipe=REPORT_FD_ENV if self.reuse else "",
        )
        log.info("spare_started", kind=kind, model=key, pid=process.pid)
        return process

    async def _retire(self, model: _Model, why: str) -> None:
        del self._models[model.key]
        spares = model.everyone()
        if spares:
            log.info("spares_retired", model=model.key, spares=len(spares), why=why)
        await _stop_all(spares, self.settings.stop_grace_s)

    async def close(self) -> None:
        """Stop every waiting spare (they exit on stdin's EOF; stragglers are killed)."""
        for model in list(self._models.values()):
            await self._retire(model, "worker stopping")
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)


async def _stop_all(processes: list[ManagedProcess], grace_s: float) -> None:
    for process in processes:
        process.close_stdin()
    await asyncio.gather(*(p.terminate(grace_s) for p in processes), return_exceptions=True)
