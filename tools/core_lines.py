"""Repository tooling (not part of the package) - the lines of the core, by step.

The core is what notebooks 00-08 read: `tinyllm/core/` (steps 00-08 and the vocabulary every
step speaks: requests, sampling, the token stage, stats, the config) and the checkpoints'
loaders of step 00. The later steps (`tinyllm/ext/`, the checkpoints of step 09), the builder,
the serving and course wings and the package's faces are counted apart. `make lint` prints it.

    python tools/core_lines.py            # the core's lines, and each module's
    python tools/core_lines.py --quiet    # one line
"""

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tinyllm"


def step_of(path: Path) -> tuple[int, int] | None:
    """A module's steps from its docstring's first "Step NN" or "Steps NN-MM", or None."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = re.search(r"Steps? (\d{2})(?:\s*[-\u2013]\s*(\d{2}))?", doc[:300])
    return None if m is None else (int(m.group(1)), int(m.group(2) or m.group(1)))


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def core() -> dict[str, int]:
    """{module path: lines} of the core: core/, and the checkpoints of steps up to 08."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        step = step_of(path)
        early_checkpoint = rel.parts[0] == "checkpoints" and step is not None and step[0] <= 8
        if (rel.parts[0] == "core" and rel.name != "__init__.py") or early_checkpoint:
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
