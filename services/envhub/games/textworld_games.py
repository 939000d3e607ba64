"""Household text games in the spirit of ALFWorld, generated locally with TextWorld.

A seed fixes a ``HouseholdLayout`` (plain Python: rooms in a row from west to east, furniture,
objects, the task "put the X in/on the Y", and a walkthrough that solves it). ``ensure_game``
turns a layout into an Inform 7 game compiled by TextWorld's generator (no downloads) and
keeps it in a cache folder, named by its layout parameters, so each game is built once.

Building a game costs seconds of CPU (the first one in a process much more: TextWorld loads its
grammars), holding the GIL; ``GeneratorWorker`` therefore builds games in one long-lived helper
process (``python -m opentinker.services.envhub.games.textworld_games``, JSON lines on
stdin/stdout), one at a time. The module imports ``textworld`` only when it builds a game.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAYOUT_VERSION = 1
MAX_ROOMS = 4
MAX_DISTRACTORS = 8

# Furniture per room: (name, "container" | "supporter"). Head nouns are unique across the
# house so that a command never needs the parser to ask "which one do you mean?".
FURNITURE: dict[str, tuple[tuple[str, str], ...]] = {
    "kitchen": (
        ("fridge", "container"),
        ("cupboard", "container"),
        ("countertop", "supporter"),
        ("stove", "supporter"),
    ),
    "living room": (
        ("sofa", "supporter"),
        ("armchair", "supporter"),
        ("chest", "container"),
        ("bookshelf", "supporter"),
    ),
    "bedroom": (
        ("bed", "supporter"),
        ("nightstand", "supporter"),
        ("wardrobe", "container"),
        ("drawer", "container"),
    ),
    "bathroom": (
        ("sink", "supporter"),
        ("shelf", "supporter"),
        ("hamper", "container"),
        ("bathtub", "container"),
    ),
}
OBJECTS = (
    "apple", "mug", "book", "towel", "soap", "keychain", "pen", "plate", "remote", "pillow",
    "candle", "spoon", "cellphone", "newspaper", "bowl", "watch",
)  # fmt: skip


@dataclass(frozen=True)
class Receptacle:
    """A piece of furniture that holds objects: a container (in, may be closed) or a
    supporter (on)."""

    name: str
    room: str
    container: bool
    closed: bool = False

    @property
    def preposition(self) -> str:
        return "in" if self.container else "on"


@dataclass(frozen=True)
class HouseholdLayout:
    """Everything a seed decides about one household game.

    rooms: west to east, each east of the one before. receptacles: the furniture.
    objects: (object, name of the receptacle it starts in/on). The task: move ``target`` to
    ``destination``.
    """

    seed: int
    rooms: tuple[str, ...]
    receptacles: tuple[Receptacle, ...]
    objects: tuple[tuple[str, str], ...]
    start_room: str
    target: str
    destination: str

    def receptacle(self, name: str) -> Receptacle:
        return next(r for r in self.receptacles if r.name == name)

    @property
    def task(self) -> str:
        where = self.receptacle(self.destination)
        return f"put the {self.target} {where.preposition} the {where.name}"

    @property
    def walkthrough(self) -> list[str]:
        """Commands that solve the game from the start."""
        source = self.receptacle(dict(self.objects)[self.target])
        destination = self.receptacle(self.destination)
        commands = _walk(self.rooms, self.start_room, source.room)
        if source.closed:
            commands.append(f"open {source.name}")
        commands.append(f"take {self.target} from {source.name}")
        commands += _walk(self.rooms, source.room, destination.room)
        if destination.closed:
            commands.append(f"open {destination.name}")
        verb = "insert {} into {}" if destination.container else "put {} on {}"
        commands.append(verb.format(self.target, destination.name))
        return commands


def _walk(rooms: tuple[str, ...], start: str, end: str) -> list[str]:
    steps = rooms.index(end) - rooms.index(start)
    return ["go east" if steps > 0 else "go west"] * abs(steps)


def make_layout(seed: int, *, rooms: int = 2, distractors: int = 3) -> HouseholdLayout:
    """The layout a seed gives (pure Python; the same arguments give the same layout)."""
    if not 1 <= rooms <= MAX_ROOMS or not 0 <= distractors <= MAX_DISTRACTORS:
        raise ValueError(
            f"rooms must be 1..{MAX_ROOMS} and distractors 0..{MAX_DISTRACTORS}, "
            f"got rooms={rooms}, distractors={distractors}"
        )
    rng = random.Random(seed)
    names = tuple(rng.sample(sorted(FURNITURE), rooms))
    furniture = []
    for room in names:
        for name, kind in rng.sample(FURNITURE[room], 3):
            container = kind == "container"
            furniture.append(Receptacle(name, room, container, container and rng.random() < 0.5))
    target, *others = rng.sample(OBJECTS, 1 + distractors)
    source, destination = rng.sample(furniture, 2)
    objects = [(target, source.name)] + [(o, rng.choice(furniture).name) for o in others]
    return HouseholdLayout(
        seed=seed,
        rooms=names,
        receptacles=tuple(furniture),
        objects=tuple(objects),
        start_room=rng.choice(names),
        target=target,
        destination=destination.name,
    )


def game_path(cache_dir: Path, seed: int, *, rooms: int, distractors: int) -> Path:
    """Where the compiled game of these parameters lives in the cache."""
    return cache_dir / f"household-v{LAYOUT_VERSION}-r{rooms}-d{distractors}-s{seed}.z8"


def ensure_game(cache_dir: Path, seed: int, *, rooms: int = 2, distractors: int = 3) -> Path:
    """The compiled game of these parameters, built into ``cache_dir`` unless already there.

    Safe to call from several processes at once: each builds in a private folder and moves
    the finished files in (the ``.json`` TextWorld reads beside the game first, the ``.z8``
    last), so a game file that exists is complete.
    """
    path = game_path(cache_dir, seed, rooms=rooms, distractors=distractors)
    if path.exists():
        return path
    layout = make_layout(seed, rooms=rooms, distractors=distractors)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".building-") as folder:
        built = _compile(layout, Path(folder) / path.name)
        os.replace(built.with_suffix(".json"), path.with_suffix(".json"))
        os.replace(built, path)
    return path


def _compile(layout: HouseholdLayout, path: Path) -> Path:
    import textworld
    from textworld.generator.game import Event, Quest

    options = textworld.GameOptions()
    options.seeds = layout.seed % 2**32
    maker = textworld.GameMaker(options)
    rooms = {name: maker.new_room(name) for name in layout.rooms}
    for west, east in zip(layout.rooms, layout.rooms[1:], strict=False):
        maker.connect(rooms[west].east, rooms[east].west)
    furniture = {}
    for spec in layout.receptacles:
        entity = maker.new(type="c" if spec.container else "s", name=spec.name)
        if spec.container:
            entity.add_property("closed" if spec.closed else "open")
        rooms[spec.room].add(entity)
        furniture[spec.name] = entity
    items = {}
    for name, where in layout.objects:
        items[name] = maker.new(type="o", name=name)
        furniture[where].add(items[name])
    maker.set_player(rooms[layout.start_room])
    destination = layout.receptacle(layout.destination)
    goal = maker.new_fact(
        destination.preposition, items[layout.target], furniture[destination.name]
    )
    maker.quests = [Quest(win_events=[Event(conditions={goal})], commands=layout.walkthrough)]
    game = maker.build()
    game.objective = f"Your task is to: {layout.task}."
    compile_options = textworld.GameOptions()
    compile_options.path = str(path)
    compile_options.force_recompile = True
    return Path(textworld.generator.compile_game(game, compile_options))


class GeneratorWorker:
    """Builds games in one helper process that stays warm; one request at a time.

    ``path`` returns at once for a cached game; otherwise it asks the worker (starting it on
    first use) and waits up to ``timeout_s``. A worker that dies or times out is killed and
    the next request starts a fresh one.
    """

    def __init__(self, *, timeout_s: float = 120.0) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None

    def path(self, cache_dir: Path, seed: int, *, rooms: int, distractors: int) -> Path:
        path = game_path(cache_dir, seed, rooms=rooms, distractors=distractors)
        if path.exists():
            return path
        with self._lock:  # the worker builds one game at a time; a twin request then finds it
            if path.exists():
                return path
            request = {
                "cache_dir": str(cache_dir),
                "seed": seed,
                "rooms": rooms,
                "distractors": distractors,
            }
            reply = self._ask(request)
        if "error" in reply:
            raise RuntimeError(
                f"building the TextWorld game (seed {seed}) failed: {reply['error']}"
            )
        return Path(reply["path"])

    def warm(self) -> None:
        """Start the worker now (it imports TextWorld at once), so the first game comes sooner."""
        with self._lock:
            self._running()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _ask(self, request: dict[str, object]) -> dict[str, str]:
        process = self._running()
        assert process.stdin is not None and process.stdout is not None
        ready: list[Any] = []
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], self._timeout_s)
            line = process.stdout.readline() if ready else ""
        except OSError:
            line = ""
        if not line:
            self._stop()
            what = "did not answer" if not ready else "exited"
            raise RuntimeError(
                f"the TextWorld game builder {what} within {self._timeout_s:g} s "
                f"(seed {request['seed']}); is textworld installed?"
            )
        return json.loads(line)

    def _running(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(  # noqa: S603 - our own module
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        return self._process

    def _stop(self) -> None:
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            self._process.wait()
            self._process = None


def _serve_requests() -> None:
    """The worker's loop: one JSON request per stdin line, one JSON reply per stdout line.
    It imports TextWorld at once (seconds); requests sent meanwhile wait in the pipe."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever TextWorld or Inform 7 print goes to stderr, not into the replies
    with contextlib.suppress(ImportError):  # a request then reports it
        import textworld  # noqa: F401
    for line in sys.stdin:
        request = json.loads(line)
        try:
            path = ensure_game(
                Path(request["cache_dir"]),
                int(request["seed"]),
                rooms=int(request["rooms"]),
                distractors=int(request["distractors"]),
            )
            reply = {"path": str(path)}
        except Exception as exc:  # reported to the caller, who names the game
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve_requests()
