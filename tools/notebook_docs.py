"""Render the notebooks of examples/notebooks/ as docs pages, with their saved outputs.

`tools/docs_hooks.py` adds `notebooks/<name>.md` for each `examples/notebooks/<name>.ipynb` at
build time: markdown cells as they are, code cells as Python blocks, printed output as text
blocks and PNG figures inline. The notebooks themselves are run by `tests/sdk/test_notebooks.py`.
Run by hand to see one: `.venv/bin/python tools/notebook_docs.py quickstart`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "examples" / "notebooks"


def _text(value: str | list[str]) -> str:
    return "".join(value) if isinstance(value, list) else value


def _output(out: dict) -> list[str]:
    """Markdown for one output of a code cell: printed text, or a PNG figure."""
    kind = out.get("output_type")
    if kind == "stream":
        return ["```text", _text(out.get("text", "")).rstrip(), "```", ""]
    data = out.get("data", {})
    if kind in ("display_data", "execute_result") and "image/png" in data:
        png = _text(data["image/png"]).replace("\n", "")
        return [f"![output](data:image/png;base64,{png})", ""]
    if kind == "execute_result" and "text/plain" in data:
        return ["```text", _text(data["text/plain"]).rstrip(), "```", ""]
    return []


def render(path: Path) -> str:
    """One notebook as a markdown page."""
    notebook = json.loads(path.read_text())
    out: list[str] = []
    for cell in notebook["cells"]:
        source = _text(cell.get("source", "")).rstrip()
        if cell["cell_type"] == "markdown":
            out += [source, ""]
        elif cell["cell_type"] == "code":
            out += ["```python", source, "```", ""]
            for output in cell.get("outputs", []):
                out += _output(output)
    out += [
        f'!!! note "`examples/notebooks/{path.name}`"',
        "    This page is the notebook, rendered at build time with the outputs saved in it;",
        "    open the file in Jupyter to run it against your own mesh.",
        "",
    ]
    return "\n".join(out)


def pages() -> dict[str, str]:
    """`notebooks/<name>.md` → its markdown, for every notebook."""
    return {f"notebooks/{p.stem}.md": render(p) for p in sorted(NOTEBOOKS.glob("*.ipynb"))}


if __name__ == "__main__":
    sys.stdout.write(render(NOTEBOOKS / f"{sys.argv[1]}.ipynb"))
