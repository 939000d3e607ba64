"""Runs inside the sandbox, before the model's code: ``python -I -c "<this file>" CELL`` (its
source is passed as text, so the sandbox user needs no read access to the checkout).

A Python audit hook refuses what model code has no business doing: starting processes
(fork, exec, spawn, subprocess, os.system), opening sockets, native code through ctypes
(beyond the libraries numpy and sympy load at import), walking the garbage collector (to find
and disarm this hook), and opening or listing files outside the sandbox folder (reads are also
allowed inside Python's own installation). It is a tripwire that gives the model a clear
error; the boundary is the OS layer around it (see ``sandbox.py``: its own user, namespaces,
a root of its own, resource limits). Standard library only.
"""

import os
import runpy
import signal
import sys
import traceback

_REFUSED_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.kill",
        "os.killpg",
        "os.symlink",
        "os.link",
        "subprocess.Popen",
        "pty.spawn",
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "ctypes.dlsym",
        "ctypes.cdata",
        "ctypes.call_function",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
    }
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _install(cell_dir: str) -> None:
    readable = tuple(
        {os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
        | {os.path.realpath(p) + os.sep for p in sys.path if p and os.path.isdir(p)}
    )
    writable = os.path.realpath(cell_dir) + os.sep
    devices = ("/dev/null", "/dev/urandom", "/dev/random")

    def hook(event: str, args: tuple) -> None:
        if event in _REFUSED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "ctypes.dlopen":  # numpy and sympy open the process itself at import
            name = args[0]
            if name is None or os.path.realpath(os.fsdecode(name)).startswith(readable):
                return
            raise PermissionError(f"sandbox: loading native library {name!r} is not allowed")
        if event in ("os.listdir", "os.scandir"):  # (the OS layer hides the rest too)
            where = args[0] if args[0] is not None else "."
            if isinstance(where, int):
                return
            folder = os.path.realpath(os.fsdecode(where))
            if not ((folder + os.sep).startswith(writable) or folder.startswith(readable)):
                raise PermissionError(f"sandbox: listing {folder} is not allowed")
            return
        if event != "open" or isinstance(args[0], int):
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        mode, flags = args[1], args[2]
        writing = any(c in (mode or "") for c in "wax+") or bool(flags & _WRITE_FLAGS)
        inside = (path + os.sep).startswith(writable) or path in devices
        if inside or (not writing and path.startswith(readable)):
            return
        raise PermissionError(f"sandbox: opening {path} is not allowed (only the working folder)")

    sys.addaudithook(hook)


def _on_cpu_limit(signum: int, frame: object) -> None:
    # RLIMIT_CPU's soft limit sends SIGXCPU; the hard limit one second later kills.
    raise TimeoutError("sandbox: CPU time limit exceeded")


def _main() -> int:
    cell = os.path.abspath(sys.argv[1])
    signal.signal(signal.SIGXCPU, _on_cpu_limit)
    _install(os.path.dirname(cell))
    try:
        runpy.run_path(cell, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # show the model its own frames only
        frames = traceback.extract_tb(exc.__traceback__)
        own = traceback.StackSummary.from_list([f for f in frames if f.filename == cell])
        sys.stderr.write("Traceback (most recent call last):\n" + "".join(own.format()))
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
