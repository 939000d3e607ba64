"""The code sandbox of the math-with-code environment, attacked: fork bombs, infinite loops,
huge outputs, files outside its folder, sockets, memory. Each attack must fail or be cut off,
and nothing may survive a run. ``guard=False`` runs test the OS layers alone."""

from __future__ import annotations

import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from opentinker.env_server import serve
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.games.sandbox import SandboxLimits, isolation, run_python
from opentinker.services.envhub.games.sandbox_root import python_roots

pytestmark = pytest.mark.integration

FAST = SandboxLimits(wall_time_s=3.0, cpu_time_s=2, output_bytes=4096)
needs_namespaces = pytest.mark.skipif(
    not isolation().namespaces, reason="unshare cannot create namespaces on this machine"
)
needs_own_root = pytest.mark.skipif(
    not isolation().own_root, reason="no bubblewrap (bwrap) that can make a root here"
)
needs_nobody = pytest.mark.skipif(
    not isolation().drop_to_nobody, reason="not root, or no setpriv: runs as the caller"
)


def sandbox_processes() -> list[str]:
    """Command lines of processes still running sandboxed code."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "opentinker-sandbox-" in cmdline:
            found.append(cmdline)
    return found


def test_plain_code_runs_in_a_fresh_folder_that_is_removed_after() -> None:
    result = run_python("import os, math\nprint(os.getcwd())\nprint(math.factorial(10))")
    folder, value = result.output.split()
    assert result.ok and value == "3628800"
    assert "opentinker-sandbox-" in folder and not Path(folder).exists()


def test_an_error_shows_the_models_own_traceback() -> None:
    result = run_python("x = 1\ny = x / 0\n")
    assert result.exit_code == 1 and not result.ok
    assert "line 2, in <module>" in result.output and "ZeroDivisionError" in result.output
    assert "sandbox_guard" not in result.output  # the guard's frames are hidden


def test_an_infinite_loop_hits_the_cpu_limit() -> None:
    started = time.monotonic()
    result = run_python("while True:\n    pass\n", limits=FAST)
    assert time.monotonic() - started < FAST.wall_time_s + 1
    assert not result.ok
    assert "CPU time limit exceeded" in result.output or result.timed_out


def test_a_sleeping_program_is_killed_by_the_wall_clock() -> None:
    started = time.monotonic()
    result = run_python("import time\ntime.sleep(60)\n", limits=FAST)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - started < FAST.wall_time_s + 1.5


def test_a_fork_bomb_is_refused() -> None:
    result = run_python("import os\nwhile True:\n    os.fork()\n", limits=FAST)
    assert "os.fork is not allowed" in result.output
    assert sandbox_processes() == []


@needs_nobody
def test_a_fork_bomb_past_the_guard_is_bounded_and_leaves_nothing_behind() -> None:
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    started = time.monotonic()
    result = run_python(code, limits=FAST, guard=False)
    assert time.monotonic() - started < FAST.wall_time_s + 2
    assert not result.ok
    time.sleep(0.2)
    assert sandbox_processes() == []


@needs_namespaces
def test_a_child_that_leaves_the_process_group_dies_with_the_sandbox() -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()  # out of the process group that killpg reaches\n"
        "    time.sleep(60)\n"
        "print('parent exits')\n"
    )
    result = run_python(code, limits=FAST, guard=False)
    assert "parent exits" in result.output
    time.sleep(0.2)
    assert sandbox_processes() == []  # the PID namespace took it down


@pytest.mark.parametrize("code", ["print('x' * 10**8)", "while True:\n    print('y' * 1000)\n"])
def test_huge_output_is_cut_at_the_limit_and_the_run_killed(code: str) -> None:
    started = time.monotonic()
    result = run_python(code, limits=FAST)
    assert result.output_truncated and not result.ok
    assert len(result.output.encode()) == FAST.output_bytes
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize("guard", [True, pytest.param(False, marks=needs_nobody)])
def test_files_outside_the_folder_cannot_be_read(tmp_path: Path, guard: bool) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the-secret-value")
    secret.chmod(0o600)
    result = run_python(f"print(open({str(secret)!r}).read())", limits=FAST, guard=guard)
    assert "the-secret-value" not in result.output
    # Refused by the guard or by the sandbox's user; not even there in a root of its own
    assert "PermissionError" in result.output or "FileNotFoundError" in result.output


@pytest.mark.parametrize("guard", [True, pytest.param(False, marks=needs_own_root)])
def test_the_services_folders_cannot_be_listed(tmp_path: Path, guard: bool) -> None:
    """Code run through code_math listed the jobs root and the checkpoint root: every
    tenant's job ids (then usable in a spec's paths). Its own folder is all it sees."""
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "job-0123456789ab").mkdir(parents=True)
    code = f"import os\nprint(os.listdir('.'))\nprint(os.listdir({str(checkpoints)!r}))\n"
    result = run_python(code, limits=FAST, guard=guard)
    assert result.output.startswith("['cell.py']\n"), result.output
    assert "job-0123456789ab" not in result.output
    assert "PermissionError" in result.output or "FileNotFoundError" in result.output


@needs_own_root
def test_a_root_of_its_own_holds_only_the_system_python_and_its_folder() -> None:
    code = "import os, sys\nprint(sorted(os.listdir('/')))\nprint(os.listdir('/tmp'))\n"
    result = run_python(code, limits=FAST, guard=False)
    top, tmp = (eval(line) for line in result.output.splitlines())  # noqa: S307 - our output
    assert set(top) <= {
        "bin",
        "sbin",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "usr",
        "dev",
        "proc",
        *(Path(p).parts[1] for p in (*python_roots(), "/tmp")),
    }
    runs = [name for name in tmp if name.startswith("opentinker-sandbox-")]
    assert len(runs) == 1  # its own folder, no other run's
    # Anything else in /tmp is on the way to Python's installation (a venv under /tmp)
    bound = {Path(p).parts[2] for p in python_roots() if Path(p).is_relative_to("/tmp")}
    assert set(tmp) - set(runs) <= bound, tmp


def test_files_outside_the_folder_cannot_be_written_and_inside_can(tmp_path: Path) -> None:
    target = tmp_path / "planted.txt"
    code = (
        "open('mine.txt', 'w').write('ok')\n"
        "print(open('mine.txt').read())\n"
        f"open({str(target)!r}, 'w').write('pwned')\n"
    )
    result = run_python(code, limits=FAST)
    assert result.output.startswith("ok\n") and "PermissionError" in result.output
    assert not target.exists()


@pytest.mark.parametrize("guard", [True, pytest.param(False, marks=needs_namespaces)])
def test_sockets_cannot_reach_the_host(guard: bool) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.1)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        result = run_python(code, limits=FAST, guard=guard)
        assert result.exit_code != 0
        assert ("socket.__new__ is not allowed" in result.output) is guard
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing ever connected


def test_memory_is_limited() -> None:
    result = run_python("block = bytearray(4 * 1024**3)\n", limits=FAST)
    assert "MemoryError" in result.output


def test_native_code_through_ctypes_is_refused() -> None:
    result = run_python("import ctypes\nctypes.CDLL(None).system(b'id')\n", limits=FAST)
    assert "ctypes.dlsym is not allowed" in result.output


def test_numpy_and_sympy_still_work() -> None:
    code = "import numpy, sympy\nprint(numpy.arange(4).sum(), sympy.Rational(1, 3) + 1 / 6)"
    result = run_python(code, limits=SandboxLimits(wall_time_s=20, cpu_time_s=15))
    assert result.ok, result.output
    assert result.output.split() == ["6", "0.500000000000000"]


def test_the_sandboxed_environment_has_no_inherited_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENTINKER_API_KEY", "sk-secret")
    result = run_python("import os\nprint(sorted(os.environ))", limits=FAST)
    assert "OPENTINKER_API_KEY" not in result.output and result.ok


def test_nothing_is_left_running_after_all_attacks() -> None:
    assert os.path.exists("/proc") and sandbox_processes() == []


class _RunsCode(AbstractGame):
    """Each step runs the action as a sandboxed program, inside a gRPC server's thread."""

    name = "runs-code"

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        return "go"

    def step(self, action: str) -> StepResult:
        result = run_python(action, limits=FAST)
        return StepResult(observation=result.output, reward=float(result.ok), done=False)


