"""Course tooling - checking tokens against the oracle, and checking an exercise.

`divergence()` says where a batched path left solo generate, in words a learner can act on.
`check_exercise("01")` runs an exercise's tests on the learner's file (exercises/) and prints
a short report; a notebook calls it, so it never raises. `python -m tinyllm check 01` does
the same from a shell, and `python -m tinyllm check --stubs-fail` proves that every exercise
test fails on the untouched stubs (no test can pass vacuously).
"""

import ast
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from tinyllm.course.seams import SEAMS, seam_names

ROOT = Path(__file__).resolve().parents[2]
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)     # a seam may be an async generator (10)


def divergence(name: str, expected: list[int], got: list[int]) -> str | None:
    """None if got == expected, else e.g. 'request 3 diverged from solo generate at token 5:
    expected 104, got 32'."""
    if list(expected) == list(got):
        return None
    for i, (e, g) in enumerate(zip(expected, got)):
        if e != g:
            return f"{name} diverged from solo generate at token {i}: expected {e}, got {g}"
    return (f"{name}: solo generate gave {len(expected)} tokens, got {len(got)} "
            f"(the first {min(len(expected), len(got))} agree)")


def near_tie(model, prompt: list[int], expected: list[int], got: list[int],
             bound: float = 0.05, ulps: int = 2) -> tuple[bool, str | None]:
    """The oracle's rule in float32 / bf16: got may leave expected only where solo generation
    stood at a near-tie, its two candidate tokens' logits (the model's, no cache) within
    `bound`, or within `ulps` steps of the logits' own precision where that is coarser (a
    bf16 logit near 10 is a multiple of 0.0625: two paths that add in another order land a
    step or two apart). Returns (ok, what happened): (True, None) when equal; (True, 'request
    ... near-tie at token i ...') when they part at a near-tie (the rest is not compared: it
    follows a different history); (False, the divergence) otherwise."""
    msg = divergence("request", expected, got)
    if msg is None:
        return True, None
    i = next((j for j, (e, g) in enumerate(zip(expected, got)) if e != g), None)
    if i is None:                                   # one stopped early: no tie to excuse it
        return False, msg
    import torch
    device = next(model.parameters()).device
    with torch.no_grad():
        logits, _ = model(torch.tensor([list(prompt) + list(expected[:i])], device=device))
    last = logits[0, -1]
    top = float(last[[expected[i], got[i]]].abs().max())
    step = torch.finfo(last.dtype).eps * 2.0 ** math.floor(math.log2(max(top, 1e-30)))
    bound = max(bound, ulps * step)                 # the spacing of the logits' dtype at top
    gap = abs(float(last[expected[i]].float() - last[got[i]].float()))
    if gap <= bound:
        return True, f"near-tie at token {i}: {expected[i]} vs {got[i]}, logit gap {gap:.4f}"
    return False, f"{msg} (logit gap {gap:.4f} > {bound})"


@contextmanager
def explained(what: str):
    """Turn an error raised inside the engine into a failure that says what was running:
    'the paged engine with your functions raised IndexError: index 2 is out of bounds ...'."""
    try:
        yield
    except (AssertionError, NotImplementedError):   # a stub's own message says what to do
        raise
    except Exception as e:
        raise AssertionError(f"{what} raised {type(e).__name__}: {e}") from e


def leaks(engine) -> str | None:
    """What an idle ContinuousEngine still holds (a slot, a running or waiting request, a
    block of the pool), in words; None when every request has given everything back. The
    cache's books are the cache's to check (check_integrity(idle=True))."""
    cache, sched = engine.cache, engine.scheduler
    if (sched.running or sched.waiting) and not cache.live_slots():
        return (f"the scheduler still holds {len(sched.running)} running and "
                f"{len(sched.waiting)} waiting requests after every request finished")
    return cache.check_integrity(idle=True)


def exercise_files() -> dict[str, Path]:
    """{'01': exercises/ex01_kv_cache.py, ...}, one per exercise of the seams table."""
    files = {p.name[2:4]: p for p in sorted((ROOT / "exercises").glob("ex[0-9][0-9]_*.py"))}
    return {nn: files[nn] for nn in SEAMS if nn in files}


def public_functions(path: Path) -> list[str]:
    """The names of the public functions an exercise file defines."""
    return [node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, FUNCTIONS) and not node.name.startswith("_")]


