"""Running tinker-cookbook recipes unchanged against the gateway, offline: the key in
TINKER_API_KEY, the tiny tokenizer registered under the recipes' model name (the gateway maps
that name to the tiny local model), and ``datasets.load_dataset`` of the hub datasets a recipe
names answered from local JSON files. Used by the tests/sessions/test_tinker_cookbook*.py modules."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import pytest
import tinker
from tinker_cookbook.tokenizer_utils import register_tokenizer, unregister_tokenizer
from tinker_gateway_helpers import QWEN
from transformers import AutoTokenizer

Loader = Callable[..., Any]  # load_dataset's other arguments -> what the recipe gets
_REAL_LOAD = datasets.load_dataset  # taken before any test patches it


@contextlib.contextmanager
def offline_recipes(
    api_key: str, model_dir: Path, patch: pytest.MonkeyPatch, loaders: dict[str, Loader]
) -> Iterator[Callable[[], int]]:
    """Inside: recipes find the key, the tokenizer and their datasets locally. Yields a
    function that closes the ServiceClients the recipes made so far (and says how many);
    ``close_after_each`` calls it after each test, and it runs again at the end, while the
    gateway still runs. The recipes leave theirs open: their sessions kept the mesh's
    slots, so a fourth recipe in one module waited for one, and their heartbeat threads logged
    connection errors for minutes once the gateway had stopped."""

    def load_local(name: str, *args: Any, **kwargs: Any) -> Any:
        if name not in loaders:
            raise KeyError(f"no local stand-in for hub dataset {name!r}; have {sorted(loaders)}")
        return loaders[name](*args, **kwargs)

    patch.setenv("TINKER_API_KEY", f"tml-{api_key}")
    patch.setattr(datasets, "load_dataset", load_local)
    register_tokenizer(QWEN, lambda: AutoTokenizer.from_pretrained(model_dir))
    made: list[tinker.ServiceClient] = []
    make = tinker.ServiceClient.__init__

    def recorded(self: tinker.ServiceClient, *args: Any, **kwargs: Any) -> None:
        make(self, *args, **kwargs)
        made.append(self)

    patch.setattr(tinker.ServiceClient, "__init__", recorded)

    def close_made() -> int:
        closing, made[:] = list(made), []
        for client in closing:
            with contextlib.suppress(Exception):
                client.close("success").result(timeout=30)
        return len(closing)

    try:
        yield close_made
    finally:
        unregister_tokenizer(QWEN)
        close_made()


def close_after_each(offline_fixture: str):
    """An autouse fixture for a module: after each test, the ServiceClients its recipe made
    are closed (the closer is what the module fixture ``offline_fixture`` yields)."""

    @pytest.fixture(autouse=True)
    def _close_recipe_clients(request: pytest.FixtureRequest) -> Iterator[None]:
        close_made = request.getfixturevalue(offline_fixture)
        yield
        close_made()

    return _close_recipe_clients


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def json_splits(**files: Path) -> datasets.DatasetDict:
    """A DatasetDict (split name -> local JSONL file), as ``load_dataset(hub_name)`` gives."""
    return _REAL_LOAD("json", data_files={k: str(v) for k, v in files.items()})


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
