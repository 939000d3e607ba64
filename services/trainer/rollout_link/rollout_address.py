"""Where a trainer finds its job's rollout: given (``--rollout-address``), or in the file the
rollout writes once it serves (``--rollout-address-file``).

The worker starts a private rollout and its trainer at the same time (worker/job_run.py): the
trainer imports, reads its launch file and loads its policy while the rollout starts, and reads
the rollout's address only when it opens the rollout. The worker judges the rollout's start
(it dies, or is late: the attempt fails with that reason and this trainer is ended with it),
and hands this process its own deadline (``--rollout-address-timeout``: the worker's wait and a
grace), so the worker's reason is the one the user reads. A trainer started by hand waits
``TrainerSettings.rollout_address_timeout_s``.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from opentinker.services.trainer.errors import RolloutError

log = structlog.get_logger(__name__)

POLL_S = 0.05  # how often the file is looked for; the address is read once, when it appears
# host:port, [v6]:port, or a gRPC unix: target; what a rollout writes (rollout/__main__.py)
_ADDRESS = re.compile(r"^(unix:\S+|\S+:(?P<port>\d{1,5}))$")


@dataclass(frozen=True)
class RolloutAddress:
    """The job's rollout: ``address`` (host:port) when known at start, else ``file``, which the
    rollout writes atomically (common/launch.py ``write_atomic``) once it serves.
    ``timeout_s``: how long to wait for the file, when whoever started this trainer said."""

    address: str = ""
    file: Path | None = None
    timeout_s: float | None = None

    @classmethod
    def given(
        cls, address: str | None, file: Path | None, timeout_s: float | None = None
    ) -> RolloutAddress | None:
        """From the command line; None when neither is given (an SFT job has no rollout)."""
        if address:
            return cls(address=address)
        if file is not None:
            return cls(file=Path(file), timeout_s=timeout_s)
        return None

    def __str__(self) -> str:
        return self.address or f"from {self.file}"

    async def resolve(self, *, default_timeout_s: float) -> str:
        """The rollout's host:port; waits for the file (without blocking the event loop, and
        cancellable: a SIGTERM ends the wait at once) for ``self.timeout_s``, else
        ``default_timeout_s``. RolloutError when it has not appeared in time, or holds no
        address."""
        if self.address:
            return self.address
        assert self.file is not None
        timeout_s = self.timeout_s if self.timeout_s is not None else default_timeout_s
        started = time.monotonic()
        deadline = started + timeout_s
        while not self.file.exists():
            if time.monotonic() > deadline:
                raise RolloutError(
                    f"the rollout did not write {self.file.name} within {timeout_s:.0f} s "
                    f"(waited for {self.file}); see the rollout's log beside it"
                )
            await asyncio.sleep(POLL_S)
        address = self.file.read_text().strip()
        if not _is_address(address):
            raise RolloutError(
                f"{self.file} holds {address[:80]!r}, not the rollout's host:port "
                "(something other than the rollout wrote it)"
            )
        log.info("rollout_address", address=address, waited_s=round(time.monotonic() - started, 3))
        return address


def _is_address(text: str) -> bool:
    """A gRPC unix: target, or host:port with a port a server can bind (1..65535)."""
    match = _ADDRESS.match(text)
    if match is None:
        return False
    port = match.group("port")
    return port is None or 1 <= int(port) <= 65535