def run_tests(nn: str | list[str], impl: str = "exercises",
              on_outcome=None) -> dict[str, list[tuple[str, str, str]]]:
    """Run tests/exercises/test_exNN_*.py, for one exercise or several in one pytest process, on
    exercises/ or solutions/. Returns {nn: [(test name, 'passed' | 'failed' | 'skipped', first
    line of the message)]}; on_outcome(nn, outcome) hears each one the moment its test ends
    (the plugin tinyllm.course.progress writes them as they come)."""
    files = exercise_files()
    nns = [nn] if isinstance(nn, str) else list(nn)
    for n in nns:
        if n not in files:
            raise ValueError(f"no exercise {n!r}; there are {sorted(files)}")
    tests = {f"test_{files[n].stem}": n for n in nns}
    out: dict[str, list] = {n: [] for n in nns}
    with tempfile.TemporaryDirectory() as tmp:
        progress = Path(tmp) / "progress.jsonl"
        progress.touch()
        with open(Path(tmp) / "pytest.out", "w+", encoding="utf-8") as printed:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", *(f"tests/exercises/{t}.py" for t in tests),
                 f"--impl={impl}", "-q", "-p", "no:cacheprovider",
                 "-p", "tinyllm.course.progress",             # each outcome as it ends
                 "-p", "no:nbval", "-p", "no:anyio"],         # plugins these tests never use
                cwd=ROOT, stdout=printed, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
                     "TINYLLM_PROGRESS": str(progress)})
            with progress.open(encoding="utf-8") as f:
                while True:
                    ended = proc.poll() is not None    # read once more after the process ends
                    for line in f.readlines():
                        got = json.loads(line)
                        n = tests.get(got["file"])
                        if n is not None:
                            outcome = (got["name"], got["status"], got["message"])
                            out[n].append(outcome)
                            if on_outcome is not None:
                                on_outcome(n, outcome)
                    if ended:
                        break
                    time.sleep(0.1)
            printed.seek(0)
            last = (printed.read().strip().splitlines() or ["no output"])[-1]
    for t, n in tests.items():
        if not out[n]:
            out[n] = [(f"{t}.py", "failed", f"the tests could not be collected: {last}")]
    return out


def check_exercise(nn: str, impl: str = "exercises") -> None:
    """Run exercise nn's tests on your code and print each test's outcome as it ends, then how
    many pass. Never raises, and returns nothing, so a notebook cell shows the report alone."""
    exercise_passes(nn, impl)


def exercise_passes(nn: str, impl: str = "exercises") -> bool:
    """check_exercise's report, and whether every test passed (`python -m tinyllm check`'s
    exit status)."""
    def report(_, outcome):
        name, status, msg = outcome
        mark = {"passed": "ok  ", "failed": "FAIL", "skipped": "skip"}[status]
        print(f"{mark} {name}" + (f"\n       {msg}" if msg else ""), flush=True)

    nn = str(nn).zfill(2)
    print(f"exercise {nn}: its tests on {impl}/, each reported as it ends", flush=True)
    try:
        outcomes = run_tests(nn, impl, on_outcome=report)[nn]
    except Exception as e:  # a notebook cell should print, not crash
        print(f"could not run exercise {nn}'s tests: {e}")
        return False
    if len(outcomes) == 1 and outcomes[0][0].endswith(".py"):     # nothing could be collected
        report(nn, outcomes[0])
    passed = sum(s == "passed" for _, s, _ in outcomes)
    ok = passed == len(outcomes) > 0
    print(f"exercise {nn}: {passed}/{len(outcomes)} tests pass" + (" - done!" if ok else ""))
    return ok


def is_untouched(path: Path) -> bool:
    """True if every public function of an exercise file is still a stub: a docstring and
    one `raise NotImplementedError(...)`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, FUNCTIONS) and not node.name.startswith("_"):
            body = node.body[1:] if ast.get_docstring(node) else node.body
            if not (len(body) == 1 and isinstance(body[0], ast.Raise)
                    and "NotImplementedError" in ast.unparse(body[0])):
                return False
    return True


def prove_stubs_fail() -> bool:
    """Every exercise test must fail on the untouched stubs (all exercises in one pytest run).
    In CI (CI set) a worked-on stub is an error; on a learner's machine it is reported and
    left out."""
    ok, untouched = True, []
    for nn, path in exercise_files().items():
        if sorted(public_functions(path)) != sorted(seam_names(nn)):
            print(f"FAIL {path.name}: its functions {public_functions(path)} are not the seams "
                  f"of exercise {nn} {seam_names(nn)}")
            ok = False
        elif is_untouched(path):
            untouched.append(nn)
        elif os.environ.get("CI"):
            print(f"FAIL {path.name}: not an untouched stub (a solution in exercises/?)")
            ok = False
        else:
            print(f"note {path.name}: you have worked on it, so it is no proof; "
                  "CI proves the untouched stubs fail")
    if not untouched:
        return ok
    print(f"running the tests of exercises {', '.join(untouched)} on the untouched stubs...",
          flush=True)
    for nn, outcomes in run_tests(untouched, "exercises").items():
        name = exercise_files()[nn].name
        passing = [n for n, s, _ in outcomes if s != "failed"]
        if not outcomes or passing:
            print(f"FAIL {name}: tests that do not fail on the stub: {passing or 'none ran'}")
            ok = False
        else:
            print(f"ok   {name}: all {len(outcomes)} tests fail on the untouched stub")
    return ok


def main(argv=None) -> None:
    """`python -m tinyllm check NN` (your exercise's tests, a short report) or `--stubs-fail`."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tinyllm check",
                                 description="Run an exercise's tests on your code and report.")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("exercise", nargs="?",
                       help="the exercise's number, e.g. 01: its tests on your exercises/ file")
    which.add_argument("--stubs-fail", action="store_true",
                       help="prove that every exercise test fails on the untouched stubs")
    args = ap.parse_args(argv)
    ok = prove_stubs_fail() if args.stubs_fail else exercise_passes(args.exercise)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
