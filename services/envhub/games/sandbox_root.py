"""The filesystem a sandboxed run sees, made by bubblewrap (``bwrap``): a new, empty root that
holds only the system's programs and libraries (``/usr`` and its ``/bin``, ``/lib`` links,
read-only), this Python's installation (its prefixes, read-only), a fresh ``/dev`` and
``/proc``, and the run's own folder (read-write, at its real path, as the working directory).

Nothing else exists in it: not the services' folders (run root, checkpoint root, the
scheduler's identity folder, with every tenant's job ids in their names), not the checkout, not
``/etc``, not other runs' folders. The folders above a bound path are made anew with mode 0755,
so a Python installed under a private home (a clone under ``/root``, mode 0700) is readable by
the sandbox's user there although it is not outside. bubblewrap also gives the run new network,
PID, IPC and UTS namespaces, and its first process dies with the sandbox's parent.
"""

from __future__ import annotations

import os
import sys
from pathlib import PurePosixPath

# The system's top folders a Python needs (programs, the loader, shared libraries); each is
# bound read-only, or made the same link where it is one (merged /usr).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def python_roots() -> list[str]:
    """This Python's installation: its prefixes (a venv's and the base one's, as named and
    with links resolved) and the folder of the interpreter the venv links to."""
    named = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    interpreter = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    roots = named | {os.path.realpath(p) for p in named} | {interpreter}
    return sorted(p for p in roots if os.path.isdir(p))


def bwrap_prefix(folder: str, *, as_root: bool) -> list[str]:
    """The bwrap command line (up to its ``--``) for a run whose own folder is ``folder``.
    as_root: the caller is root (bwrap mounts directly; else it needs a user namespace)."""
    args = ["bwrap", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    if not as_root:
        args.append("--unshare-user")
    args += ["--die-with-parent", "--new-session", "--dev", "/dev", "--proc", "/proc"]
    bound: list[str] = []
    for top in SYSTEM:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
            bound.append(top)
    made: set[str] = set()
    for root in python_roots():
        if not _under(root, bound):
            args += _ancestors(root, bound, made)
            args += ["--ro-bind", root, root]
            bound.append(root)
    args += _ancestors(folder, bound, made)
    return [*args, "--bind", folder, folder, "--chdir", folder, "--"]


def _under(path: str, roots: list[str]) -> bool:
    return any(PurePosixPath(path).is_relative_to(root) for root in roots)


def _ancestors(path: str, bound: list[str], made: set[str]) -> list[str]:
    """``--dir`` (mode 0755) for each folder above ``path`` not yet in the new root."""
    args: list[str] = []
    for parent in reversed(PurePosixPath(path).parents):
        name = str(parent)
        if name == "/" or name in made or _under(name, bound):
            continue
        made.add(name)
        args += ["--perms", "0755", "--dir", name]
    return args
