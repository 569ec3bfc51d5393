"""The repository's set-up files agree with each other: the two ways to install the course get
the same PyTorch."""

import re

from tinyllm.course.check import ROOT


def test_conda_pins_the_torch_the_makefile_installs():
    """environment.yml installs the PyTorch release the Makefile's TORCH names (the package's
    own requirement stays open, torch>=2.3)."""
    make = re.search(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert make, "the Makefile names no TORCH"
    conda = re.findall(r"^\s*-\s*(torch\S*)", (ROOT / "environment.yml").read_text(), re.M)
    assert conda == [make.group(1)], (
        f"environment.yml installs {conda or 'no pinned torch'}, the Makefile {make.group(1)}"
    )


def test_make_eval_puts_the_bos_token_first_on_both_sides():
    """lm-eval through the server scores the same tokens as lm-eval's hf model only when both
    put the BOS token first: evals/compare.py gives add_bos_token=True to each one's
    model_args (read from its source: lm-eval is not installed for the tests)."""
    import ast

    tree = ast.parse((ROOT / "evals" / "compare.py").read_text())
    for name in ("hf_args", "completions_args"):
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        given = {
            k.value: v.value
            for d in ast.walk(fn)
            if isinstance(d, ast.Dict)
            for k, v in zip(d.keys, d.values)
            if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
        }
        assert given.get("add_bos_token") is True, f"{name} does not give add_bos_token=True"
