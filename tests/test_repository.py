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