def test_runs_from_a_grpc_servers_threads_while_other_calls_are_in_flight() -> None:
    # Forking with a preexec_fn from a threaded gRPC process crashed the child (SIGSEGV);
    # the limits are therefore set by prlimit, and this is what an env server does.
    handle = serve(_RunsCode, block=False)
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            for n in range(4):
                stub.Reset(env_pb.ResetRequest(episode_id=f"e{n}"), timeout=5)

            def play(n: int) -> tuple[str, float]:
                action = f"print({n} * 7)"
                request = env_pb.StepRequest(episode_id=f"e{n}", action=action)
                reply = stub.Step(request, timeout=10)
                return reply.observation, reply.reward

            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(play, range(4)))
    finally:
        handle.stop(grace_s=0)
    assert replies == [(f"{n * 7}\n", 1.0) for n in range(4)]


@needs_nobody
def test_the_sandbox_runs_from_a_checkout_its_user_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The project cloned under a 0700 folder (as /root is): the sandbox module and its guard
    live where ``nobody`` cannot read, and the run must not need to."""
    import importlib.util

    import opentinker.services.envhub.games.sandbox as sandbox

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    for name in ("sandbox.py", "sandbox_guard.py"):
        (private / name).write_bytes(Path(sandbox.__file__).with_name(name).read_bytes())
    spec = importlib.util.spec_from_file_location("private_sandbox", private / "sandbox.py")
    assert spec is not None and spec.loader is not None
    moved = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, moved)  # its dataclasses look themselves up
    spec.loader.exec_module(moved)
    result = moved.run_python("print(6 * 7)\nopen('/etc/hostname').read()\n", limits=FAST)
    assert result.output.startswith("42\n"), result.output  # it ran, guarded:
    assert "sandbox: opening /etc/hostname is not allowed" in result.output
