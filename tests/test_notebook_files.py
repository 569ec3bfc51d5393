"""The notebooks are committed in the form JupyterLab writes, so opening one leaves it
unmodified."""

from tinyllm.course.check import ROOT
from tools.nbfiles import normalise


def test_notebooks_are_saved_as_jupyterlab_writes_them():
    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        text = path.read_text(encoding="utf-8")
        assert normalise(text) == text, (
            f"{path.name} would change when opened: run `python tools/nbfiles.py {path.name}` "
            "(make notebooks does)"
        )


def test_the_course_address_is_set_in_one_place(monkeypatch):
    """Every notebook opens with the Colab cell, and its REPO line comes from pyproject.toml:
    one edit there (then `python tools/nbfiles.py`) sets it in every notebook."""
    from tools import nbfiles

    assert nbfiles.course_address(), "pyproject.toml has no [project.urls] Repository"
    monkeypatch.setattr(nbfiles, "course_address", lambda: "https://example.org/fork/tinyllm")
    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        cell = nbfiles.nbformat.reads(normalise(path.read_text(encoding="utf-8")), 4).cells[1]
        assert cell.source.startswith("#@title Colab only"), f"{path.name}: no Colab cell"
        assert '    REPO = "https://example.org/fork/tinyllm"' in cell.source, path.name


def test_a_check_cell_shows_its_report_alone():
    """A notebook's check_exercise cell shows the tests' report and nothing after it (no
    value such as a bare `False` under the report)."""
    import json

    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code" and "check_exercise(" in "".join(cell["source"]):
                values = [o for o in cell["outputs"] if o["output_type"] == "execute_result"]
                assert not values, f"{path.name}: its check cell shows a value under the report"


def run_colab_cell(monkeypatch, cloned: bool, typed: str | None) -> list[str]:
    """Notebook 01's Colab cell as Colab runs it (its magics turned into Python by IPython, as
    any notebook does), with google.colab loaded, /content/tinyllm already cloned or not, and
    `typed` the answer to its question (None: it must not ask). Returns the shell commands and
    magics it ran."""
    import builtins
    import json
    import os
    import sys
    import types

    from IPython.core.inputtransformer2 import TransformerManager

    nb = json.loads((ROOT / "notebooks" / "01_kv_cache.ipynb").read_text(encoding="utf-8"))
    code = TransformerManager().transform_cell("".join(nb["cells"][1]["source"]))
    ran, names = [], {}
    shell = types.SimpleNamespace(  # IPython fills a command's {name} from the cell's names
        system=lambda cmd: ran.append(cmd.format(**names)),
        run_line_magic=lambda name, line, *_: ran.append(f"%{name} {line}"),
    )

    def asked(prompt=""):
        assert typed is not None, f"the cell asked {prompt!r} where it needs nothing"
        return typed

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(os.path, "isdir", lambda p: cloned and p == "/content/tinyllm/.git")
    monkeypatch.setattr(builtins, "input", asked)
    monkeypatch.setattr(sys, "path", list(sys.path))
    names["get_ipython"] = lambda: shell
    exec(code, names)
    return ran


def test_the_colab_cell_asks_once_for_the_address_then_needs_nothing(monkeypatch):
    """In Colab, the first notebook opened asks for the course's address (where pyproject.toml
    names none) and clones it; every later notebook of the runtime finds the clone and asks
    nothing: no notebook stops at its first cell."""
    first = run_colab_cell(monkeypatch, cloned=False, typed="https://example.org/me/tinyllm")
    assert any("git clone" in c and "https://example.org/me/tinyllm" in c for c in first), first
    later = run_colab_cell(monkeypatch, cloned=True, typed=None)
    assert not any("git clone" in c for c in later), later
    assert any(c.startswith("%pip") for c in later) and any(c.startswith("%cd") for c in later)


def saved_text(cell) -> str:
    """What a code cell's saved outputs print (text and text/plain)."""
    out = []
    for o in cell.get("outputs", []):
        out.append("".join(o.get("text", "")))
        out.append("".join(o.get("data", {}).get("text/plain", "")))
    return "".join(out)


def test_prose_cites_only_the_saved_run():
    """A sentence that speaks of "the saved run" quotes its figures (1.07x, 0.80x, 12.4) only as
    the code cell before it printed them: prose written for another run, or another CPU, fails
    here until it is rewritten or the notebook re-executed."""
    import json
    import re

    stale = []
    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        printed = ""
        for cell in cells:
            if cell["cell_type"] == "code":
                printed = saved_text(cell)
                continue
            text = " ".join("".join(cell["source"]).split())
            for sentence in re.split(r"(?<=[.;:])\s", text):
                if "saved run" not in sentence:
                    continue
                for figure in re.findall(r"(?<![\w.])(\d+\.\d+)x?", sentence):
                    if figure not in printed:
                        stale.append(f"{path.name}: {figure} in {sentence[:90]!r}")
    assert not stale, "figures the saved run did not print: " + "; ".join(stale)


def test_notebook_10_points_to_every_step_in_the_engines():
    """Notebook 10's reading table (where each idea lives in vLLM, SGLang and nano-vllm) has a
    row for every step that has a notebook, 01 on."""
    import json
    import re

    nb = json.loads((ROOT / "notebooks" / "10_serving.ipynb").read_text(encoding="utf-8"))
    table = next(
        "".join(c["source"]) for c in nb["cells"] if "## Where next" in "".join(c["source"])
    )
    rows = set(re.findall(r"^\| (\d\d) ", table, re.M))
    steps = {p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")} - {"00"}
    assert steps <= rows, f"steps without a row: {sorted(steps - rows)}"
