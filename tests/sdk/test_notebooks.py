"""examples/notebooks/ run, cell by cell, in a real Jupyter kernel against a real local mesh.

The mesh is the one `opentinker up` starts (embedded Redis, scheduler, EnvHub, a worker, the
Tinker gateway in front), with the tiny model in its catalog as `tiny-qwen2`, so the notebooks'
cells run unchanged; the test hands each kernel the mesh's addresses and key through the
variables the notebooks read. One mesh serves the module's notebooks, one after another.

The notebooks are committed with the outputs of such a run (the docs show them). To refresh one
after editing it: `OPENTINKER_SAVE_NOTEBOOKS=write_an_env .venv/bin/python -m pytest -q
tests/sdk/test_notebooks.py` writes that executed notebook back, colour codes stripped (names
separated by commas; `all` for every one).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "examples" / "notebooks"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~30-60 s each here: cold job launches

nbformat = pytest.importorskip("nbformat", reason="the dev extra is not installed")
nbclient = pytest.importorskip("nbclient", reason="the dev extra is not installed")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A LocalMesh with the tiny model registered as `tiny-qwen2`, as `opentinker up` has."""
    from opentinker.services.launcher.catalog_seed import TINY_MODEL_NAME, register_local_model
    from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
    from opentinker.services.modeling.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2")
    settings = MeshSettings(run_root=tmp_path_factory.mktemp("mesh"), cpu_slots=1)
    with LocalMesh(settings) as running:
        register_local_model(
            running.scheduler_address,
            running.secrets_dir,
            model_dir,
            name=TINY_MODEL_NAME,
            description="the tiny random-init Qwen2",
        )
        yield running


@pytest.fixture(scope="module")
def gateway(mesh) -> Iterator[str]:  # noqa: ANN001 - a LocalMesh
    """The Tinker gateway as `opentinker up` serves it (no base-model names of its own: the
    catalog's names are the models); its base URL."""
    from opentinker.services.gateway.in_thread import running_gateway
    from opentinker.services.gateway.settings import GatewaySettings

    settings = GatewaySettings(
        scheduler_address=mesh.scheduler_address, port=0, checkpoint_root=mesh.checkpoint_root
    )
    with running_gateway(settings) as url:
        yield url


def run_notebook(name: str, mesh, tmp_path: Path, **env: str) -> str:  # noqa: ANN001
    """Execute examples/notebooks/<name>.ipynb against ``mesh``; what its cells printed.
    A cell that raises fails the test (nbclient's CellExecutionError names the cell)."""
    path = NOTEBOOKS / f"{name}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    kernel_env = {
        **os.environ,
        "OPENTINKER_SCHEDULER_ADDRESS": mesh.scheduler_address,
        "OPENTINKER_ENVHUB_ADDRESS": mesh.envhub_address,
        "OPENTINKER_API_KEY": mesh.api_key,
        "MPLBACKEND": "agg",  # a plot cell draws without a display
        **env,
    }
    nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute(env=kernel_env)
    streams = [
        out
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream"
    ]
    for out in streams:
        out["text"] = ANSI.sub("", out.get("text", ""))
    save = os.environ.get("OPENTINKER_SAVE_NOTEBOOKS", "").split(",")
    if name in save or "all" in save:
        nbformat.write(notebook, path)
    return "\n".join(out["text"] for out in streams)


def test_the_quickstart_notebook_trains_on_its_own_env_through_a_local_mesh(
    mesh,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    outputs = run_notebook("quickstart", mesh, tmp_path)
    assert "connected to" in outputs and "tenant 'local'" in outputs, outputs
    assert "● SUCCEEDED" in outputs, outputs
    assert "4 steps replayed" in outputs, outputs
    assert " SUCCEEDED " in outputs  # fit's answer: the job id, its state, its checkpoint


def test_the_env_notebook_serves_its_game_and_a_model_plays_it_through_envhub(
    mesh,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    outputs = run_notebook("write_an_env", mesh, tmp_path)
    # Played by hand, in process and over the wire: the bisecting player wins every episode.
    assert outputs.count("'outcome': 'win'") == 4 + 2, outputs
    assert "bad option: option high: a whole number of at least 2, not 'eight'" in outputs
    assert "INVALID_ARGUMENT" in outputs and "without the token: UNAUTHENTICATED" in outputs
    # The model's episodes, through EnvHub to the notebook's server: one row each.
    rewards = [float(r) for r in re.findall(r"^episode \d+: .* reward ([-\d.]+),", outputs, re.M)]
    assert len(rewards) == 6 and all(math.isfinite(r) and 0 <= r <= 1 for r in rewards), outputs
    assert "6 episodes, mean reward" in outputs, outputs


def test_the_session_notebook_trains_and_samples_through_the_tinker_gateway(
    mesh,  # noqa: ANN001
    gateway: str,
    tmp_path: Path,
) -> None:
    outputs = run_notebook("training_session", mesh, tmp_path, OPENTINKER_GATEWAY_URL=gateway)
    assert "serves ['tiny-qwen2']" in outputs, outputs
    losses = [
        float(x) for x in re.findall(r"^step \d+: loss ([\d.]+) per answer token", outputs, re.M)
    ]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses), outputs
    assert losses[-1] < losses[0], losses
    assert len(re.findall(r"^after [A-D]: ", outputs, re.M)) == 4, outputs
    assert re.search(r"^saved tinker://\S+/weights/letters$", outputs, re.M), outputs
    assert re.search(r"^job-\w+: SESSION job SUCCEEDED", outputs, re.M), outputs
