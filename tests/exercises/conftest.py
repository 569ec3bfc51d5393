"""One switch picks whose code the exercise tests run: `--impl solutions` (the default, so the
suite is green) or `--impl exercises` (a learner's work, or the untouched stubs). A test
module names its exercise file in EXERCISE; the `impl` fixture imports it from there, and
`plug` puts its functions in place of the exercise's seams (tinyllm/course/seams.py). The engine
tests share one driver, `run_engine`: requests join between steps, the engine steps until it is
done, and a run that goes wrong fails as soon as it does, in the learner's words: at the first
token that leaves solo's, or after a stretch of steps in which nothing moves."""

import importlib

import pytest

from tinyllm.course import seams
from tinyllm.course.check import divergence, explained

PATIENCE = 100  # steps with work in which no request moves: the run is stuck


def pytest_make_parametrize_id(config, val, argname):
    """A case's name in words where pytest would number it (`lens0`, `names1`): a list or
    tuple as its items, a dtype by its name, a tensor as its values."""
    import torch

    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    if isinstance(val, torch.Tensor) and val.numel() <= 8:
        return ",".join(f"{x:g}" for x in val.flatten().tolist())
    if isinstance(val, (list, tuple)) and all(isinstance(x, (int, str)) for x in val):
        return ",".join(map(str, val)) or "[]"
    return None


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
    expected=None,
    limit: int = 5_000,
    stuck: str = "a request is never admitted, or never leaves",
) -> list[int]:
    """Add reqs, step until the engine is done, and return their rids. Requests join all at
    once, or one every `every` steps, or joining(step) of them before each step; before_step
    (step, rids) and after_step(step) run around each step (an abort, a check of the books).
    With `expected` (each request's solo tokens) every step's tokens are held to them, so a run
    fails at the step where a request first leaves solo. An error inside is explained as
    `what`'s; a run fails when PATIENCE steps with work move no request (no token made, no
    context computed, nothing finished), or past `limit` steps: it never ends because of
    `stuck`."""
    rids, step, still, last = [], 0, 0, None
    with explained(what):
        while len(rids) < len(reqs) or eng.has_work():
            if joining is not None:
                n = joining(step)
            else:
                n = len(reqs) if every == 0 else int(step % every == 0)
            rids += [eng.add_request(r) for r in reqs[len(rids) : len(rids) + n]]
            if before_step is not None:
                before_step(step, rids)
            worked = eng.has_work()
            if worked:
                eng.step()
            step += 1
            if after_step is not None:
                after_step(step)
            if expected is not None:
                held_to_solo(eng, rids, expected, step)
            now = moved(eng)
            still = still + 1 if worked and now == last else 0
            last = now
            assert still < PATIENCE, (
                f"the engine made no progress in {PATIENCE} steps (no token made, no prompt "
                f"computed, no request finished): {stuck}"
            )
            assert step < limit, f"the engine never finishes: {stuck}"
    return rids


def live(eng):
    """The requests the engine holds: running, then waiting."""
    return [*eng.scheduler.running.values(), *eng.scheduler.waiting]


def moved(eng) -> tuple:
    """What a step that does anything changes: the tokens made, the contexts computed, the
    requests finished."""
    seqs = live(eng)
    return (
        sum(len(s.tokens) for s in seqs),
        sum(s.num_computed_tokens for s in seqs),
        len(eng.results),
    )


def held_to_solo(eng, rids, expected, step: int) -> None:
    """Every live request's tokens so far are the start of its solo tokens."""
    index = {rid: i for i, rid in enumerate(rids)}
    for seq in live(eng):
        i = index.get(seq.rid)
        if i is None:
            continue
        want, got = list(expected[i]), list(seq.tokens)
        if got != want[: len(got)]:
            msg = divergence(f"request {i}", want, got)
            raise AssertionError(f"{msg} (in step {step}, while it ran)")
