"""Where a trainer finds its job's rollout: given (``--rollout-address``), or in the file the
rollout writes once it serves (``--rollout-address-file``).

The worker starts a private rollout and its trainer at the same time (worker/job_run.py): the
trainer imports, reads its launch file and loads its policy while the rollout starts, and reads
the rollout's address only when it opens the rollout. The worker judges the rollout's start
(it dies, or is late: the attempt fails with that reason and this trainer is ended with it);
this process's own deadline, ``TrainerSettings.rollout_address_timeout_s``, is a backstop for
a trainer started by hand.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from .errors import RolloutError

log = structlog.get_logger(__name__)

POLL_S = 0.05  # how often the file is looked for; the address is read once, when it appears


@dataclass(frozen=True)
class RolloutAddress:
    """The job's rollout: ``address`` (host:port) when known at start, else ``file``, which the
    rollout writes atomically (common/launch.py ``write_atomic``) once it serves."""

    address: str = ""
    file: Path | None = None

    @classmethod
    def given(cls, address: str | None, file: Path | None) -> RolloutAddress | None:
        """From the command line; None when neither is given (an SFT job has no rollout)."""
        if address:
            return cls(address=address)
        if file is not None:
            return cls(file=Path(file))
        return None

    def __str__(self) -> str:
        return self.address or f"from {self.file}"

    async def resolve(self, *, timeout_s: float) -> str:
        """The rollout's host:port; waits for the file (without blocking the event loop, and
        cancellable: a SIGTERM ends the wait at once). RolloutError when it has not appeared
        within ``timeout_s``."""
        if self.address:
            return self.address
        assert self.file is not None
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
        log.info("rollout_address", address=address, waited_s=round(time.monotonic() - started, 3))
        return address
