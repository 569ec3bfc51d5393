"""Exercises - every stub keeps its solution's contract, and fails loudly until it is written."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from tinyllm import continuous, cuda_graph, engine, kv_cache, paged_kv
from tinyllm.check import ROOT, exercise_files, is_untouched

generate_module = importlib.import_module("tinyllm.generate")
SEAMS = [kv_cache, generate_module, engine, continuous, paged_kv, cuda_graph]     # where the seams live

FILES = exercise_files()


def public_functions(module) -> dict:
    return {n: f for n, f in inspect.getmembers(module, inspect.isfunction)
            if f.__module__ == module.__name__ and not n.startswith("_")}


def test_there_are_exercises():
    assert "01" in FILES


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
def test_each_exercise_function_is_a_seam_of_the_reference(nn):
    """The reference package calls a function of the same name, signature and docstring,
    so the tests can put the learner's in its place."""
    sol = importlib.import_module(f"solutions.{FILES[nn].stem}")
    for name, fn in public_functions(sol).items():
        ref = [getattr(m, name) for m in SEAMS if hasattr(m, name)]
        assert ref, f"{name} is not a function of the reference package"
        assert inspect.signature(ref[0]) == inspect.signature(fn), f"{name}: signature differs"
        assert ref[0].__doc__ == fn.__doc__, f"{name}: docstring differs from the reference"


@pytest.mark.parametrize("nn", sorted(FILES))
def test_stubs_raise_naming_the_exercise(nn):
    """Each stub is a docstring and one raise NotImplementedError('exercise NN: ...')."""
    path = FILES[nn]
    assert is_untouched(path), f"{path.name} holds code: exercises/ must keep the stubs"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            assert f"exercise {nn}:" in ast.unparse(node.body[-1]), node.name


@pytest.mark.parametrize("nn", sorted(FILES))
def test_each_exercise_has_its_tests(nn):
    assert (ROOT / "tests" / "exercises" / f"test_{FILES[nn].name}").is_file()
    assert (ROOT / "solutions" / FILES[nn].name).is_file()


def test_solutions_are_not_untouched():
    """The proof's other half: a solution file is recognised as worked on."""
    for path in FILES.values():
        assert not is_untouched(ROOT / "solutions" / path.name)
    assert isinstance(ROOT, Path)
