"""One switch picks whose code the exercise tests run: `--impl solutions` (the default, so the
suite is green) or `--impl exercises` (a learner's work, or the untouched stubs). A test
module names its exercise file in EXERCISE; the `impl` fixture imports it from there, and
`plug` puts its functions in place of the exercise's seams (tinyllm/course/seams.py). The engine
tests share one driver, `run_engine`: requests join between steps, the engine steps until it is
done, and a run that never ends fails in the learner's words."""

import importlib

import pytest

from tinyllm.course import seams
from tinyllm.course.check import explained


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


def run_engine(
    eng,
    reqs,
    what: str = "the engine with your functions",
    *,
    every: int = 0,
    joining=None,
    before_step=None,
    after_step=None,
    limit: int = 5_000,
    stuck: str = "a request is never admitted, or never leaves",
) -> list[int]:
    """Add reqs, step until the engine is done, and return their rids. Requests join all at
    once, or one every `every` steps, or joining(step) of them before each step; before_step
    (step, rids) and after_step(step) run around each step (an abort, a check of the books).
    An error inside is explained as `what`'s; past `limit` steps the run fails: it never ends
    because of `stuck`."""
    rids, step = [], 0
    with explained(what):
        while len(rids) < len(reqs) or eng.has_work():
            if joining is not None:
                n = joining(step)
            else:
                n = len(reqs) if every == 0 else int(step % every == 0)
            rids += [eng.add_request(r) for r in reqs[len(rids) : len(rids) + n]]
            if before_step is not None:
                before_step(step, rids)
            if eng.has_work():
                eng.step()
            step += 1
            if after_step is not None:
                after_step(step)
            assert step < limit, f"the engine never finishes: {stuck}"
    return rids
