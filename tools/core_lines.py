"""Repository tooling (not part of the package) - the lines of the core, by step.

The core is what notebooks 00-08 read: the package's modules tagged with a step from 00 to 08
(a docstring's first "Step NN" or "Steps NN-MM"; the checkpoints' loaders of step 00 among
them), and the vocabulary every step speaks (the engine's modules without a step: requests,
sampling, the token stage, stats, the config). The later steps (09 on), the builder, the serving
and course wings and the package's faces are counted apart. `make lint` prints it.

    python tools/core_lines.py            # the core's lines, and each module's
    python tools/core_lines.py --quiet    # one line
"""

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tinyllm"
WINGS = ("checkpoints", "serving", "course")
APART = ("build.py", "engine.py", "__main__.py", "__init__.py")


def step_of(path: Path) -> tuple[int, int] | None:
    """A module's steps from its docstring's first "Step NN" or "Steps NN-MM", or None."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = re.search(r"Steps? (\d{2})(?:\s*[-\u2013]\s*(\d{2}))?", doc[:300])
    return None if m is None else (int(m.group(1)), int(m.group(2) or m.group(1)))


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def core() -> dict[str, int]:
    """{module path: lines} of the core: steps 00-08 and the engine's vocabulary."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("serving", "course") or rel.name in APART:
            continue  # the wings above the engine, the faces
        step = step_of(path)
        vocabulary = step is None and rel.parts[0] not in WINGS
        if (step is not None and step[0] <= 8) or vocabulary:
            found[str(rel)] = lines(path)
    return found


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    found = core()
    total = sum(found.values())
    every = sum(lines(p) for p in PACKAGE.rglob("*.py"))
    print(
        f"the core (steps 00-08 and the vocabulary): {total:,} lines in {len(found)} modules, "
        f"of the package's {every:,}"
    )
    if "--quiet" not in argv:
        for name, n in sorted(found.items(), key=lambda kv: -kv[1]):
            print(f"  {n:5}  {name}")


if __name__ == "__main__":
    main()
