"""Step 10 - the engine's watchdog: a slow engine is a live one; a dead or hung one is told apart.

A step may take a minute on a loaded machine, so the server never judges the engine by a message
it should have sent in time. The engine process marks its loop on a `StepClock` in shared
memory, and the HTTP side reads that clock and the engine's processes from the system (alive,
stopped, their CPU seconds). `Watchdog.judge` says:
- ok: the loop came round lately (within BUSY_S, and BUSY_TIMES the usual turn);
- busy: a turn runs longer than that, or one of the engine's processes (a rank too) is stopped;
- hung: the loop has not come round for longer than the engine timeout, and the engine's
  processes together had less than HUNG_CPU_SHARE of a core meanwhile: a turn that computes is
  never hung;
- dead: its process ended, or one it started (a rank).
The server (engine_loop.EngineLoop) restarts an engine that is hung or dead; /health says ok
and busy with a 200. Where the system has no /proc, a turn older than the timeout is hung.
"""

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass

BUSY_S = 1.0  # a loop that came round within this is never busy
BUSY_TIMES = 4  # ... nor within this many usual turns (the median of the last ones)
HUNG_CPU_SHARE = 0.01  # past the timeout with less CPU than this share of a core: hung
ENGINE_TIMEOUT_S = 60.0  # vLLM's engine iteration timeout; serve --engine-timeout


class StepClock:
    """When the engine's loop last came round (time.monotonic(), the system's clock in every
    process): as a turn began, or as an idle wait ended (every engine_core.WAIT_S); and how
    long its last turn took. In shared memory: the engine process writes it, the HTTP side
    reads it whenever it likes. Its age is the running turn's, or, for an engine stopped while
    it waited, how long it has not come round."""

    def __init__(self, ctx):
        self.values = ctx.RawArray("d", 2)  # [came round, the last turn's seconds]

    def tick(self) -> None:
        self.values[0] = time.monotonic()

    def end(self) -> None:
        self.values[1] = time.monotonic() - self.values[0]

    def age(self) -> float:
        return time.monotonic() - self.values[0]

    def last(self) -> float:
        return self.values[1]


@dataclass(frozen=True)
class Verdict:
    """A word on the engine: status ("ok", "busy", "hung" or "dead" from the watchdog;
    "starting", "restarting" or "failed" from the engine loop), why (a sentence, None when
    ok) and the running turn's age in seconds."""

    status: str
    why: str | None = None
    step_s: float = 0.0


def process_stat(pid: int) -> tuple[str, float] | None:
    """(state, CPU seconds) of a process from /proc (state "T" when it is stopped, "Z" when it
    ended unreaped); None where it is gone or the system has no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Watchdog:
    """Judges one engine: its process (a multiprocessing.Process), the processes it started
    (`children`: pid -> name, the ranks of a split model), its StepClock, and timeout_s (0:
    never hung). It keeps the last turns' lengths (`turned`) and its processes' CPU seconds
    over the last timeout_s, sampled at each judgement."""

    def __init__(self, process, clock: StepClock, timeout_s: float = ENGINE_TIMEOUT_S):
        self.process, self.clock, self.timeout_s = process, clock, timeout_s
        self.children: dict[int, str] = {}
        self.turns: deque[float] = deque(maxlen=64)  # the last turns' seconds
        self.cpu: deque[tuple[float, float]] = deque()  # (when, CPU seconds of all)

    def turned(self) -> None:
        """A turn ended (its report came): its length joins the usual ones."""
        self.turns.append(self.clock.last())

    def processes(self) -> dict[int, str]:
        return {self.process.pid: "the engine's process", **self.children}

    def judge(self) -> Verdict:
        if not self.process.is_alive():
            return Verdict("dead", f"its process ended (exit code {self.process.exitcode})")
        age, stats = self.clock.age(), {p: process_stat(p) for p in self.processes()}
        for p, name in self.children.items():
            if stats[p] is None or stats[p][0] in "ZX":
                return Verdict("dead", f"{name} (pid {p}) ended")
        self.sample(stats)
        usual = statistics.median(self.turns) if self.turns else 0.0
        stopped = [
            f"{name} (pid {p}) is stopped"
            for p, name in self.processes().items()
            if stats[p] is not None and stats[p][0] in "Tt"
        ]
        if age <= max(BUSY_S, BUSY_TIMES * usual) and not stopped:
            return Verdict("ok", step_s=age)
        said = f"its step has run {age:.0f} s" + (f"; {', '.join(stopped)}" if stopped else "")
        if self.timeout_s and age > self.timeout_s and self.idle(stats):
            return Verdict(
                "hung", f"{said}, with no CPU for {self.timeout_s:.0f} s (--engine-timeout)", age
            )
        return Verdict("busy", said, age)

    def sample(self, stats: dict) -> None:
        """The CPU seconds of all the engine's processes now; those older than timeout_s go,
        but the last of them."""
        now = time.monotonic()
        if all(s is not None for s in stats.values()):
            self.cpu.append((now, sum(s[1] for s in stats.values())))
        while len(self.cpu) > 1 and now - self.cpu[1][0] >= self.timeout_s:
            self.cpu.popleft()

    def idle(self, stats: dict) -> bool:
        """Whether the engine's processes had less than HUNG_CPU_SHARE of a core over the last
        timeout_s, as far as the samples reach back (True where /proc does not say)."""
        if any(s is None for s in stats.values()):
            return True
        if len(self.cpu) < 2 or self.cpu[-1][0] - self.cpu[0][0] < 0.9 * self.timeout_s:
            return False  # not watched that long yet
        (t0, cpu0), (t1, cpu1) = self.cpu[0], self.cpu[-1]
        return cpu1 - cpu0 < HUNG_CPU_SHARE * (t1 - t0)
