"""One switch picks whose code the exercise tests run: `--impl solutions` (the default, so the
suite is green) or `--impl exercises` (a learner's work, or the untouched stubs). A test
module names its exercise file in EXERCISE; the `impl` fixture imports it from there."""

import importlib

import pytest


@pytest.fixture(scope="module")
def impl(request):
    """The exercise module under test: exercises.<EXERCISE> or solutions.<EXERCISE>."""
    package = request.config.getoption("--impl")
    return importlib.import_module(f"{package}.{request.module.EXERCISE}")

