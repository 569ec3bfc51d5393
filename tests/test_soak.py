"""Step 10 - the server soaked: `tools/soak_server.py` for a minute, the real `serve` with its
model over two ranks, under a mixed load (streams, heavy logprobs requests, clients that leave,
the largest constraints abandoned, crowds of pages) while CPU hogs load the machine, and faults
in turn: the engine paused and resumed (busy, never a 503, never restarted), the engine killed,
a rank paused past the engine timeout, a rank killed (each restarted). No request is lost, no
block is held after, /health is ok again, and SIGTERM ends a stream with an error and the
server with status 0. `make soak-server MINUTES=N` runs it for longer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the real server under CPU hogs for a minute

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not os.path.exists("/proc"), reason="the soak reads the load from /proc")
def test_the_server_soaked_under_hogs_loses_nothing_and_heals_itself(tmp_path):
    out = tmp_path / "soak.json"
    flags = ["--minutes", "1", "--hogs", str(2 * os.cpu_count()), "--tp", "2"]
    flags += ["--engine-timeout", "8", "--pause", "6", "--crowd-every", "15"]
    flags += ["--plain", "4", "--leaving", "1", "--constraints", "1", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "tools/soak_server.py", *flags], cwd=ROOT, env=env, timeout=1200,
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.exists(), f"the soak did not report:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    got = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in got.items() if k != "pages_served_refused"}))
    assert got["problems"] == [] and run.returncode == 0, got["problems"][:10]
    assert [kind for kind, *_ in got["faults"]] == [
        "pause engine", "kill engine", "pause rank", "kill rank"
    ]  # fmt: skip
    assert got["restarts"] == 3 and got["exit_status"] == 0, got
    assert got["health_busy"] > 0, "the paused engine was never seen busy"
    assert sum(e.get("answered", 0) for e in got["ends"].values()) > 50, got["ends"]
