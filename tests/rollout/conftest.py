"""Fixtures of the rollout tests.

- ``base_engine`` (module): the random-init tiny Qwen2 in the transformers engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def base_engine(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a TransformersEngine
    """The random-init tiny Qwen2 in the transformers engine, full weights, on the CPU."""
    from opentinker.services.modeling.tiny_model import build_tiny_model
    from opentinker.services.rollout.engines.engine import TransformersEngine
    from opentinker.spec import ModelSpec

    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    return TransformersEngine.load(
        ModelSpec(base_model=str(model_dir), finetune="full"), device="cpu"
    )
