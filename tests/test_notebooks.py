"""examples/notebooks/ run, cell by cell, in a real Jupyter kernel against a real local mesh.

The mesh is the one `opentinker up` starts (embedded Redis, scheduler, EnvHub, a worker), with
the tiny model in its catalog as `tiny-qwen2`, so the notebook's cells run unchanged; the test
hands the kernel the mesh's addresses and key through the variables the notebook reads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "examples" / "notebooks"

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~55 s here: a cold job launch


def test_the_quickstart_notebook_trains_on_its_own_env_through_a_local_mesh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbformat = pytest.importorskip("nbformat", reason="the dev extra is not installed")
    nbclient = pytest.importorskip("nbclient", reason="the dev extra is not installed")
    from opentinker.services.launcher.catalog_seed import TINY_MODEL_NAME, register_local_model
    from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
    from opentinker.services.modeling.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path / "tiny-qwen2")
    settings = MeshSettings(run_root=tmp_path / "mesh", warm_spares=0, cpu_slots=1)
    with LocalMesh(settings) as mesh:
        register_local_model(
            mesh.scheduler_address,
            mesh.secrets_dir,
            model_dir,
            name=TINY_MODEL_NAME,
            description="the tiny random-init Qwen2",
        )
        monkeypatch.setenv("OPENTINKER_SCHEDULER_ADDRESS", mesh.scheduler_address)
        monkeypatch.setenv("OPENTINKER_ENVHUB_ADDRESS", mesh.envhub_address)
        monkeypatch.setenv("OPENTINKER_API_KEY", mesh.api_key)
        monkeypatch.setenv("MPLBACKEND", "agg")  # the plot cell draws without a display
        notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
        nbclient.NotebookClient(
            notebook,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()

    outputs = "\n".join(
        out.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream"
    )
    assert "connected to" in outputs and "tenant 'local'" in outputs, outputs
    assert "● SUCCEEDED" in outputs, outputs
    assert "4 steps replayed" in outputs, outputs
    assert " SUCCEEDED " in outputs  # fit's answer: the job id, its state, its checkpoint
