"""The package's shape: small functions and classes, and imports that only run downward.

The engine's modules sit at the top of `tinyllm/`; three wings stand around them:
`checkpoints/` (weights and tokenizers in), `serving/` (the engine behind HTTP) and `course/`
(the tools that measure, draw and check). The engine imports no wing, and no wing imports the
course's tooling but the course itself.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tinyllm"
WINGS = ("checkpoints", "serving", "course")
# what each part may import besides itself: the engine nothing of the wings; the course anything
MAY_IMPORT = {
    "engine": set(),
    "checkpoints": {"engine"},
    "serving": {"engine", "checkpoints"},
    "course": {"engine", "checkpoints", "serving"},
    "command line": {"engine", *WINGS},
}  # __main__: one command per tool


def modules() -> dict[str, Path]:
    """{'tinyllm.scheduler': path, 'tinyllm.serving.server': path, ...}"""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def part(module: str) -> str:
    """The part of the package a module belongs to: a wing's name, or 'engine'."""
    if module == "tinyllm.__main__":
        return "command line"
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 and pieces[1] in WINGS else "engine"


def imports(path: Path, known: set[str]) -> set[str]:
    """The package's modules that a file imports, anywhere in it (inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                out.add(node.module)
            out |= {
                f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known
            }
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # the package's face (__init__) re-exports load and Tokenizer; a module importing
    # `tinyllm` itself takes nothing else from it
    return {m: imports(p, known) - {"tinyllm"} for m, p in mods.items()}


def test_no_import_circles():
    """No module reaches itself through imports: every module stands above what it uses."""
    g = graph()
    done, path = set(), []

    def visit(m):
        if m in path:
            circle = path[path.index(m) :] + [m]
            pytest.fail(f"an import circle: {' -> '.join(circle)}")
        if m in done:
            return
        path.append(m)
        for n in sorted(g.get(m, ())):
            if n != "tinyllm":
                visit(n)
        path.pop()
        done.add(m)

    for m in sorted(g):
        if m != "tinyllm":
            visit(m)


def test_imports_run_downward():
    """The engine imports no wing; serving never imports the course's tooling."""
    bad = [
        f"{m} imports {n}"
        for m, targets in graph().items()
        if m != "tinyllm"
        for n in sorted(targets)
        if part(n) != part(m) and part(n) not in MAY_IMPORT[part(m)]
    ]
    assert not bad, "imports that run back up: " + "; ".join(bad)


def test_functions_and_classes_are_small():
    """No function over 60 lines and no class over 150 in the package: each fits a screen or two."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            n = (node.end_lineno - node.lineno + 1) if hasattr(node, "end_lineno") else 0
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > 60:
                long.append(f"{path.relative_to(PACKAGE.parent)}: def {node.name}, {n} lines")
            elif isinstance(node, ast.ClassDef) and n > 150:
                long.append(f"{path.relative_to(PACKAGE.parent)}: class {node.name}, {n} lines")
    assert not long, "too long: " + "; ".join(long)
