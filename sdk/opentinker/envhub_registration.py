"""Keep an environment server registered with EnvHub, from a daemon thread.

Registers once at start (a refusal is an ``InvalidArgumentError``; an unreachable EnvHub is
retried in the background), renews on the interval EnvHub returns, registers again when EnvHub
answers NOT_FOUND (expired, or EnvHub restarted), and deregisters on ``stop``. Every call has a
deadline. Each registration carries the server's env token (env_auth.py), the same one every
time; it is never logged.
"""

from __future__ import annotations

import threading

import grpc
import structlog

from opentinker.auth import with_credential
from opentinker.envhub.v1 import envhub_pb2, envhub_pb2_grpc
from opentinker.errors import InvalidArgumentError
from opentinker.tls import ca_file_from_env, open_channel

ENVHUB_CALL_TIMEOUT_S = 5.0
_DEREGISTER_TIMEOUT_S = 2.0

log = structlog.get_logger("opentinker.env_server")


class EnvHubRegistration:
    """One env server's registration with one EnvHub."""

    def __init__(
        self,
        envhub_address: str,
        *,
        env_name: str,
        address: str,
        capacity: int,
        env_token: str,
        api_key: str = "",
        shared: bool = False,
    ) -> None:
        """``api_key``: the key EnvHub checks (the env is private to its tenant unless
        ``shared``, which needs an admin's key). ``env_token``: what EnvHub must present on
        its calls to the server (env_auth.py); the same one at every registration."""
        self._envhub_address = envhub_address
        self._request = envhub_pb2.RegisterEnvironmentRequest(
            env_name=env_name,
            address=address,
            capacity=capacity,
            shared=shared,
            env_token=env_token,
        )
        channel = open_channel(envhub_address, ca_file=ca_file_from_env(), options=[])
        self._channel = with_credential(channel, api_key)
        self._stub = envhub_pb2_grpc.EnvHubServiceStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"envhub-{env_name}", daemon=True)
        self.instance_id = ""  # '' while not registered
        self.renew_interval_s = 2.0
        self._log = log.bind(env=env_name, envhub=envhub_address)

    def start(self) -> None:
        """Register once now (UNAVAILABLE is retried in the background), then keep renewing."""
        try:
            self._register()
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._channel.close()
                raise InvalidArgumentError(
                    f"EnvHub at {self._envhub_address} refused the registration of "
                    f"'{self._request.env_name}': {err.code().name}: {err.details()}"
                ) from err
            self._log.warning("envhub_unreachable_retrying", code=err.code().name)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and deregister (best effort)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=ENVHUB_CALL_TIMEOUT_S + 1)
        if self.instance_id:
            try:
                self._stub.DeregisterEnvironment(
                    envhub_pb2.DeregisterEnvironmentRequest(instance_id=self.instance_id),
                    timeout=_DEREGISTER_TIMEOUT_S,
                )
            except grpc.RpcError as err:
                self._log.warning("deregister_failed", code=err.code().name)
        self._channel.close()

    def _register(self) -> None:
        reply = self._stub.RegisterEnvironment(self._request, timeout=ENVHUB_CALL_TIMEOUT_S)
        self.instance_id = reply.instance.instance_id
        if reply.renew_interval_s > 0:
            self.renew_interval_s = reply.renew_interval_s
        self._log.info("registered", instance_id=self.instance_id)

    def _run(self) -> None:
        while not self._stop.wait(self.renew_interval_s):
            try:
                if self.instance_id:
                    self._renew()
                if not self.instance_id:
                    self._register()
            except grpc.RpcError as err:
                self._log.warning(
                    "envhub_call_failed", code=err.code().name, registered=bool(self.instance_id)
                )

    def _renew(self) -> None:
        """Renew; a NOT_FOUND answer (expired, or EnvHub restarted) clears ``instance_id``."""
        try:
            self._stub.RenewRegistration(
                envhub_pb2.RenewRegistrationRequest(instance_id=self.instance_id),
                timeout=ENVHUB_CALL_TIMEOUT_S,
            )
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self._log.info("registration_lost_registering_again", instance_id=self.instance_id)
            self.instance_id = ""
