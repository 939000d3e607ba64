"""Step reports sent in the background, in order, so a report never holds up the next step.

One sender task takes the queued reports one at a time through the reporter (which keeps its
own deadline and UNAVAILABLE retries). The loop looks at the outcome at each step boundary:
a stop answer (cancelled or superseded) stops the job there, and a report that finally failed
raises there, as an awaited report would have one step earlier. After a stop answer or a
failure the reports still queued are dropped: the scheduler no longer wants them. At most
``max_pending`` reports wait; a full queue makes ``put`` wait (a slow scheduler slows the job
rather than piling up reports in memory).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Mapping
from typing import Protocol


class StepReport(Protocol):
    """A reporter's ``report_step``: True when the scheduler says stop."""

    def __call__(
        self,
        step: int,
        policy_version: int,
        metrics: Mapping[str, float],
        env_error_reason: str = "",
    ) -> Awaitable[bool]: ...


_CLOSE = None  # the queue's end marker


class BackgroundStepReports:
    """Queue step reports for ``report_step``; check ``stop_requested`` between steps."""

    def __init__(self, report_step: StepReport, *, max_pending: int = 4) -> None:
        self._report_step = report_step
        self._queue: asyncio.Queue[tuple[int, int, dict[str, float], str] | None] = asyncio.Queue(
            maxsize=max_pending
        )
        self._stop = False
        self._error: Exception | None = None
        self._sender: asyncio.Task[None] | None = None

    @property
    def stop_requested(self) -> bool:
        """True once the scheduler answered a report with stop; raises a failed report's error."""
        if self._error is not None:
            raise self._error
        return self._stop

    async def put(
        self,
        step: int,
        policy_version: int,
        metrics: Mapping[str, float],
        env_error_reason: str = "",
    ) -> None:
        """Queue one step's report (waits while ``max_pending`` are queued)."""
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_all())
        if self._stop or self._error is not None:
            return
        await self._queue.put((step, policy_version, dict(metrics), env_error_reason))

    async def flush(self) -> bool:
        """Wait until every queued report was answered; returns stop_requested."""
        if self._sender is not None:
            await self._queue.put(_CLOSE)
            await self._sender
            self._sender = None
        return self.stop_requested

    async def cancel(self) -> None:
        """Drop the queued reports and stop the sender (a failing job reports its failure)."""
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
            self._sender = None

    async def _send_all(self) -> None:
        while (report := await self._queue.get()) is not _CLOSE:
            if self._stop or self._error is not None:
                continue  # drain what was queued behind a stop or a failure
            try:
                step, version, metrics, reason = report
                self._stop = await self._report_step(
                    step, version, metrics, env_error_reason=reason
                )
            except Exception as err:  # noqa: BLE001 - raised in the loop at the next boundary
                self._error = err
