"""The environments EnvHub hosts itself: each is served in-process by the SDK's ``serve`` on
its own loopback port and registered (pinned) in EnvHub's own registry. EnvHub calls them
in-process (local_envs.py); their port refuses every EnvironmentService call without the env
token ``serve`` made (env_auth.py), which only EnvHub's registry holds."""

from __future__ import annotations

from opentinker.env_server import EnvServerHandle, GameFactory, serve
from opentinker.services.envhub.games.arithmetic_env import ArithmeticGame, ArithmeticToolsGame
from opentinker.services.envhub.games.bandit_env import BanditGame
from opentinker.services.envhub.games.code_math_env import CodeMathGame
from opentinker.services.envhub.games.countdown_env import CountdownGame
from opentinker.services.envhub.games.geometry_env import GeometryGame, GeometryToolsGame
from opentinker.services.envhub.games.gomoku_env import GomokuGame
from opentinker.services.envhub.games.gomoku_selfplay import GomokuSelfPlayGame
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.envhub.games.math_env import MathGame
from opentinker.services.envhub.games.textworld_env import HouseholdGame
from opentinker.services.envhub.registry import Registry

BUILTIN_GAMES: dict[str, GameFactory] = {
    "letter": LetterGame,
    "bandit": BanditGame,
    "math": MathGame,
    "gomoku": GomokuGame,
    "gomoku_selfplay": GomokuSelfPlayGame,
    "code_math": CodeMathGame,
    "textworld": HouseholdGame,
    "geometry": GeometryGame,
    "geometry_tools": GeometryToolsGame,
    "countdown": CountdownGame,
    "arithmetic": ArithmeticGame,
    "arithmetic_tools": ArithmeticToolsGame,
}
# Hosted unless the settings say otherwise. Not ``textworld``: it needs the optional
# ``textworld`` package, and builds each new game on first use (seconds).
DEFAULT_BUILTIN_ENVS: tuple[str, ...] = (
    "letter",
    "bandit",
    "math",
    "gomoku",
    "gomoku_selfplay",
    "code_math",
    "geometry",
    "geometry_tools",
    "countdown",
    "arithmetic",
    "arithmetic_tools",
)


# Games whose Reset and Step take microseconds (letter and bandit ~5 us, gomoku_selfplay
# ~20 us; gomoku's opponent ~0.5 ms, math's grader up to 0.3 s): EnvHub calls them on its event
# loop instead of a pool thread (local_envs.py).
INLINE_BUILTINS: frozenset[str] = frozenset({"letter", "bandit", "gomoku_selfplay", "countdown"})


def start_builtin_envs(
    names: list[str], registry: Registry, *, capacity: int, max_observation_chars: int
) -> list[EnvServerHandle]:
    """Serve and register each named built-in env; returns the handles to stop at shutdown."""
    handles: list[EnvServerHandle] = []
    for name in names:
        handle = serve(
            BUILTIN_GAMES[name],
            name=name,
            capacity=capacity,
            max_observation_chars=max_observation_chars,
            block=False,
        )
        registry.register(
            name,
            handle.address,
            capacity,
            env_token=handle.env_token,
            pinned=True,
            shared=True,
        )
        handles.append(handle)
    return handles
