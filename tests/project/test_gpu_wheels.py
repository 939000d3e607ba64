"""bench/gpu_wheels_closure.py: the wheels carried to the GPU machine (no internet there) are
checked complete here, before any device time. Wheels built in the test with only METADATA."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
BENCH = Path(__file__).resolve().parents[2] / "bench"


def wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {line}\n" for line in requires)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", metadata)


def closure(folder: Path, *pins: str) -> subprocess.CompletedProcess:
    listed = folder.parent / "requirements.txt"
    listed.write_text("".join(f"{pin}\n" for pin in pins))
    command = [sys.executable, str(BENCH / "gpu_wheels_closure.py"), str(folder), str(listed)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_every_requirement_must_be_carried_in_the_image_or_omitted(tmp_path: Path) -> None:
    dl = tmp_path / "dl"
    dl.mkdir()
    wheel(dl, "vllm", "0.26.0", "openai>=2", "torch==2.11.0", "flashinfer-python==0.6.14",
          "pywin32; sys_platform == 'win32'", "rich; extra == 'cli'")  # fmt: skip
    wheel(dl, "openai", "3.57.0", "httpx2<3,>=2.12")
    out = closure(dl, "vllm==0.26.0", "openai==3.57.0")
    # torch is the image's, flashinfer is omitted with its reason, the marked ones do not apply
    assert out.returncode == 1, out.stdout + out.stderr
    assert "openai needs httpx2<3,>=2.12: not carried, not in the image, not omitted" in out.stderr
    assert out.stderr.count("needs") == 1, out.stderr

    wheel(dl, "httpx2", "2.11.0")  # carried, but at a version the specifier excludes
    out = closure(dl, "vllm==0.26.0", "openai==3.57.0", "httpx2==2.11.0")
    assert out.returncode == 1 and "openai needs httpx2<3,>=2.12: carried at 2.11.0" in out.stderr

    (dl / "httpx2-2.11.0-py3-none-any.whl").unlink()
    wheel(dl, "httpx2", "2.16.2")
    out = closure(dl, "vllm==0.26.0", "openai==3.57.0", "httpx2==2.16.2")
    assert out.returncode == 0, out.stderr
    assert "closure ok: 3 wheels" in out.stdout


def test_a_broken_download_is_named(tmp_path: Path) -> None:
    dl = tmp_path / "dl"
    dl.mkdir()
    (dl / "lark-1.2.2-py3-none-any.whl").write_bytes(b"<html>proxy error</html>")
    out = closure(dl, "lark==1.2.2")
    assert out.returncode == 1
    assert "lark-1.2.2-py3-none-any.whl: not a wheel" in out.stderr, out.stderr


def test_a_wheel_left_from_an_earlier_list_or_a_pin_not_downloaded_fails(tmp_path: Path) -> None:
    dl = tmp_path / "dl"
    dl.mkdir()
    wheel(dl, "lark", "1.2.2")
    wheel(dl, "jiter", "0.19.0")  # an earlier list's, would travel to the machine unlisted
    out = closure(dl, "lark==1.2.2", "pyzmq==27.3.0")
    assert out.returncode == 1
    assert "jiter 0.19.0 is not pinned by the list" in out.stderr, out.stderr
    assert "pyzmq==27.3.0 was not downloaded" in out.stderr, out.stderr


def test_the_lists_agree_with_each_other() -> None:
    """A name both carried and omitted, or omitted though the image has it, is a mistake."""
    spec = importlib.util.spec_from_file_location("closure", BENCH / "gpu_wheels_closure.py")
    assert spec is not None and spec.loader is not None
    closure = importlib.util.module_from_spec(spec)
    sys.modules["closure"] = closure  # its dataclass looks itself up there
    spec.loader.exec_module(closure)
    carried = set(closure.names_in(BENCH / "gpu_wheels.txt"))
    image = set(closure.names_in(BENCH / "gpu_image_packages.txt"))
    omitted = closure.names_in(BENCH / "gpu_wheels_omitted.txt")
    assert {"vllm", "httpx2", "xgrammar", "llguidance"} <= carried
    assert {"torch", "transformers", "peft"} <= image
    assert not carried & set(omitted), carried & set(omitted)
    assert not image & set(omitted), image & set(omitted)
    assert all(omitted.values()), [name for name, why in omitted.items() if not why]


def test_the_import_check_names_every_missing_module_in_one_go(tmp_path: Path) -> None:
    """On the GPU machine each missing wheel cost a call when imports stopped at the first."""
    (tmp_path / "needs_three.py").write_text(
        "import json\nimport gone_one\nfrom gone_two.sub import Thing\nimport gone_three\n\n"
        "class Grammar:\n    matcher: gone_three.Matcher  # evaluated at import, as vLLM's are\n"
    )
    (tmp_path / "fine.py").write_text("import json\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, str(BENCH / "gpu_imports.py")]
    out = subprocess.run([*command, "fine", "needs_three"], capture_output=True, text=True, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "missing modules: gone_one, gone_three, gone_two (first: gone_one)" in out.stdout
    assert "stopped" not in out.stdout, out.stdout  # the stand-ins carried it to the end
    fine = subprocess.run([*command, "fine"], capture_output=True, text=True, env=env)
    assert fine.returncode == 0 and "imported: fine" in fine.stdout, fine.stdout + fine.stderr
