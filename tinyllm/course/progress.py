"""Course tooling - a pytest plugin that writes each test's outcome the moment it ends.

`check` runs the exercise tests in a pytest process of their own with `-p
tinyllm.course.progress`, and reads the file that TINYLLM_PROGRESS names as it grows: one JSON
line a test (its file, its name, passed / failed / skipped, the first line of its message), and
one for a file that could not be collected. A learner sees each test pass or fail as it ends,
not all of them at the end.
"""

import json
import os
from pathlib import Path


def write(path: str, file: str, name: str, status: str, message: str) -> None:
    line = {"file": Path(file).stem, "name": name, "status": status, "message": message}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def first_line(longrepr) -> str:
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr or "")
    return (text.strip().splitlines() or [""])[0]


def pytest_runtest_logreport(report) -> None:
    """A test's outcome: its call's, or its setup's when that failed or skipped it, or its
    teardown's when that failed."""
    path = os.environ.get("TINYLLM_PROGRESS")
    ends = report.when == "call" or (report.when != "call" and not report.passed)
    if not path or not ends:
        return
    file, _, name = report.nodeid.partition("::")
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        write(path, file, name, "skipped", str(reason))
    else:
        status = "passed" if report.passed else "failed"
        write(path, file, name, status, first_line(report.longrepr) if report.failed else "")


def pytest_collectreport(report) -> None:
    """A test file that could not be collected (a syntax error in your file, an import)."""
    path = os.environ.get("TINYLLM_PROGRESS")
    if path and report.failed:
        file = report.nodeid.partition("::")[0]
        write(path, file, Path(file).name, "failed", first_line(report.longrepr))
