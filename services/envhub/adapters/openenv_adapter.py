"""``opentinker serve openenv-adapter --url http://host:8000 [--envhub host:port]``: serve an
OpenEnv server as an OpenTinker environment until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import sys

from opentinker.errors import OpenTinkerError
from opentinker.services.common.logging import configure_logging
from opentinker.services.envhub.adapters.openenv_game import OpenEnvGame, discover
from opentinker.services.envhub.adapters.openenv_session import discover_capacity
from opentinker.services.envhub.adapters.serve_args import (
    ADAPTER_TIMEOUT_S,
    DEFAULT_CAPACITY,
    add_serving_args,
    serve_from_args,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="opentinker serve openenv-adapter", description=__doc__)
    parser.add_argument("--url", required=True, help="the OpenEnv server's base URL")
    parser.add_argument("--max-turns", type=int, default=0, help="turn limit to declare; 0 = none")
    parser.add_argument(
        "--timeout-s", type=float, default=ADAPTER_TIMEOUT_S, help="per OpenEnv reply"
    )
    parser.add_argument("--system-prompt", default="", help="what the model is told first")
    add_serving_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    log = configure_logging("openenv-adapter", level=args.log_level)
    name = args.name or "openenv"
    try:
        target = discover(
            args.url,
            name=name,
            max_turns=args.max_turns,
            timeout_s=args.timeout_s,
            system_prompt=args.system_prompt,
        )
        if args.capacity is None:  # the server's own limit (OpenEnv's default is 1)
            args.capacity = discover_capacity(
                args.url, upto=DEFAULT_CAPACITY, timeout_s=args.timeout_s
            )
    except OpenTinkerError as err:
        log.error("openenv_unusable", url=args.url, error=err.message)
        return 2
    log.info(
        "openenv_discovered",
        url=args.url,
        mcp=target.action_format.mcp,
        tools=[tool.name for tool in target.action_format.tools],
        capacity=args.capacity,
    )
    serve_from_args(lambda: OpenEnvGame(target), args, name=name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
