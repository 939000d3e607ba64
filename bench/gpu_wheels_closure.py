"""Is the carried wheel set complete? Every requirement that a carried wheel declares (for
Python 3.12 on x86-64 Linux, extras aside) must be one of: another carried wheel (at a
version its specifier allows), a package of the GPU machine's image, or a named omission
with its reason. Run by bench/gpu_wheels.sh after the download, here, before any device time.

Why: the GPU machine has no internet, so a wheel that is missing there costs a device call to
find, one module per call. On 2026-11-26 three did (openai's httpx2, and vLLM's llguidance and
xgrammar, which vLLM 0.26 imports when the engine module loads): the list had left out
vLLM's declared dependencies by reading its imports, and openai's own were never read.

    python3 bench/gpu_wheels_closure.py .whl/dl .whl/requirements.txt  # exit 1: what is unmet
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

HERE = Path(__file__).resolve().parent

# The GPU machine's Python and platform, for requirement markers.
TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


@dataclass(frozen=True)
class Unmet:
    wheel: str
    requirement: str
    why: str

    def __str__(self) -> str:
        return f"{self.wheel} needs {self.requirement}: {self.why}"


def wheel_metadata(path: Path) -> tuple[str, Version, list[str]]:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    try:
        with zipfile.ZipFile(path) as wheel:
            names = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
            if not names:
                raise SystemExit(f"{path}: no *.dist-info/METADATA in it; download it again")
            message = Parser().parsestr(wheel.read(names[0]).decode())
    except zipfile.BadZipFile as err:
        raise SystemExit(f"{path}: not a wheel ({err}); download it again") from None
    return (
        canonicalize_name(message["Name"]),
        Version(message["Version"]),
        message.get_all("Requires-Dist") or [],
    )


def names_in(path: Path) -> dict[str, str]:
    """``name[==version]  # reason`` lines of a list file: canonical name -> reason (or '')."""
    names: dict[str, str] = {}
    for line in path.read_text().splitlines():
        entry, _, reason = line.partition("#")
        if entry.strip():
            names[canonicalize_name(Requirement(entry.strip()).name)] = reason.strip()
    return names


def unmet(
    wheels: dict[str, tuple[Version, list[str]]], image: set[str], omitted: set[str]
) -> list[Unmet]:
    """The requirements of ``wheels`` that nothing meets (see the module docstring)."""
    found = []
    for wheel, (_, requires) in sorted(wheels.items()):
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(TARGET):
                continue
            name = canonicalize_name(requirement.name)
            if name in wheels:
                version = wheels[name][0]
                if not requirement.specifier.contains(version, prereleases=True):
                    found.append(Unmet(wheel, line, f"carried at {version}"))
            elif name not in image and name not in omitted:
                found.append(Unmet(wheel, line, "not carried, not in the image, not omitted"))
    return found


def not_listed(wheels: dict[str, tuple[Version, list[str]]], listed: list[str]) -> list[str]:
    """Downloaded wheels that the list does not pin (left from an earlier list), and pins
    that no downloaded wheel is."""
    pins: dict[str, Requirement] = {
        canonicalize_name(Requirement(line).name): Requirement(line) for line in listed
    }
    stale = [
        f"{name} {version} is not pinned by the list"
        for name, (version, _) in sorted(wheels.items())
        if name not in pins or not pins[name].specifier.contains(version, prereleases=True)
    ]
    absent = [
        f"{pin} was not downloaded" for name, pin in sorted(pins.items()) if name not in wheels
    ]
    return stale + absent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", type=Path, help="the folder of downloaded wheels (.whl/dl)")
    parser.add_argument("requirements", type=Path, help="the list they were downloaded from")
    args = parser.parse_args()
    wheels = {}
    for path in sorted(args.wheels.glob("*.whl")):
        name, version, requires = wheel_metadata(path)
        if name in wheels:
            print(
                f"two versions of {name} in {args.wheels}: remove it, download again",
                file=sys.stderr,
            )
            return 1
        wheels[name] = (version, requires)
    listed = [line for line in args.requirements.read_text().splitlines() if line.strip()]
    mismatch = not_listed(wheels, listed)
    for line in mismatch:
        print(f"{line}: remove {args.wheels} and download again", file=sys.stderr)
    image = set(names_in(HERE / "gpu_image_packages.txt"))
    omitted = set(names_in(HERE / "gpu_wheels_omitted.txt"))
    problems = unmet(wheels, image, omitted)
    if mismatch:
        return 1
    for problem in problems:
        print(f"unmet: {problem}", file=sys.stderr)
    if problems:
        print(
            f"{len(problems)} unmet requirement(s): add the wheel to bench/gpu_wheels.txt, or "
            "its name and the reason to bench/gpu_wheels_omitted.txt",
            file=sys.stderr,
        )
        return 1
    print(f"closure ok: {len(wheels)} wheels; each requirement carried, in the image or omitted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
