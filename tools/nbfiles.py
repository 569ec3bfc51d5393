"""Repository tooling (not part of the package) - notebooks saved in exactly the form JupyterLab
writes, so that opening one leaves the committed file unmodified.

Opening a notebook in JupyterLab starts its kernel; JupyterLab then writes the kernel's spec into
the notebook's metadata and the next autosave writes the file back through the browser. Two
things then differ from what `jupyter nbconvert --execute` wrote: metadata.kernelspec's
display_name (JupyterLab writes the installed kernelspec's, "Python 3 (ipykernel)"), and
numbers (a browser's JSON has no integral floats: a widget state's 38.0 comes back as 38). This
module applies both, drops widget state that no output shows any more, and writes with
nbformat as the Jupyter server does. `make notebooks` runs it after re-executing.

It also writes the course's address into every notebook's Colab cell (the `REPO = ...` line),
from its one place, pyproject.toml's `[project.urls] Repository`: whoever publishes the course
(or a fork) sets it there and runs this, and no learner edits a notebook to open it in Colab.

    python tools/nbfiles.py notebooks/*.ipynb            # normalise in place
    python tools/nbfiles.py --check notebooks/*.ipynb    # exit 1 if any would change

What it cannot pin: metadata.language_info, which the kernel reports (its Python version).
"""

import re
import sys
from pathlib import Path

import nbformat

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
REPO_LINE = re.compile(r'^(    REPO = )"[^"]*"', re.M)  # in the Colab cell
COLAB_CELL = re.compile(r"#(@title)? ?Colab only")  # its first line


def course_address() -> str | None:
    """pyproject.toml's [project.urls] Repository, or None where there is no pyproject.toml
    beside the package (an installed copy)."""
    if not PYPROJECT.is_file():
        return None
    found = re.search(r'^Repository = "([^"]+)"', PYPROJECT.read_text(), re.M)
    return found.group(1) if found else None


def kernel_display_name(name: str) -> str | None:
    """The display name of the installed kernelspec `name`, or None if it is not installed."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        return KernelSpecManager().get_kernel_spec(name).display_name
    except Exception:
        return "Python 3 (ipykernel)" if name == "python3" else None


def js_numbers(x):
    """What a JSON round trip through a browser does to numbers: integral floats become ints."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    if isinstance(x, dict):
        return {k: js_numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [js_numbers(v) for v in x]
    return x


def normalise(text: str) -> str:
    nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
    spec = nb.metadata.get("kernelspec")
    if spec and spec.get("name"):
        display = kernel_display_name(spec["name"])
        if display:
            spec["display_name"] = display
    views = [
        o
        for c in nb.cells
        for o in c.get("outputs", [])
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    if "widgets" in nb.metadata and not views:
        del nb.metadata["widgets"]
    address = course_address()
    for cell in nb.cells[:2] if address else []:
        if cell.cell_type == "code" and COLAB_CELL.match(cell.source):
            cell.source = REPO_LINE.sub(lambda m: f'{m.group(1)}"{address}"', cell.source)
    nb = nbformat.from_dict(js_numbers(nb))
    out = nbformat.writes(nb, version=nbformat.NO_CONVERT)
    return out if out.endswith("\n") else out + "\n"  # nbformat.write adds the newline


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"]
    if not paths:
        print(__doc__)
        return 2
    changed = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        new = normalise(text)
        if new != text:
            changed.append(path)
            if not check:
                path.write_text(new, encoding="utf-8")
    verb = "would change" if check else "normalised"
    for path in changed:
        print(f"{verb}: {path}")
    print(
        f"{len(changed)} of {len(paths)} notebooks {verb}"
        if changed
        else f"all {len(paths)} notebooks already as JupyterLab writes them"
    )
    return 1 if (check and changed) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
