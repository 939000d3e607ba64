"""The tinker-cookbook conformance table of the Tinker gateway (issue 33), produced from the
installed cookbook's source and the gateway's own served set, not written by hand.

For each recipe family it reads the recipe's Python files and finds what the gateway must
serve for it: the third-party packages it imports (installed here or not), image chunks
(vision models), the Tinker losses it names, the hub datasets it loads. A family is then
- "runs (tested)" when a test in tests/ runs it against a real gateway (TESTED below),
- "not supported" when it needs something not served or not installed (the reason given),
- "should run, with local stand-ins" when it only loads hub datasets (offline machines
  need local files: the cookbook's builders take them), or "should run unchanged" otherwise;
  those two are not run by a test yet.

Run: ``.venv/bin/python tools/cookbook_conformance.py`` (markdown on stdout).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import tinker_cookbook

from opentinker.services.gateway.wire import SUPPORTED_LOSSES

RECIPES = Path(tinker_cookbook.__file__).parent / "recipes"
FAMILIES = {  # the families -> their files under tinker_cookbook/recipes
    "sl_basic": ["sl_basic.py"],
    "chat_sl": ["chat_sl"],
    "rl_basic / rl_loop": ["rl_basic.py", "rl_loop.py"],
    "math_rl": ["math_rl"],
    "preference / DPO": ["preference"],
    "distillation": ["distillation"],
    "multiplayer_rl": ["multiplayer_rl"],
    "verifiers_rl": ["verifiers_rl"],
    "vlm_classifier": ["vlm_classifier"],
    "prompt_distillation": ["prompt_distillation"],
    "code_rl": ["code_rl"],
    "search_tool": ["search_tool"],
}
# Families a test runs against a real gateway, and the test.
TESTED = {
    "rl_basic / rl_loop": "rl_loop, unchanged: tests/sessions/test_tinker_cookbook.py",
    "sl_basic": "sl_loop (sl_basic's loop written out), unchanged:"
    " tests/sessions/test_tinker_cookbook.py",
    "chat_sl": "chat_sl (chat_sl/train.py on no_robots, local stand-in rows), unchanged:"
    " tests/sessions/test_tinker_cookbook.py",
    "math_rl": "math_rl (math_rl/train.py, arithmetic env), unchanged; the hub-data envs"
    " (gsm8k, MATH, polaris, deepmath) share its loop, not run:"
    " tests/sessions/test_tinker_cookbook.py",
    "distillation": "on_policy_distillation (deepmath prompts, local stand-in rows; teacher"
    " a base-model sampler), unchanged; the other distillation scripts are not run:"
    " tests/sessions/test_tinker_cookbook_distillation.py",
    "preference / DPO": "dpo (preference/dpo/train.py on hhh, local stand-in rows), unchanged;"
    " its loss leaves ln 2 (the reference sampler stays the initial snapshot):"
    " tests/sessions/test_tinker_cookbook_dpo.py",
}
TINKER_LOSSES = {
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "gspo",
    "dro",
    "stable_reinforce",
}
_DATASET = re.compile(r"load_dataset\(\s*[\"']([\w./-]+)[\"']")
_OURS = {"tinker", "tinker_cookbook"}


@dataclass(frozen=True)
class Row:
    family: str
    status: str
    why: str


def sources(family: str) -> list[Path]:
    found: list[Path] = []
    for name in FAMILIES[family]:
        path = RECIPES / name
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return found


def missing_packages(files: list[Path]) -> list[str]:
    """Top-level packages the files import that are not installed here."""
    names: set[str] = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    names -= _OURS | set(sys.stdlib_module_names)
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


def row(family: str) -> Row:
    files = sources(family)
    text = "\n".join(f.read_text() for f in files)
    losses = {name for name in TINKER_LOSSES if f'"{name}"' in text}
    unserved = sorted(losses - set(SUPPORTED_LOSSES))
    missing = missing_packages(files)
    datasets = sorted(set(_DATASET.findall(text)))
    if family in TESTED:
        return Row(family, "runs (tested)", TESTED[family])
    if "ImageChunk" in text or "image_processor" in text:
        return Row(
            family,
            "not supported",
            "image chunks (vision models): the gateway serves token chunks only",
        )
    if unserved:
        return Row(family, "not supported", f"losses not served: {unserved}")
    if missing:
        served = _parts_without_missing(family)
        if not served:
            return Row(
                family,
                "not supported here",
                f"needs {', '.join(missing)} (not "
                "installed on this pool; install it beside the cookbook)",
            )
        return Row(
            family,
            "should run in part",
            f"not run by a test yet; {', '.join(served)} "
            f"import nothing missing; the rest needs {', '.join(missing)}",
        )
    if datasets:
        return Row(
            family,
            "should run, with local stand-ins",
            "not run by a test yet; hub "
            f"datasets {', '.join(datasets[:3])}{' ...' if len(datasets) > 3 else ''} "
            "need local files offline",
        )
    return Row(family, "should run unchanged", "not run by a test yet; uses only served calls")


def _parts_without_missing(family: str) -> list[str]:
    """The sub-recipes (folders with a train.py) of a family that import nothing missing."""
    parts = [
        train.parent
        for name in FAMILIES[family]
        for train in sorted((RECIPES / name).glob("*/train.py"))
    ]
    return [p.name for p in parts if not missing_packages(sorted(p.rglob("*.py")))]


def table() -> list[Row]:
    return [row(family) for family in FAMILIES]


def markdown(rows: list[Row]) -> str:
    lines = ["| recipe family | status | why |", "| --- | --- | --- |"]
    lines += [f"| {r.family} | {r.status} | {r.why} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown(table()) + "\n")
