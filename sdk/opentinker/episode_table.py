"""The live episodes of one environment server: one game instance per ``episode_id``.

- ``reset`` of an id that is still live replaces that episode (the old game is closed), so a
  retried Reset never fails.
- ``step`` of an unknown (never reset, closed, reaped or failed) episode is ``NotFoundError``; a
  step after ``done`` is ``FailedPreconditionError``.
- A game may raise a typed ``OpenTinkerError`` (e.g. ``UnavailableError`` when a backend it
  wraps is unreachable) to choose the status code itself; it passes through unchanged.
- Any other exception inside the game, or a malformed ``StepResult`` (non-finite reward, non-str
  observation), is ``EnvironmentError_`` naming the environment and the exception, and drops
  the episode. Bad reset options (``ValueError``/``TypeError`` from ``reset``) are
  ``InvalidArgumentError``.
- An observation longer than ``max_observation_chars`` is never sent: it is an
  ``EnvironmentError_`` (reason ``OBSERVATION_TOO_LARGE``) naming the environment and the size,
  and drops the episode.
- ``capacity`` live episodes at most (``ResourceExhaustedError`` beyond; 0 = unlimited);
  ``reap_idle`` frees episodes unused for ``idle_timeout_s``.

Knows nothing of gRPC. Thread-safe: different episodes step concurrently, the calls of one
episode one at a time.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from opentinker.errors import (
    EnvironmentError_,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
    ResourceExhaustedError,
)
from opentinker.game import AbstractGame, Image, StepResult, first_user_message

GameFactory = Callable[[], AbstractGame]
DEFAULT_MAX_OBSERVATION_CHARS = 16384
_T = TypeVar("_T")

log = structlog.get_logger("opentinker.env_server")


@dataclass
class _Episode:
    game: AbstractGame
    last_used_s: float  # time.monotonic() of the last call
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class EpisodeTable:
    """The live episodes of one environment: builds, steps, validates and frees games."""

    def __init__(
        self,
        game_factory: GameFactory,
        *,
        env_name: str,
        capacity: int,
        idle_timeout_s: float,
        max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS,
    ) -> None:
        """max_observation_chars: the longest observation sent (characters); 0 = no limit."""
        self._factory = game_factory
        self.env_name = env_name
        self._capacity = capacity
        self.idle_timeout_s = idle_timeout_s
        self.max_observation_chars = max_observation_chars
        self._episodes: dict[str, _Episode] = {}
        self._starting = 0  # resets building their game: each holds a slot of the capacity
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._episodes)

    def reset(self, episode_id: str, seed: int, options: dict[str, str]) -> tuple[str, str]:
        """Start (or restart) an episode; returns (system_prompt, first user message)."""
        if not episode_id:
            raise InvalidArgumentError("episode_id is empty; name every episode", reason="NO_ID")
        if "seed" in options:
            raise InvalidArgumentError(
                f"env option 'seed' is reserved in environment '{self.env_name}'; "
                "set the job's seed instead",
                reason="BAD_OPTIONS",
            )
        self.close(episode_id)  # a repeated Reset replaces the episode
        with self._lock:  # a slot is held from here, so resets arriving together count
            if 0 < self._capacity <= len(self._episodes) + self._starting:
                raise ResourceExhaustedError(
                    f"environment '{self.env_name}' already runs {self._capacity} episodes "
                    "(its capacity); close finished episodes or start another instance",
                    reason="AT_CAPACITY",
                )
            self._starting += 1
        try:
            game, system_prompt, first_message = self._start_game(seed, options)
        except BaseException:
            with self._lock:
                self._starting -= 1
            raise
        with self._lock:
            self._starting -= 1
            replaced = self._episodes.get(episode_id)
            self._episodes[episode_id] = _Episode(game=game, last_used_s=time.monotonic())
        if replaced is not None:  # a concurrent Reset of the same id got there first
            close_quietly(replaced.game)
        return system_prompt, first_message

    def _start_game(self, seed: int, options: dict[str, str]) -> tuple[AbstractGame, str, str]:
        """A new game, reset and checked: (game, system prompt, first user message)."""
        game = self._call("build a game", self._factory)
        try:
            observation = game.reset(seed=seed, **options)
        except (ValueError, TypeError) as exc:  # ConfigError too: bad options, whoever says so
            close_quietly(game)
            raise InvalidArgumentError(
                f"environment '{self.env_name}' rejected the reset (seed={seed}, "
                f"options={options}): {type(exc).__name__}: {exc}",
                reason="BAD_OPTIONS",
            ) from exc
        except OpenTinkerError:  # the game chose its status code (e.g. UnavailableError)
            close_quietly(game)
            raise
        except Exception as exc:
            close_quietly(game)
            raise self._game_error("reset", exc) from exc
        try:
            system_prompt = self._call("get_system_prompt", game.get_system_prompt)
            intro = self._call("get_initial_user_message", game.get_initial_user_message)
            for what, value in (
                ("reset observation", observation),
                ("system prompt", system_prompt),
                ("initial user message", intro),
            ):
                if not isinstance(value, str):
                    raise self._bad_reply(f"its {what} is {type(value).__name__}, not str")
            first_message = first_user_message(intro, observation)
            self._check_size("reset", first_message)
        except Exception:
            close_quietly(game)
            raise
        return game, system_prompt, first_message

    def initial_images(self, episode_id: str) -> tuple[Image, ...]:
        """The images of a just-reset episode's first user message (its game's hook)."""
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None:
            return ()
        images = self._call("get_initial_images", episode.game.get_initial_images)
        if not all(isinstance(image, Image) for image in images):
            raise self._bad_reply("its initial images are not all opentinker.game.Image")
        return tuple(images)

    def first_role(self, episode_id: str) -> str:
        """The role that acts first in a just-reset episode ('' for a game without roles)."""
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None or not episode.game.roles:
            return ""
        role = self._call("first_role", episode.game.first_role)
        self._check_role("first_role", role, episode.game)
        return role

    def _check_role(self, what: str, role: object, game: AbstractGame) -> None:
        names = [r.name for r in game.roles]
        if role not in names:
            raise self._bad_reply(f"its {what} is {role!r}, not one of its roles {names}")

    def step(self, episode_id: str, action: str) -> StepResult:
        """Apply an action; a game failure or malformed result drops the episode."""
        episode = self._get(episode_id)
        with episode.lock:
            if episode.done:
                raise FailedPreconditionError(
                    f"episode '{episode_id}' of environment '{self.env_name}' is already done; "
                    "reset a new episode",
                    reason="EPISODE_DONE",
                )
            try:
                result = self._validated(self._call("step", lambda: episode.game.step(action)))
                if episode.game.roles:
                    self._check_roles(result, episode.game)
            except Exception:
                self._drop(episode_id, episode)
                raise
            episode.done = result.done
            episode.last_used_s = time.monotonic()
            return result

    def close(self, episode_id: str) -> None:
        """Free an episode; harmless for an unknown one."""
        with self._lock:
            episode = self._episodes.pop(episode_id, None)
        if episode is not None:
            close_quietly(episode.game)

    def close_all(self) -> None:
        with self._lock:
            episodes, self._episodes = list(self._episodes.values()), {}
        for episode in episodes:
            close_quietly(episode.game)

    def reap_idle(self) -> list[str]:
        """Close episodes unused for longer than ``idle_timeout_s``; returns their ids."""
        cutoff = time.monotonic() - self.idle_timeout_s
        with self._lock:
            idle = [eid for eid, ep in self._episodes.items() if ep.last_used_s < cutoff]
        for episode_id in idle:
            self.close(episode_id)
        return idle

    def _drop(self, episode_id: str, episode: _Episode) -> None:
        with self._lock:
            if self._episodes.get(episode_id) is episode:
                del self._episodes[episode_id]
        close_quietly(episode.game)

    def _get(self, episode_id: str) -> _Episode:
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None:
            raise NotFoundError(
                f"environment '{self.env_name}' has no episode '{episode_id}' (never reset, "
                "closed, idle longer than "
                f"{self.idle_timeout_s:g} s, or failed); reset it first",
                reason="EPISODE_NOT_FOUND",
            )
        episode.last_used_s = time.monotonic()
        return episode

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except OpenTinkerError:  # the game chose its status code
            raise
        except Exception as exc:
            raise self._game_error(what, exc) from exc

    def _game_error(self, what: str, exc: BaseException) -> EnvironmentError_:
        return EnvironmentError_(
            f"environment '{self.env_name}' raised in {what}: {type(exc).__name__}: {exc}",
            reason="GAME_RAISED",
        )

    def _bad_reply(self, problem: str) -> EnvironmentError_:
        return EnvironmentError_(
            f"environment '{self.env_name}' replied badly: {problem}", reason="BAD_REPLY"
        )

    def _validated(self, result: object) -> StepResult:
        if not isinstance(result, StepResult):
            raise self._bad_reply(f"step returned {type(result).__name__}, not StepResult")
        if not isinstance(result.observation, str):
            raise self._bad_reply(
                f"step observation is {type(result.observation).__name__}, not str"
            )
        self._check_size("step", result.observation)
        if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
            raise self._bad_reply(f"step reward is {type(result.reward).__name__}, not a number")
        if not math.isfinite(result.reward):
            raise self._bad_reply(f"step reward is non-finite ({result.reward})")
        if not isinstance(result.done, bool):
            raise self._bad_reply(f"step done is {type(result.done).__name__}, not bool")
        if not isinstance(result.info, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in result.info.items()
        ):
            raise self._bad_reply("step info must be a dict of str to str")
        return result

    def _check_roles(self, result: StepResult, game: AbstractGame) -> None:
        """A multi-agent game's step names a declared next role (unless done) and gives
        finite rewards to declared roles only."""
        if not result.done:
            self._check_role("next_role", result.next_role, game)
        names = {r.name for r in game.roles}
        for role, reward in result.role_rewards.items():
            if role not in names:
                raise self._bad_reply(f"step role_rewards names {role!r}, not one of its roles")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise self._bad_reply(f"step role_rewards[{role!r}] is not a number")
            if not math.isfinite(reward):
                raise self._bad_reply(f"step role_rewards[{role!r}] is non-finite ({reward})")

    def _check_size(self, what: str, observation: str) -> None:
        limit = self.max_observation_chars
        if 0 < limit < len(observation):
            raise EnvironmentError_(
                f"environment '{self.env_name}' replied badly: its {what} observation is "
                f"{len(observation)} characters, more than max_observation_chars ({limit}); "
                "shorten or truncate it in the game",
                reason="OBSERVATION_TOO_LARGE",
            )


def close_quietly(game: AbstractGame) -> None:
    """Call the game's ``close`` hook; a failure there is logged, never raised."""
    try:
        game.close()
    except Exception:
        log.warning("game_close_failed", game=type(game).__name__, exc_info=True)
