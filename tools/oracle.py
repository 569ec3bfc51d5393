"""Repository tooling (not part of the package) - the oracle over every setting, for as long as
asked: tests/test_oracle.py's property (every EngineConfig the engine accepts, workloads built
to meet the interactions, every finished choice against its solo run) in rounds of fresh
random examples, until the minutes or the requests run out, then what it covered.

    python tools/oracle.py --minutes 30          # or: make oracle MINUTES=30
    python tools/oracle.py --requests 20000

Each round is a hypothesis run of --round examples without the example database, so every
round draws new ones; the compiled decoders (06's compiled step, 13's pieces) are drawn for
every kind of weights here, where make test draws them for float weights only. A failure is
shrunk by hypothesis and printed (its config and workload), and the command exits 1: make it a
fixed test.
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import test_oracle  # noqa: E402

WHAT = ("examples", "requests", "choices", "aborted", "preemptions", "prefix_hit_tokens",
        "proposed", "accepted", "constrained")  # fmt: skip


def report(covered, seconds: float) -> str:
    """What the rounds covered so far, a line of totals then each decoder, weight and refusal."""
    line = ", ".join(f"{covered[k]} {k.replace('_', ' ')}" for k in WHAT)
    rest = sorted(k for k in covered if k not in WHAT)
    return f"{seconds / 60:.1f} min: {line}, 0 mismatches\n" + "".join(
        f"    {covered[k]:7} {k}\n" for k in rest
    )


def example(data) -> None:
    """One drawn example of test_oracle's (its tensor-parallel sizes at their default)."""
    test_oracle.run_example(data)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=None, help="run this long (default 10)")
    parser.add_argument("--requests", type=int, default=None, help="or until this many requests")
    parser.add_argument("--round", type=int, default=200, help="examples a round (default 200)")
    args = parser.parse_args(argv)
    minutes = args.minutes if args.minutes is not None or args.requests else 10.0
    test_oracle.SOAK = True
    run = settings(
        max_examples=args.round,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )(given(data=st.data())(example))
    covered, t0 = test_oracle.COVERED, time.monotonic()
    while True:
        try:
            run()
        except Exception as e:  # hypothesis has shrunk it and printed the example
            print(f"MISMATCH after {covered['requests']} requests: {type(e).__name__}: {e}")
            print(report(covered, time.monotonic() - t0).replace(", 0 mismatches", ""))
            return 1
        elapsed = time.monotonic() - t0
        print(report(covered, elapsed), flush=True)
        if minutes is not None and elapsed >= minutes * 60:
            return 0
        if args.requests is not None and covered["requests"] >= args.requests:
            return 0


if __name__ == "__main__":
    sys.exit(main())
