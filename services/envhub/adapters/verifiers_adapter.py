"""``opentinker serve verifiers-adapter --env my_module:load_environment [--env-args JSON]
[--envhub host:port]``: serve a verifiers environment as an OpenTinker environment until
SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import json
import sys

from opentinker.errors import OpenTinkerError
from opentinker.services.common.logging import configure_logging
from opentinker.services.envhub.adapters.serve_args import (
    ADAPTER_TIMEOUT_S,
    add_serving_args,
    serve_from_args,
)
from opentinker.services.envhub.adapters.verifiers04 import VerifiersVersionError

try:
    from opentinker.services.envhub.adapters.verifiers_game import (
        VerifiersGame,
        VerifiersSource,
        load_environment,
    )
except VerifiersVersionError as err:  # verifiers 0.4 installed: say what to use, no traceback
    if __name__ != "__main__":
        raise
    sys.exit(f"opentinker serve verifiers-adapter: {err}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="opentinker serve verifiers-adapter", description=__doc__)
    parser.add_argument("--env", required=True, help="module:function returning the verifiers env")
    parser.add_argument(
        "--env-args", type=json.loads, default={}, help="keyword arguments, a JSON object"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=ADAPTER_TIMEOUT_S, help="per turn of the env"
    )
    add_serving_args(parser)
    args = parser.parse_args(argv)
    if not isinstance(args.env_args, dict):
        parser.error("--env-args must be a JSON object")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    log = configure_logging("verifiers-adapter", level=args.log_level)
    try:
        env = load_environment(args.env, args.env_args)
    except OpenTinkerError as err:
        log.error("verifiers_env_unusable", env=args.env, error=err.message)
        return 2
    name = args.name or env.env_id or args.env.partition(":")[0].rsplit(".", 1)[-1]
    log.info("verifiers_loaded", env=args.env, name=name, kind=type(env).__name__)
    source = VerifiersSource(env=env, name=name, timeout_s=args.timeout_s)
    serve_from_args(lambda: VerifiersGame(source), args, name=name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
