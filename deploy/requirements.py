"""Print the requirements of the package and the named extras, one per line, from
pyproject.toml alone: the image installs them in a layer of its own, before our code is copied
in, so a change to our Python files rebuilds only the small layer after it. The build backend
(build-system.requires) is among them: the package then installs without build isolation,
which would download it again at every rebuild (30 s of a 58 s layer).

    python deploy/requirements.py pyproject.toml server,vllm > requirements.txt
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: str, extras: str) -> list[str]:
    with open(pyproject, "rb") as file:
        toml = tomllib.load(file)
    project, backend = toml["project"], toml.get("build-system", {}).get("requires", [])
    optional = project.get("optional-dependencies", {})
    wanted = [name.strip() for name in extras.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    extras_deps = [dep for name in wanted for dep in optional[name]]
    return list(backend) + list(project["dependencies"]) + extras_deps


if __name__ == "__main__":
    sys.stdout.write("\n".join(requirements(sys.argv[1], sys.argv[2])) + "\n")
