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
