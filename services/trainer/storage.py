"""Storage faults of the checkpoint root, named: disk full, read-only, permission denied.

A write into the checkpoint root fails in many voices: ``OSError(ENOSPC)`` from Python,
safetensors' "I/O error: No space left on device (os error 28)", and torch's
``[enforce fail at inline_container.cc:672] unexpected pos …``, which names no cause at all.
``named`` turns any of them into a ``StorageError`` whose message says which fault it is, the
path, and the free space on its filesystem; ``check_writable`` finds the same faults before a
job trains a single step. Which faults are named:

    disk full           ENOSPC, EDQUOT (a quota), or a failed write leaving < 1 MiB free
    read-only           EROFS
    permission denied   EACCES, EPERM

What a job does about one is the operator's choice (``TrainerSettings.on_storage_error``):
fail it, or end the attempt so that the scheduler re-queues the job (``Outcome.RETRY_LATER``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

from opentinker.services.trainer.errors import CheckpointError

# A failed write that leaves less than this free on its filesystem is taken for a full disk
# (torch's own writer reports a short write without the errno).
NEARLY_FULL_BYTES = 1 << 20
PROBE_BYTES = 64 * 1024  # written and fsync'd by check_writable: a disk that full fails it

# (machine reason, words for people) by errno
_FAULTS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("DISK_FULL", "disk full"),
    errno.EDQUOT: ("DISK_FULL", "disk full (quota exceeded)"),
    errno.EROFS: ("READ_ONLY", "read-only file system"),
    errno.EACCES: ("PERMISSION_DENIED", "permission denied"),
    errno.EPERM: ("PERMISSION_DENIED", "permission denied"),
}
# How the same errnos read in messages that lost the errno (safetensors' Rust, torch's C++).
_IN_TEXT = [
    (re.compile(r"No space left on device|os error 28\b"), errno.ENOSPC),
    (re.compile(r"Disk quota exceeded|os error 122\b"), errno.EDQUOT),
    (re.compile(r"Read-only file system|os error 30\b"), errno.EROFS),
    (re.compile(r"Permission denied|os error 13\b"), errno.EACCES),
    (re.compile(r"Operation not permitted|os error 1\b"), errno.EPERM),
]


class StorageError(CheckpointError):
    """The checkpoint root cannot take a write. ``reason``: DISK_FULL, READ_ONLY or
    PERMISSION_DENIED; the message names the fault, the path and the free space."""


def named(err: BaseException, path: Path, *, doing: str) -> StorageError | None:
    """``err`` (raised while ``doing`` something at ``path``) as a named StorageError, or None
    when it is no storage fault. Call it before deleting what the failed write left: the free
    space it reports (and a full disk that said nothing) is read now."""
    code = _errno_in(err)
    if code is None:
        free = _free_bytes(path)
        if free is not None and free < NEARLY_FULL_BYTES:
            code = errno.ENOSPC
    if code is None:
        return None
    reason, words = _FAULTS[code]
    return StorageError(f"{words}: {doing} ({_cause(err)}); {space(path)}", reason=reason)


def check_writable(folder: Path, *, need_bytes: int = 0) -> None:
    """Make ``folder`` (and its parents) and prove a file can be written and fsync'd in it,
    with ``need_bytes`` free beside it; StorageError naming the fault otherwise."""
    folder = Path(folder)
    doing = f"the checkpoint folder {folder} cannot be written"
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise named(err, folder, doing=doing) or CheckpointError(
            f"{doing}: {type(err).__name__}: {err}"
        ) from err
    finally:
        with contextlib.suppress(OSError):  # never hides the fault being raised
            probe.unlink(missing_ok=True)
    free = _free_bytes(folder)
    if free is not None and free < need_bytes:
        raise StorageError(
            f"disk full: a checkpoint in {folder} needs at least {_size(need_bytes)}; "
            f"{space(folder)}",
            reason="DISK_FULL",
        )


def space(path: Path) -> str:
    """'<free> free of <total> on the filesystem of <path>' (or that it cannot be told)."""
    where = _existing(path)
    try:
        st = os.statvfs(where)
    except OSError:
        return f"free space on the filesystem of {path} unknown"
    total = st.f_blocks * st.f_frsize
    return f"{_size(_writable(st))} free of {_size(total)} on the filesystem of {where}"


def _errno_in(err: BaseException) -> int | None:
    """The first named errno in ``err``, its causes and contexts, or in their messages."""
    seen: set[int] = set()
    chain: list[BaseException] = [err]
    while chain:
        e = chain.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FAULTS:
            return e.errno
        for pattern, code in _IN_TEXT:
            if pattern.search(str(e)):
                return code
        chain += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def _cause(err: BaseException) -> str:
    """The failed call's own words, short."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror if err.filename is None else f"{err.strerror}: {err.filename}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


def _free_bytes(path: Path) -> int | None:
    """Bytes this process may still write at ``path``; None when the filesystem cannot be
    asked (then check_writable's probe write alone decides)."""
    try:
        return _writable(os.statvfs(_existing(path)))
    except OSError:
        return None


def _writable(st: os.statvfs_result) -> int:
    """Free bytes for this process: root may also fill the blocks reserved for it."""
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (statvfs needs one that exists)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
