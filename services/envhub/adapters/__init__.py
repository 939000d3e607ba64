"""Adapters that serve environments people already have as OpenTinker environments.

- ``openenv_*``: any OpenEnv server (its WebSocket episode API), ``opentinker serve
  openenv-adapter --url http://host:8000``.
- ``verifiers_*``: a ``verifiers`` environment (the classic SingleTurnEnv / MultiTurnEnv /
  ToolEnv API), ``opentinker serve verifiers-adapter --env module:load_environment``.
- ``verifiers04*``: a verifiers 0.4 env (``vf.Env``: a Taskset and a harness) is no server but
  an agent program: ``RlConfig.agent = verifiers04_program(taskset=..., python=...)``, run per
  episode against the rollout's endpoint with the Python of the ``verifiers04`` extra's venv.

Each adapter is an ``AbstractGame`` served by the SDK's env server (``opentinker.env_server``),
so it speaks ``EnvironmentService`` and registers with EnvHub like any other environment.
Their dependencies are the ``adapters`` extra.
"""
