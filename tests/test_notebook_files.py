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
        assert cell.source.startswith("# Colab only"), f"{path.name}: no Colab cell"
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
