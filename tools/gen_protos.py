"""Regenerate the Python gRPC stubs (with .pyi types) from protos/ into sdk/.

Usage: python tools/gen_protos.py [--out DIR]   (default: sdk, the committed location)

The proto packages (opentinker.<svc>.v1) become the Python modules opentinker.<svc>.v1.*.
tests/project/test_protos.py runs this into a temporary folder and fails when the committed stubs
differ.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto under protos/ and return the files written."""
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    well_known = str(resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    written = []
    for proto in protos:
        stem = proto.relative_to(PROTO_ROOT).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(out_dir / f"{stem}{suffix}")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "sdk")
    written = generate(parser.parse_args().out)
    sys.stdout.write(f"generated {len(written)} files\n")


if __name__ == "__main__":
    main()
