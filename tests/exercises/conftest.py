"""One switch picks whose code the exercise tests run: `--impl solutions` (the default, so the
suite is green) or `--impl exercises` (a learner's work, or the untouched stubs). A test
module names its exercise file in EXERCISE; the `impl` fixture imports it from there, and
`plug` puts its functions in place of the exercise's seams (tinyllm/course/seams.py)."""

import importlib

import pytest

from tinyllm.course import seams


@pytest.fixture(scope="module")
def impl(request):
    """The exercise module under test: exercises.<EXERCISE> or solutions.<EXERCISE>."""
    package = request.config.getoption("--impl")
    return importlib.import_module(f"{package}.{request.module.EXERCISE}")


@pytest.fixture
def plug(impl, monkeypatch, request):
    """plug() puts every seam of this exercise in place; plug("name", ...) only those named.
    The reference comes back after the test."""
    nn = request.module.EXERCISE[2:4]
    return lambda *names: seams.plug(monkeypatch, nn, impl, names or None)
