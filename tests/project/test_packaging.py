"""One distribution, importable as opentinker.*, whose SDK needs no torch; the public
surface is pinned; a wheel carries the SDK, the stubs and every service."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import opentinker

ROOT = Path(__file__).resolve().parents[2]
PYCACHE = shutil.ignore_patterns("__pycache__", "*.pyc")

PUBLIC_SURFACE = {
    "AbstractGame",
    "AdamParams",
    "Datum",
    "SessionConfig",
    "TrainingSession",
    "AuthenticationError",
    "Client",
    "ConfigError",
    "EnvServerHandle",
    "FailedPreconditionError",
    "InferenceConfig",
    "InvalidArgumentError",
    "JobEvent",
    "JobFailedError",
    "JobInfo",
    "JobSpec",
    "LoraConfig",
    "ModelInfo",
    "ModelSpec",
    "NotFoundError",
    "OpenTinkerError",
    "ResourceExhaustedError",
    "Role",
    "RlConfig",
    "SamplingParams",
    "SftConfig",
    "StepResult",
    "Tool",
    "UnavailableError",
    "serve",
}


@pytest.mark.unit
def test_public_surface_is_pinned() -> None:
    assert set(opentinker.__all__) == PUBLIC_SURFACE
    for name in opentinker.__all__:
        assert getattr(opentinker, name) is not None


@pytest.mark.unit
def test_sdk_imports_without_torch_or_server_packages() -> None:
    code = (
        "import sys, opentinker, opentinker.cli, opentinker.scheduler.v1.scheduler_pb2_grpc;"
        "names = ('torch', 'transformers', 'peft', 'redis', 'vllm');"
        "heavy = sorted(m for m in names if m in sys.modules);"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "", f"import opentinker pulled in: {out.stdout.strip()}"


@pytest.mark.unit
def test_errors_are_typed_and_picklable() -> None:
    import pickle

    err = opentinker.NotFoundError("job 'x' not found", code="NOT_FOUND", reason="JOB_NOT_FOUND")
    assert isinstance(err, LookupError) and isinstance(err, opentinker.OpenTinkerError)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.message, back.code, back.reason) == (
        type(err),
        err.message,
        err.code,
        err.reason,
    )


@pytest.mark.integration
def test_wheel_holds_sdk_stubs_and_services(tmp_path: Path) -> None:
    # Built from what the image's Dockerfile copies, as the image builds it (and away from the
    # checkout's build/, whose stale files setuptools would pack too).
    source = tmp_path / "source"
    source.mkdir()
    for name in dockerfile_copies():
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=PYCACHE)
        else:  # a file COPYed into the work dir lands there by its base name
            shutil.copy(ROOT / name, source / Path(name).name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("opentinker-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "opentinker/__init__.py",
        "opentinker/scheduler/v1/scheduler_pb2.py",
        "opentinker/scheduler/v1/scheduler_pb2.pyi",
        "opentinker/envhub/v1/environment_pb2_grpc.py",
        "opentinker/services/scheduler/__main__.py",
        "opentinker/services/trainer/__main__.py",
        "opentinker/services/rollout/__main__.py",
        "opentinker/services/envhub/__main__.py",
        "opentinker/services/worker/__main__.py",
        "opentinker/services/common/grpc_server.py",
        "opentinker/services/modeling/tiny_model.py",
    ):
        assert expected in names, f"{expected} missing from {wheel.name}"
    # Every source file, subpackages and package data included: a package missing from
    # pyproject's list is absent from the wheel, and so from the image and the GPU check.
    packed = {name for name in names if ".dist-info/" not in name}
    missing, extra = sorted(source_modules() - packed), sorted(packed - source_modules())
    assert not missing, f"in the checkout but not in {wheel.name}: {missing}"
    assert not extra, f"in {wheel.name} but not in the checkout: {extra}"
    # Installed on its own (no editable finder), the services import as opentinker.services.*.
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    code = (
        "import opentinker, opentinker.services.common.launch as m;"
        "print(opentinker.__file__); print(m.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert all(line.startswith(str(target)) for line in out.stdout.split()), out.stdout


def source_modules() -> set[str]:
    """The wheel names of every file in the checkout's SDK and services: modules, stubs'
    .pyi, the dashboard's templates (pyproject's package-dir: sdk/opentinker -> opentinker,
    services/X -> opentinker/services/X)."""
    roots = {ROOT / "sdk" / "opentinker": "opentinker"}
    for service in (ROOT / "services").iterdir():
        if (service / "__init__.py").exists():
            roots[service] = f"opentinker/services/{service.name}"
    return {
        f"{prefix}/{path.relative_to(root).as_posix()}"
        for root, prefix in roots.items()
        for path in root.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def dockerfile_copies() -> list[str]:
    """What deploy/Dockerfile's COPY lines take from the checkout (all but each line's last
    word, the destination)."""
    lines = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    copies = [word for line in lines if line.startswith("COPY ") for word in line.split()[1:-1]]
    assert copies, "deploy/Dockerfile copies nothing"
    return copies
