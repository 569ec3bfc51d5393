"""The notebooks are committed in the form JupyterLab writes, so opening one leaves it unmodified."""

from tinyllm.check import ROOT
from tinyllm.nbfiles import normalise


def test_notebooks_are_saved_as_jupyterlab_writes_them():
    for path in sorted((ROOT / "notebooks").glob("[0-9]*.ipynb")):
        text = path.read_text(encoding="utf-8")
        assert normalise(text) == text, \
            f"{path.name} would change when opened: run `python -m tinyllm.nbfiles {path.name}` (make notebooks does)"
