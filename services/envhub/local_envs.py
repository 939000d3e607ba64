"""Call EnvHub's own built-in environments in-process instead of over loopback gRPC.

Built-in envs live in the EnvHub process (DESIGN: EnvHub owns them) and are also served on a
port for anyone else. Routing EnvHub's own calls through that port costs two gRPC hops per
Reset/Step/Close for no isolation gain. ``LocalEnvironmentStub`` has the interface of
``EnvironmentServiceStub`` (awaitable calls, ``grpc.aio.AioRpcError`` on failure) and runs the
very same ``EnvironmentServicer`` the port serves (the env-token check of the port, which
guards it from other callers, has nothing to check here: the caller is EnvHub itself, and the
``metadata`` the router passes is ignored), on a worker thread (a blocking game never
stalls the event loop) under the same deadline. Only the transport is skipped. The stub owns a
thread pool as large as the served port's (capacity + 8): asyncio's default pool has only
min(32, cores + 4) threads, so blocking games (the sandboxed code_math env takes seconds a
step) would queue behind each other there and miss their deadlines.

A game whose calls take microseconds (``inline``: letter, bandit; builtin_envs.py) is called
on the event loop itself: the hop to a pool thread and back costs far more than the call (a
batch of 128 Reset+Step+Close through EnvHub: 30.5 ms median with the hop, 12.4 ms without,
bench/envhub_inline.py), and
128 episodes at once would wake 128 pool threads to fight over the GIL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import grpc

from opentinker.env_servicer import EnvironmentServicer
from opentinker.envhub.v1 import environment_pb2


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _LocalContext:
    """The two ServicerContext methods the servicer uses."""

    def __init__(self) -> None:
        self.trailing_metadata: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing_metadata = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Aborted(code, details)


def _rpc_error(code: grpc.StatusCode, details: str, trailing=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


class LocalEnvironmentStub:
    """``EnvironmentServiceStub`` look-alike that calls a servicer in this process."""

    def __init__(
        self, servicer: EnvironmentServicer, *, max_workers: int, inline: bool = False
    ) -> None:
        """inline: call the servicer on the event loop (no deadline: for microsecond games)."""
        self._servicer = servicer
        self._inline = inline
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="local-env")

    @property
    def inline(self) -> bool:
        """Whether calls run on the event loop (else on the pool's threads)."""
        return self._inline

    def close(self) -> None:
        """Stop the thread pool (calls in flight finish on their own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _call(self, method: Callable[[Any, Any], Any], request: Any, timeout: float | None):
        context = _LocalContext()
        loop = asyncio.get_running_loop()
        try:
            if self._inline:
                return method(request, context)
            work = loop.run_in_executor(self._pool, method, request, context)
            return await asyncio.wait_for(work, timeout)
        except TimeoutError:
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except _Aborted as err:
            raise _rpc_error(err.code, err.details, context.trailing_metadata) from None
        except Exception as err:  # a servicer bug: what the gRPC server would report
            raise _rpc_error(
                grpc.StatusCode.UNKNOWN, f"Exception calling application: {err}"
            ) from err

    # ``metadata``: the env token the router presents; in-process there is no one to check it.
    def GetEnvironmentSpec(self, request, *, timeout=None, metadata=None):  # noqa: N802
        return self._call(self._servicer.GetEnvironmentSpec, request, timeout)

    def Reset(  # noqa: N802 - stub method name
        self, request: environment_pb2.ResetRequest, *, timeout=None, metadata=None
    ):
        return self._call(self._servicer.Reset, request, timeout)

    def Step(  # noqa: N802 - stub method name
        self, request: environment_pb2.StepRequest, *, timeout=None, metadata=None
    ):
        return self._call(self._servicer.Step, request, timeout)

    def CloseEpisode(self, request, *, timeout=None, metadata=None):  # noqa: N802
        return self._call(self._servicer.CloseEpisode, request, timeout)
