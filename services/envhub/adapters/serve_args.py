"""The command-line options both adapters share: where to listen and where to register."""

from __future__ import annotations

import argparse
from typing import Any

from opentinker.env_server import EnvServerHandle, GameFactory, serve

# How long an adapter waits for the env behind it (an OpenEnv reply, a verifiers turn) by
# default: below the rollout's 15 s deadline on EnvHub calls (RolloutSettings.env_timeout_s).
# Waiting longer gains nothing (the rollout has given up and restarted the episode elsewhere)
# and keeps a server thread, and the episode, held by a call nobody reads.
ADAPTER_TIMEOUT_S = 10.0
DEFAULT_CAPACITY = 64  # live episodes an adapter offers EnvHub when not told


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="the environment name to register")
    parser.add_argument(
        "--envhub", default=None, help="EnvHub host:port to register with (default: none)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="where to listen")
    parser.add_argument("--port", type=int, default=0, help="port to listen on; 0 = any free")
    parser.add_argument("--advertise", default=None, help="host:port EnvHub should dial")
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        help=f"live episodes at most (default {DEFAULT_CAPACITY}; the OpenEnv adapter "
        "discovers its server's limit)",
    )
    parser.add_argument(
        "--shared", action="store_true", help="offer the env to every tenant (admin key only)"
    )
    parser.add_argument("--log-level", default="INFO")


def serve_from_args(
    factory: GameFactory, args: argparse.Namespace, *, name: str, block: bool = True
) -> EnvServerHandle:
    """``serve`` the games ``factory`` builds with the options ``add_serving_args`` added
    (the API key comes from $OPENTINKER_API_KEY)."""
    options: dict[str, Any] = {
        "name": name,
        "envhub_address": args.envhub,
        "shared": args.shared,
        "host": args.host,
        "port": args.port,
        "advertise_address": args.advertise,
        "capacity": DEFAULT_CAPACITY if args.capacity is None else args.capacity,
        "block": block,
    }
    return serve(factory, **options)
