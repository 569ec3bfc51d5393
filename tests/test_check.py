"""Course tooling - the oracle's messages and the exercise checker a notebook calls."""

from tinyllm.check import check_exercise, divergence


def test_divergence_names_request_token_and_values():
    assert divergence("request 3", [1, 2, 3], [1, 2, 3]) is None
    assert divergence("request 3", [5, 104, 7], [5, 32, 7]) == \
        "request 3 diverged from solo generate at token 1: expected 104, got 32"
    assert "gave 3 tokens, got 2" in divergence("request 0", [1, 2, 3], [1, 2])


def test_check_exercise_reports_solutions_done(capsys):
    assert check_exercise("01", impl="solutions") is True
    out = capsys.readouterr().out
    assert "tests pass - done!" in out and "FAIL" not in out


def test_check_exercise_reports_stubs_in_learner_words(capsys):
    assert check_exercise("01", impl="exercises") is False
    out = capsys.readouterr().out
    assert "FAIL test_append_kv_writes_at_pos" in out
    assert "exercise 01: store k and v" in out and "0/" in out


def test_check_exercise_never_raises(capsys):
    assert check_exercise("99") is False
    assert "could not run exercise 99" in capsys.readouterr().out
