"""Course tooling - the oracle's messages and the exercise checker a notebook calls."""

from tinyllm.course.check import check_exercise, divergence, exercise_passes, run_tests


def test_divergence_names_request_token_and_values():
    assert divergence("request 3", [1, 2, 3], [1, 2, 3]) is None
    assert (
        divergence("request 3", [5, 104, 7], [5, 32, 7])
        == "request 3 diverged from solo generate at token 1: expected 104, got 32"
    )
    assert "gave 3 tokens, got 2" in divergence("request 0", [1, 2, 3], [1, 2])


def test_check_exercise_reports_solutions_done(capsys):
    assert exercise_passes("01", impl="solutions") is True
    out = capsys.readouterr().out
    assert "tests pass - done!" in out and "FAIL" not in out


def test_check_exercise_reports_stubs_in_learner_words(capsys):
    assert check_exercise("01", impl="exercises") is None  # a notebook cell shows no value
    out = capsys.readouterr().out
    assert "FAIL test_append_kv_writes_at_pos" in out
    assert "exercise 01: store k and v" in out and "0/" in out


def test_check_exercise_never_raises(capsys):
    assert exercise_passes("99") is False
    assert "could not run exercise 99" in capsys.readouterr().out


def test_each_outcome_is_heard_as_its_test_ends():
    """run_tests hands each test's outcome to on_outcome, in the order the tests end (the
    pytest plugin writes each one as its test ends), the same outcomes it returns."""
    heard = []
    got = run_tests("01", "solutions", on_outcome=lambda nn, o: heard.append((nn, o)))
    assert [o for _, o in heard] == got["01"] and len(heard) > 1
    assert all(nn == "01" and status == "passed" for nn, (_, status, _) in heard)


def test_near_tie_excuses_only_a_close_second_choice():
    """bf16 paths may part from solo at a near-tie, and only there."""
    import torch

    from tests.conftest import make_tiny
    from tinyllm.core.generate import generate
    from tinyllm.course.check import near_tie

    model = make_tiny(seed=4, dtype=torch.float32)
    prompt = [3, 1, 4, 1, 5]
    solo = generate(model, prompt, 8)
    assert near_tie(model, prompt, solo, solo) == (True, None)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + solo[:3]]))[0][0, -1]
    second = int(logits.topk(2).indices[1])
    gap = float(logits[solo[3]] - logits[second])
    parted = solo[:3] + [second, 0, 0]
    ok, what = near_tie(model, prompt, solo, parted, bound=gap + 1e-4)
    assert ok and "near-tie at token 3" in what
    ok, what = near_tie(model, prompt, solo, parted, bound=gap / 2)
    assert not ok and "diverged from solo generate at token 3" in what
    assert near_tie(model, prompt, solo, solo[:4])[0] is False, "stopping early is no tie"
