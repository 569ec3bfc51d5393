"""The package's shape: small functions and classes, imports that only run downward, a layout
that shows the steps, and a step's module that holds its step.

`tinyllm/core/` holds steps 00-08 (what notebooks 00-08 read) and the vocabulary every step
speaks; `tinyllm/ext/` holds the later steps, each a plug-in to the core; the builder
(`build.py`) turns a config into an engine of their parts; three wings stand around them:
`checkpoints/` (weights and tokenizers in), `serving/` (the engine behind HTTP) and `course/`
(the tools that measure, draw and check). The core imports nothing outside itself, a later step
only the core, and no wing imports the course's tooling but the course itself. Each module's
docstring opens with its step ("Step 05 - ..."): a module of step N imports no module of a step
after N (the builder, the serving and course wings, the command line and the engine's name face
may import any step), `import tinyllm` loads no module of step 09 or later, and a notebook's
imports load no module of a later step than its own.
"""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tinyllm"
WINGS = ("checkpoints", "serving", "course")
# what each part may import besides itself: the core nothing; the course anything
MAY_IMPORT = {
    "core": set(),
    "ext": {"core"},
    "checkpoints": {"core"},
    "build": {"core", "ext", "checkpoints"},
    "serving": {"core", "ext", "checkpoints", "build"},
    "course": {"core", "ext", "checkpoints", "serving", "build"},
    "command line": {"core", "ext", "build", *WINGS},
}  # __main__: one command per tool
FACES = {"__init__.py", "__main__.py", "build.py", "engine.py"}  # what stands at the top
FREE = ("tinyllm.build", "tinyllm.engine", "tinyllm.__main__", "tinyllm.serving", "tinyllm.course")


def modules() -> dict[str, Path]:
    """{'tinyllm.core.scheduler': path, 'tinyllm.serving.server': path, ...}"""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def part(module: str) -> str:
    """The part of the package a module belongs to: 'core', 'ext', a wing's name, 'build' or
    'command line'."""
    if module == "tinyllm.__main__":
        return "command line"
    if module in ("tinyllm.build", "tinyllm.engine"):  # the builder, and the names' face
        return "build"
    return module.split(".")[1]


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
    """The core imports nothing outside itself, a later step only the core; serving never
    imports the course's tooling."""
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


def steps() -> dict[str, tuple[int, int]]:
    """Each tagged module's steps, from its docstring's first "Step NN" or "Steps NN-MM"."""
    tags = {}
    for name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        m = re.search(r"Steps? (\d{2})(?:\s*[-\u2013]\s*(\d{2}))?", doc[:300])
        if m:
            tags[name] = (int(m.group(1)), int(m.group(2) or m.group(1)))
    return tags


def test_a_steps_module_imports_no_later_step():
    """A module of step N imports only modules of steps up to N (inside functions too): a later
    step plugs in through an interface, or through the builder."""
    tags, g = steps(), graph()
    later = [
        f"{m} (step {tags[m][1]:02d}) imports {n} (step {tags[n][0]:02d})"
        for m in tags
        if not m.startswith(FREE)
        for n in sorted(g[m])
        if n in tags and tags[n][0] > tags[m][1]
    ]
    assert not later, "a step imports a later step: " + "; ".join(later)


def probes(path: Path) -> list[str]:
    """The hasattr and getattr calls in a module that ask an object for a named attribute (a
    string, not a dunder): where a part's interface should be declared instead."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and not str(node.args[1].value).startswith("__")
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_core_asks_its_parts_nothing_they_do_not_declare():
    """The engine's parts (core/parts.py) are declared: no module of the core, and not the
    builder, probes an object for an attribute (hasattr(decoder, "warm_up")); and step 04's
    engine names no later step's part."""
    found = [
        p
        for f in [*sorted((PACKAGE / "core").glob("*.py")), PACKAGE / "build.py"]
        for p in probes(f)
    ]
    assert not found, "probes for undeclared attributes: " + "; ".join(found)
    engine = (PACKAGE / "core" / "continuous.py").read_text().lower()
    named = sorted({w for w in ("specul", "draft", "rank", "quantiz", "guess") if w in engine})
    assert not named, f"core/continuous.py names later steps' parts: {named}"


MODULE_DOC_LINES = 16  # a module's docstring, its quotes included


def test_a_modules_docstring_says_what_it_adds_in_a_few_lines():
    """A module's docstring says what its step adds and its contract, in MODULE_DOC_LINES
    lines at most: figures and history live in the notebooks and the commit messages, worked
    examples in the functions' docstrings."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        body = ast.parse(path.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            n = body[0].end_lineno - body[0].lineno + 1
            if n > MODULE_DOC_LINES:
                long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, f"module docstrings over {MODULE_DOC_LINES} lines: " + "; ".join(long)


def test_the_layout_shows_the_steps():
    """The top of the package holds its faces only; core/ holds steps 00-08 and the untagged
    vocabulary, ext/ the steps after 10 (each a plug-in), checkpoints/ steps 00 and 09."""
    tags = steps()
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == FACES, f"at the top of tinyllm/ besides its faces: {sorted(top - FACES)}"
    misplaced = []
    for name in modules():
        if name == "tinyllm":
            continue
        first, last = tags.get(name, (None, None))
        where = part(name)
        if where == "core" and first is not None and last > 8:
            misplaced.append(f"{name} (step {last:02d}) in core/")
        if where == "ext" and name != "tinyllm.ext" and (first is None or first < 11):
            misplaced.append(f"{name} ({'no step' if first is None else first}) in ext/")
        if where == "checkpoints" and first is not None and not {first, last} <= {0, 9}:
            misplaced.append(f"{name} (steps {first:02d}-{last:02d}) in checkpoints/")
    assert not misplaced, "modules outside their step's place: " + "; ".join(misplaced)


def later_modules_loaded(code: str, step: int) -> list[str]:
    """The tagged modules of steps after `step` that running `code` in a fresh interpreter
    loads."""
    tags = steps()
    listed = "print(' '.join(m for m in sys.modules if m.startswith('tinyllm')))"
    probe = f"{code}\nimport sys\n{listed}"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return sorted(m for m in done.stdout.split() if m in tags and tags[m][0] > step)


def test_import_tinyllm_loads_no_later_step():
    """`import tinyllm` (load, generate, the model) loads modules of steps 00-08 alone."""
    assert later_modules_loaded("import tinyllm", 8) == []


def notebook_imports(path: Path) -> str:
    """A notebook's import lines, as code."""
    nb = json.loads(path.read_text())
    lines = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            src = "".join(cell["source"])
            for node in ast.parse(src if "%" not in src else "").body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    lines.append(ast.unparse(node))
    return "\n".join(lines)


@pytest.mark.slow  # a fresh interpreter for each notebook
@pytest.mark.parametrize(
    "path", sorted((ROOT / "notebooks").glob("0[0-8]_*.ipynb")), ids=lambda p: p.stem
)
def test_a_notebooks_imports_load_no_later_step(path):
    """Notebooks 00-08 (the core's) import nothing of a later step than their own; solo
    generate() (step 01), the oracle every step checks against, excepted."""
    step = max(int(path.stem[:2]), 1)
    loaded = later_modules_loaded(notebook_imports(path), step)
    assert loaded == [], f"{path.name} loads {loaded}"
