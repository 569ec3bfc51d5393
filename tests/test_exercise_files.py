"""Exercises - every stub keeps its solution's contract, and fails loudly until it is written;
the seams table (tinyllm/course/seams.py) names every seam, and no module imports one by name."""

import ast
import importlib
import inspect

import pytest

from tinyllm.course.check import FUNCTIONS, ROOT, exercise_files, is_untouched
from tinyllm.course.check import public_functions as defined
from tinyllm.course.seams import SEAMS, reference, seam_names

FILES = exercise_files()


def public_functions(module) -> dict:
    return {
        n: f
        for n, f in inspect.getmembers(module, inspect.isfunction)
        if f.__module__ == module.__name__ and not n.startswith("_")
    }


def test_every_exercise_of_the_table_has_its_files():
    assert sorted(FILES) == sorted(SEAMS)
    for nn, path in FILES.items():
        assert (ROOT / "solutions" / path.name).is_file()
        assert (ROOT / "tests" / "exercises" / f"test_{path.name}").is_file()


@pytest.mark.parametrize("nn", sorted(FILES))
def test_stub_and_solution_share_signatures_and_docstrings(nn):
    """Same functions, same signatures, same docstrings: only the bodies differ."""
    name = FILES[nn].stem
    stub = importlib.import_module(f"exercises.{name}")
    sol = importlib.import_module(f"solutions.{name}")
    assert stub.__doc__ == sol.__doc__, "module docstrings differ"
    fs, fo = public_functions(stub), public_functions(sol)
    assert fs.keys() == fo.keys()
    for fn in fs:
        assert inspect.signature(fs[fn]) == inspect.signature(fo[fn]), f"{fn}: signatures differ"
        assert fs[fn].__doc__ == fo[fn].__doc__, f"{fn}: docstrings differ"


@pytest.mark.parametrize("nn", sorted(FILES))
def test_the_exercise_functions_are_the_seams_of_the_table(nn):
    """The exercise writes exactly its seams, each with the reference's signature and
    docstring, so the tests can put the learner's function in its place."""
    sol = importlib.import_module(f"solutions.{FILES[nn].stem}")
    assert sorted(public_functions(sol)) == sorted(seam_names(nn))
    for name, ref in reference(nn).items():
        assert inspect.signature(ref) == inspect.signature(getattr(sol, name)), (
            f"{name}: signature differs"
        )
        assert ref.__doc__ == getattr(sol, name).__doc__, (
            f"{name}: docstring differs from the reference"
        )


@pytest.mark.parametrize("nn", sorted(FILES))
def test_the_stub_proof_sees_every_seam(nn):
    """The proof that stubs fail reads the files' source: it finds every seam, async ones too."""
    for folder in ("exercises", "solutions"):
        assert sorted(defined(ROOT / folder / FILES[nn].name)) == sorted(seam_names(nn)), folder


def test_no_module_imports_a_seam_by_name():
    """`from tinyllm.x import seam` would keep a copy that monkeypatch never replaces: the
    package calls every seam through its own module."""
    names = {name for nn in SEAMS for name in seam_names(nn)}
    found = []
    for path in sorted((ROOT / "tinyllm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                found += [
                    f"{path.name}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name in names
                ]
    assert not found, f"seams imported by name: {found}"


@pytest.mark.parametrize("nn", sorted(FILES))
def test_stubs_raise_naming_the_exercise(nn):
    """Each stub is a docstring and one raise NotImplementedError('exercise NN: ...')."""
    path = FILES[nn]
    assert is_untouched(path), f"{path.name} holds code: exercises/ must keep the stubs"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, FUNCTIONS) and not node.name.startswith("_"):
            assert f"exercise {nn}:" in ast.unparse(node.body[-1]), node.name


def test_solutions_are_not_untouched():
    """The proof's other half: a solution file is recognised as worked on."""
    for path in FILES.values():
        assert not is_untouched(ROOT / "solutions" / path.name)


LIST_CASES = """
import json, pytest
class Cases:
    def pytest_collection_modifyitems(self, items):
        for item in items:
            spec = getattr(item, "callspec", None)
            if spec is not None:
                print("CASE " + json.dumps([item.name, spec.id, list(spec.params)]))
pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/exercises"],
            plugins=[Cases()])
"""


def test_exercise_tests_are_named_in_words():
    """A learner reads a failing test by its name: a case's id says what it checks, never an
    argument's name and a number (`why3`, `lens0`) that pytest writes where it cannot name a
    value."""
    import json
    import re
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", LIST_CASES], capture_output=True, text=True, cwd=ROOT
    )
    cases = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("CASE ")]
    assert cases, done.stdout + done.stderr
    numbered = [
        name
        for name, case_id, params in cases
        if any(re.search(rf"(^|-){re.escape(p)}\d+(-|$)", case_id) for p in params)
    ]
    assert not numbered, "cases named by number: " + "; ".join(numbered)
