"""CPU seconds used by the processes of a local mesh, by service, read from /proc.

On a machine with few cores the mesh's own processes compete with the compute: what each used
between two snapshots says where the cores went (bench/step_breakdown.py prints it per step).
Linux only; every process under ``root`` (this one by default: the bench that started the
mesh), grouped by what it runs: ``python -m opentinker.services.<name>`` counts as <name>
(a worker's warm spare, waiting for the next job, as "<name> (warm spare)"), Redis as
``redis``, anything else by its executable's name.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_by_service(root: int | None = None) -> dict[str, float]:
    """CPU seconds (user + system) used so far by ``root`` and every process under it, summed
    by service; processes that ended are not counted."""
    root = os.getpid() if root is None else root
    stats = {pid: stat for pid in _pids() if (stat := _stat(pid)) is not None}
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _) in stats.items():
        children[parent].append(pid)
    used: dict[str, float] = defaultdict(float)
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            used[_service(pid, is_root=pid == root)] += stats[pid][1]
        todo.extend(children.get(pid, []))
    return dict(used)


def per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Milliseconds of CPU each service used per step between two snapshots, largest first."""
    used = {name: (after[name] - before.get(name, 0.0)) * 1000 / max(steps, 1) for name in after}
    return dict(sorted(used.items(), key=lambda item: -item[1]))


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    parent, user, system = int(fields[1]), int(fields[11]), int(fields[12])
    return parent, (user + system) / _TICKS_PER_S


def _service(pid: int, *, is_root: bool) -> str:
    if is_root:
        return "bench (this process)"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in argv if w]
    for word in words:
        if word.startswith("opentinker.services."):
            name = word.removeprefix("opentinker.services.")
            return f"{name} (warm spare)" if "--spare" in words else name
    name = Path(words[0]).name if words else "?"
    return "redis" if name.startswith("redis-server") else name
