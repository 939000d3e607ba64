"""The environment authoring API: subclass ``AbstractGame``, then ``serve`` it.

One game instance plays one episode. The env server builds a fresh instance per episode, calls
``reset`` once, then ``step`` with the model's text until a ``StepResult`` says ``done``.

Example (a data-free, single-turn game)::

    class Parity(AbstractGame):
        name = "parity"
        max_turns = 1

        def get_system_prompt(self) -> str:
            return "Answer 'even' or 'odd'."

        def generate_initial_state(self, seed: int, **options: str) -> int:
            return random.Random(seed).randrange(1000)

        def reset(self, *, seed: int = 0, **options: str) -> str:
            self.number = self.generate_initial_state(seed, **options)
            return f"Is {self.number} even or odd?"

        def step(self, action: str) -> StepResult:
            want = "even" if self.number % 2 == 0 else "odd"
            return StepResult(observation="", reward=float(action.strip() == want), done=True)
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` of a game returns.

    observation: shown to the model as the next user message (ignored once ``done``).
    reward: this step's reward; must be a finite number.
    done: the episode is over.
    info: free-form string facts for logs and metrics (e.g. ``{"target": "K"}``).
    images: images shown before ``observation`` in the next user message (vision envs).
    next_role: (a game with ``roles``) the role that acts next; ``observation`` is addressed
        to it. Ignored once ``done`` and by games without roles.
    role_rewards: (a game with ``roles``) the reward each role got from this step (a role left
        out got 0); ``reward`` should repeat the acting role's.
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, str] = field(default_factory=dict)
    images: tuple[Image, ...] = ()
    next_role: str = ""
    role_rewards: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Role:
    """One agent of a multi-agent game (self-play): its name and its own system prompt.

    name: unique in the game, letters, digits, ``_`` or ``-`` (it names a LoRA adapter).
    system_prompt: this role's system prompt; empty = the game's ``get_system_prompt()``.
    """

    name: str
    system_prompt: str = ""


@dataclass(frozen=True)
class Image:
    """An image for a vision-language model: the encoded file and its MIME type.

    data: PNG/JPEG/WebP bytes (EnvHub refuses more than 1 MiB by default).
    mime_type: ``image/png``, ``image/jpeg`` or ``image/webp``.
    """

    data: bytes
    mime_type: str = "image/png"


@dataclass(frozen=True)
class Tool:
    """A tool the model may call, described in the env's spec (``EnvironmentSpec.tools``).

    name: what the model calls it (e.g. ``python``). description: one or two sentences for the
    model. parameters: the JSON schema of its arguments (an ``{"type": "object", ...}`` dict).
    The game itself parses and runs the calls in ``step``; the spec only tells the rollout
    side (and its chat template) what exists.
    """

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})


class AbstractGame(abc.ABC):
    """One episode of an environment. Subclass it and implement the abstract methods.

    Class attributes describe the environment (its ``EnvironmentSpec``):
    name: the default registration name (``serve(name=...)`` overrides it).
    description: one line for people listing environments.
    max_turns: the game's own turn limit; a job that sets no max_turns plays up to this many
        turns (0 = none declared: the rollout allows 16). End episodes yourself (done) by it.
    tools: the tools the model may call (``Tool``); none by default.
    uses_images: observations carry images (``get_initial_images``, ``StepResult.images``).
    roles: a multi-agent game's roles (``Role``); empty (the default) = one agent, as always.
        With roles, ``reset``'s observation goes to ``first_role()`` and every ``StepResult``
        names ``next_role`` and gives ``role_rewards`` (see the environment proto's "Roles").

    Call order per episode: ``reset(seed=..., **options)``, then ``get_system_prompt()`` and
    ``get_initial_user_message()``, then ``step(action)`` until done. The first user message of
    an episode is ``first_user_message(get_initial_user_message(), reset_observation)``.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    max_turns: ClassVar[int] = 0
    tools: ClassVar[tuple[Tool, ...]] = ()
    uses_images: ClassVar[bool] = False
    roles: ClassVar[tuple[Role, ...]] = ()

    @abc.abstractmethod
    def get_system_prompt(self) -> str:
        """The system prompt of this episode (may depend on what ``reset`` chose)."""

    def get_initial_user_message(self) -> str:
        """Text put before the ``reset`` observation in the first user message; may be empty."""
        return ""

    def get_initial_images(self) -> tuple[Image, ...]:
        """Images shown before the text of the first user message (vision envs); none here."""
        return ()

    def first_role(self) -> str:
        """(Games with ``roles``) the role that acts first, after ``reset``; default the first
        declared. Games without roles return ''."""
        return self.roles[0].name if self.roles else ""

    @abc.abstractmethod
    def reset(self, *args: Any, **kwargs: Any) -> str:
        """Start the episode and return its first observation (may be empty).

        Called with keywords only: ``seed: int`` plus the job's ``env_options`` (all ``str``);
        ``*args`` is here only so that an override may name its options
        (``def reset(self, *, seed: int = 0, size: str = "3")``) and still type-check. Raise
        ``ValueError`` (or ``TypeError`` for an unknown option) to reject bad options; the
        caller then sees INVALID_ARGUMENT naming this environment.
        """

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's text for this turn."""

    def close(self) -> None:  # noqa: B027 - an optional hook, a no-op unless overridden
        """Free what the episode holds (files, subprocesses). Called once when the episode ends:
        closed by the caller, reaped when idle, failed, or replaced. Default: nothing."""

    def generate_initial_state(self, seed: int, **options: str) -> Any:
        """Optional hook for data-free environments: build a starting state from a seed alone.

        The same seed and options must give the same state (use ``random.Random(seed)``, never
        the global ``random``). The base class never calls it; call it from your ``reset``.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no generate_initial_state; implement it or build the "
            "state in reset()"
        )


def first_user_message(initial_user_message: str, reset_observation: str) -> str:
    """Join the game's intro and its reset observation with a blank line, skipping empty parts."""
    return "\n\n".join(part for part in (initial_user_message, reset_observation) if part)
