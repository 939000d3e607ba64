"""The dashboard's HTTP app (Starlette): sign-in, jobs, a job's live charts, environments,
workers and the pool's models.

Every page calls the scheduler with the signed-in user's own API key, so the scheduler's
tenant isolation holds here as in the gRPC API. A job page's charts are fed by
``/jobs/{id}/events``: server-sent events from WatchJob, each response held open for
``stream_hold_s`` and resumed by the browser from its Last-Event-ID (only new events).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import structlog
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from opentinker.charts import PANELS, STEP_TIME_PARTS
from opentinker.errors import (
    AuthenticationError,
    FailedPreconditionError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from opentinker.services.dashboard.sessions import COOKIE, SignedIn, SignIns
from opentinker.services.dashboard.settings import DashboardSettings
from opentinker.services.dashboard.views import environments, event_json, job_rows

HERE = Path(__file__).parent
MAX_EVENT_SEQ = 2**63 - 1  # WatchJob's from_seq is an int64
log = structlog.get_logger("dashboard")


def create_app(settings: DashboardSettings) -> Starlette:
    sign_ins = SignIns(
        scheduler_address=settings.scheduler_address,
        ca_file=settings.ca_file,
        timeout_s=settings.call_timeout_s,
        idle_s=settings.session_idle_s,
    )
    pages = Pages(settings, sign_ins, Jinja2Templates(directory=HERE / "templates"))
    routes = [
        Route("/login", pages.login_form, methods=["GET"]),
        Route("/login", pages.login, methods=["POST"]),
        Route("/logout", pages.logout, methods=["POST"]),
        Route("/", pages.jobs),
        Route("/jobs/{job_id}", pages.job),
        Route("/jobs/{job_id}/events", pages.job_events),
        Route("/jobs/{job_id}/cancel", pages.cancel, methods=["POST"]),
        Route("/environments", pages.environments),
        Route("/workers", pages.workers),
        Route("/models", pages.models),
        Route("/healthz", lambda _: PlainTextResponse("ok")),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        sign_ins.close()  # the users' channels to the scheduler

    handlers = {AuthenticationError: pages.key_refused, UnavailableError: pages.scheduler_away}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)


class Pages:
    """The request handlers; each one that shows data needs a sign-in."""

    def __init__(
        self, settings: DashboardSettings, sign_ins: SignIns, templates: Jinja2Templates
    ) -> None:
        self.settings, self.sign_ins, self.templates = settings, sign_ins, templates
        # The event streams' threads, apart from the pool every page's calls take theirs from:
        # a stream holds its thread while it waits for the next event, and as many open job
        # pages as that pool has threads (40) left every page of every tenant waiting.
        self._streams: anyio.CapacityLimiter | None = None  # made on the event loop

    def _render(
        self, request: Request, name: str, signed: SignedIn | None, *, status: int = 200,
        **context,
    ) -> Response:  # fmt: skip
        context.update(signed=signed)
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def _signed_in(self, request: Request) -> SignedIn | None:
        return self.sign_ins.get(request.cookies.get(COOKIE))

    async def login_form(self, request: Request) -> Response:
        return self._render(request, "login.html", None, error="")

    async def login(self, request: Request) -> Response:
        form = await request.form()
        api_key = str(form.get("api_key", "")).strip()
        try:
            token, signed = await run_in_threadpool(self.sign_ins.sign_in, api_key)
        except (AuthenticationError, ValueError) as err:
            message = getattr(err, "message", str(err))
            return self._render(request, "login.html", None, error=message)
        except UnavailableError as err:
            return self._render(request, "login.html", None, error=self._away(err), status=503)
        log.info("signed_in", tenant_id=signed.tenant_id, user_id=signed.user_id)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    async def key_refused(self, request: Request, err: Exception) -> Response:
        """A page's scheduler call refused the signed-in key (revoked or expired since the
        sign-in): drop the sign-in and ask for a new key, rather than fail with a 500."""
        if isinstance(err, PermissionDeniedError):  # the key is good, the action is not
            signed = self._signed_in(request)
            message = getattr(err, "message", str(err))
            return self._render(request, "error.html", signed, message=message, status=403)
        self.sign_ins.sign_out(request.cookies.get(COOKIE))
        message = f"{getattr(err, 'message', err)} (sign in again with a valid key)"
        response = self._render(request, "login.html", None, error=message, status=401)
        response.delete_cookie(COOKIE)
        return response

    async def scheduler_away(self, request: Request, err: Exception) -> Response:
        """A page's scheduler call found nobody there (a restart, a network cut): 503 saying
        so, the sign-in kept for when it is back."""
        signed = self._signed_in(request)
        return self._render(request, "error.html", signed, message=self._away(err), status=503)

    def _away(self, err: Exception) -> str:
        return (
            f"the scheduler at {self.settings.scheduler_address} is unreachable; try again "
            f"shortly ({getattr(err, 'message', err)})"
        )

    async def logout(self, request: Request) -> Response:
        self.sign_ins.sign_out(request.cookies.get(COOKIE))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE)
        return response

    async def jobs(self, request: Request) -> Response:
        if (signed := self._signed_in(request)) is None:
            return RedirectResponse("/login", status_code=303)
        rows = await run_in_threadpool(job_rows, signed.client)
        return self._render(request, "jobs.html", signed, rows=rows)

    async def job(self, request: Request) -> Response:
        if (signed := self._signed_in(request)) is None:
            return RedirectResponse("/login", status_code=303)
        job_id = request.path_params["job_id"]
        try:
            job = await run_in_threadpool(signed.client.get_job, job_id)
        except NotFoundError as err:
            return self._render(request, "error.html", signed, message=err.message, status=404)
        charts = {"panels": PANELS, "step_time_parts": STEP_TIME_PARTS}
        return self._render(request, "job.html", signed, job=job, charts=charts)

    async def job_events(self, request: Request) -> Response:
        """Server-sent events of a job from after the browser's last one (Last-Event-ID or
        ``?after=``), for ``stream_hold_s`` at most; ``end`` once the job has ended."""
        if (signed := self._signed_in(request)) is None:
            return PlainTextResponse("sign in first", status_code=401)
        job_id = request.path_params["job_id"]
        last = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
        if not (last.isascii() and last.isdigit() and int(last) < MAX_EVENT_SEQ):
            return PlainTextResponse(f"after must be an event number, not {last!r}", 400)
        try:  # NOT_FOUND now, as a status, rather than inside the stream
            await run_in_threadpool(signed.client.get_job, job_id)
        except NotFoundError as err:
            return PlainTextResponse(err.message, status_code=404)
        lines = self._event_lines(signed, job_id, from_seq=int(last) + 1)
        if self._streams is None:
            self._streams = anyio.CapacityLimiter(self.settings.max_event_streams)
        return StreamingResponse(
            _stream(lines, self._streams),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _event_lines(self, signed: SignedIn, job_id: str, *, from_seq: int) -> Iterator[str]:
        yield "retry: 1000\n\n"  # the browser reconnects a second after a held stream ends
        try:
            for event in signed.client.watch(
                job_id, from_seq=from_seq, timeout=self.settings.stream_hold_s
            ):
                yield f"id: {event.seq}\nevent: job\ndata: {json.dumps(event_json(event))}\n\n"
                if event.terminal:
                    yield "event: end\ndata: {}\n\n"
                    return
        except UnavailableError:
            return  # held long enough (or the scheduler is away): the browser resumes

    async def cancel(self, request: Request) -> Response:
        if (signed := self._signed_in(request)) is None:
            return RedirectResponse("/login", status_code=303)
        job_id = request.path_params["job_id"]
        try:
            job = await run_in_threadpool(
                signed.client.cancel,
                job_id,
                reason=f"cancelled from the dashboard by {signed.user_id}",
            )
        except NotFoundError as err:
            return self._render(request, "error.html", signed, message=err.message, status=404)
        except FailedPreconditionError as err:  # it ended meanwhile (or a second click)
            return self._render(request, "error.html", signed, message=err.message, status=409)
        log.info("cancelled", job_id=job.job_id, user_id=signed.user_id)
        return RedirectResponse(f"/jobs/{job_id}", status_code=303)

    async def workers(self, request: Request) -> Response:
        if (signed := self._signed_in(request)) is None:
            return RedirectResponse("/login", status_code=303)
        workers = await run_in_threadpool(signed.client.workers)
        return self._render(request, "workers.html", signed, workers=workers, now=time.time())

    async def models(self, request: Request) -> Response:
        """The scheduler's model catalog: what jobs may name."""
        if (signed := self._signed_in(request)) is None:
            return RedirectResponse("/login", status_code=303)
        models = await run_in_threadpool(signed.client.models)
        return self._render(request, "models.html", signed, models=models)

    async def environments(self, request: Request) -> Response:
        if (signed := self._signed_in(request)) is None:
            return RedirectResponse("/login", status_code=303)
        s = self.settings
        try:
            instances = await run_in_threadpool(
                environments, s.envhub_address, api_key=signed.api_key, ca_file=s.ca_file,
                timeout=s.call_timeout_s,
            )  # fmt: skip
        except UnavailableError as err:  # EnvHub's, not the scheduler's (scheduler_away)
            message = f"EnvHub at {s.envhub_address} is unreachable; try again shortly ({err})"
            return self._render(request, "error.html", signed, message=message, status=503)
        return self._render(request, "environments.html", signed, instances=instances)


async def _stream(lines: Iterator[str], limiter: anyio.CapacityLimiter) -> AsyncIterator[str]:
    """``lines``, each read in a thread of ``limiter`` (it blocks until the next event)."""
    while (line := await anyio.to_thread.run_sync(next, lines, None, limiter=limiter)) is not None:
        yield line
