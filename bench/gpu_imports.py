"""Import modules as the GPU check's install step does, and on a missing module name every
missing one at once: the GPU machine has no internet, and one call per missing wheel (as on
2026-11-26: httpx2, then llguidance, then xgrammar) costs minutes of a 15-minute lease.

    python3 bench/gpu_imports.py vllm.entrypoints.llm
    opentinker.services.rollout.engines.vllm_engine

Each ModuleNotFoundError that escapes an import (one the importing code does not guard, so
certainly needed) is noted, an empty stand-in module takes that name, and the imports run
again: a module whose import failed was dropped from sys.modules by Python, those fully
imported stay. Exit 1 with every missing module named; 0 when all import.
"""

from __future__ import annotations

import importlib
import sys
import types

MISSING_LINE = "missing modules:"
MAX_MISSING = 30


class _StandIn(types.ModuleType):
    """An empty module whose every attribute is a fresh class (annotations and base classes
    evaluate; nothing real happens)."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def main() -> int:
    modules = sys.argv[1:]
    missing: list[str] = []
    while True:
        try:
            for name in modules:
                importlib.import_module(name)
            break
        except ModuleNotFoundError as err:
            if not err.name or err.name in missing or len(missing) >= MAX_MISSING:
                print(f"stopped at {err!r}; more may be missing behind it")
                break
            missing.append(err.name)
            stand_in = _StandIn(err.name)
            stand_in.__path__ = []  # a package: its submodules get stand-ins too
            sys.modules[err.name] = stand_in
        except Exception as err:  # a stand-in can break an import further on
            print(f"stopped at {type(err).__name__}: {err}; more may be missing behind it")
            break
    if missing:
        top = sorted({name.split(".")[0] for name in missing})
        print(f"{MISSING_LINE} {', '.join(top)} (first: {missing[0]})")
        return 1
    print(f"imported: {' '.join(modules)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
