"""The command line: `python -m tinyllm bench ...` (see bench.py)."""

import sys

from tinyllm import bench

USAGE = "usage: python -m tinyllm bench [--workload W] [--engines static,continuous] [--batch N] ..."

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "bench":
        sys.exit(USAGE)
    bench.main(sys.argv[2:])
