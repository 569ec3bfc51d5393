"""Step 12 - constraint checks: the grammar backend's word on a constraint, in a process of its own.

A grammar backend's check (api.check_constraint) may take CPU-seconds, or crash llguidance; on
the HTTP side it would starve plain requests and run on after its client went away. So
`ConstraintChecks` hands each check to a worker process (`CheckWorker`, with its own copy of
the backend), one check at a time per worker, each worker driven by a thread of the checks' own:
- a constraint over api.MAX_CONSTRAINT bytes, or any with no backend, is refused at once;
- at most max_waiting checks wait for a worker: one more gets a 429;
- a check may spend budget_s of its worker's CPU time (RLIMIT_CPU), never wall time; past it,
  or on a signal that ends the worker, the constraint is refused and a fresh worker starts; a
  worker that could not start is the server's fault, a 500;
- a client that goes away (`gone()`, asked every POLL_S) ends its check: `check` raises
  APIError 499, which the server answers to no one.
The workers run at a lower priority (NICENESS). Builds on 12 (the grammar backend) and 10 (the
server's APIError); server.py holds one `ConstraintChecks`.
"""

import asyncio
import math
import multiprocessing
import os
import resource
import signal
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from tinyllm.core.sampling import Constraint
from tinyllm.serving.api import MAX_CONSTRAINT, APIError, check_constraint

# CPU-seconds a check may spend: the largest constraint MAX_CONSTRAINT lets through compiles in
# under one on a Xeon core; 4 leaves room for a slower CPU, and the kernel's whole seconds add
# up to one more
CHECK_CPU_S = 4
MAX_WAITING_CHECKS = 16  # checks waiting for a worker, at most; one more gets a 429
POLL_S = 0.1  # how often a check asks whether its client went away
NICENESS = 10  # the workers' priority below the engine's and the HTTP side's


def serve_checks(grammars, conn, budget_s: int) -> None:
    """A worker process: for each constraint that comes on conn, the backend's sentence (None:
    taken) goes back, each check within budget_s more CPU-seconds of this process (RLIMIT_CPU:
    past it the kernel ends the process with SIGXCPU); an error of the backend goes back as a
    RuntimeError that says what failed. It ends when the server closes the pipe."""
    import torch

    torch.set_num_threads(1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would dump a core file
    while True:
        try:
            constraint = conn.recv()
        except EOFError:
            return
        spent = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # user + system
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = math.ceil(spent + budget_s)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        try:
            conn.send(grammars.check(constraint))
        except Exception as e:
            conn.send(RuntimeError(f"the grammar backend failed: {type(e).__name__}: {e}"))


class CheckWorker:
    """One worker process (serve_checks) and the pipe to it, started on first use. Its calls
    block (`ask`: one at a time), so each worker has a thread of ConstraintChecks' own; `kill`
    comes from the event loop, and ends only a check in flight."""

    def __init__(self, grammars, budget_s: int = CHECK_CPU_S):
        self.grammars, self.budget_s = grammars, budget_s
        self.process = self.conn = None
        self.lock = threading.Lock()  # one ask or start at a time
        self.guard = threading.Lock()  # held briefly: whether a check is in flight
        self.asking = self.stopped = False

    def start(self) -> None:
        """Start the worker process, unless one runs."""
        with self.lock:
            self._start()

    def _start(self) -> None:
        if self.process is not None or self.stopped:
            return
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(
            target=serve_checks,
            name="tinyllm-checks",
            daemon=True,
            args=(self.grammars, theirs, self.budget_s),
        )
        self.process.start()
        os.setpriority(os.PRIO_PROCESS, self.process.pid, NICENESS)  # before it imports torch
        theirs.close()  # the pipe closes when the worker ends: ask reads an EOF

    def ask(self, constraint: Constraint) -> str | None:
        """The backend's sentence on constraint, None if it takes it. A worker that ends on it
        is replaced by a fresh one, and the sentence says why it ended."""
        with self.lock:
            self._start()
            with self.guard:
                self.asking = True
            try:
                self.conn.send(constraint)
                reply = self.conn.recv()
            except (EOFError, OSError):  # the pipe closed: the worker ended
                reply = EOFError
            finally:
                with self.guard:
                    self.asking = False  # a kill from now on finds no check in flight
            if reply is EOFError:
                return self._ended()
            if isinstance(reply, Exception):
                raise reply
            return reply

    def _ended(self) -> str:
        """Why a signal ended the worker process on a check (its CPU budget spent, a crash, a
        kill), a fresh one started in its place; a RuntimeError when it exited instead."""
        self.process.join()
        code = self.process.exitcode
        self.conn.close()
        self.process = self.conn = None
        self._start()
        if code >= 0:
            raise RuntimeError(f"the constraint checks' process exited ({code}): see its error")
        if code == -signal.SIGXCPU:
            return f"it took more than {self.budget_s} CPU-seconds to compile"
        return f"the grammar backend's process ended on it ({signal.Signals(-code).name})"

    def kill(self) -> None:
        """End the check in flight (its client went away): the worker process is killed, and
        ask starts a fresh one. Nothing happens once the check is over."""
        with self.guard:
            if self.asking:
                self.process.kill()

    def stop(self) -> None:
        """Kill the worker process for good (a worker holds nothing worth ending gently)."""
        with self.guard:
            self.stopped = True
            if self.process is not None:
                self.process.kill()


class ConstraintChecks:
    """The server's constraint checks: `workers` worker processes (CheckWorker), each with a
    thread of its own, and the line of checks waiting for one (first come, first served; at
    most max_waiting); each check within budget_s CPU-seconds of its worker. `start` starts the
    workers with the server (a check before that starts its own), `stop` ends them."""

    def __init__(
        self,
        grammars,
        workers: int = 1,
        max_waiting: int = MAX_WAITING_CHECKS,
        budget_s: int = CHECK_CPU_S,
    ):
        self.grammars, self.max_waiting = grammars, max_waiting
        self.workers = [CheckWorker(grammars, budget_s) for _ in range(workers)]
        self.idle = list(self.workers)
        self.line: deque[asyncio.Future] = deque()  # each waiting check's turn
        self.threads = ThreadPoolExecutor(workers, thread_name_prefix="tinyllm-checks")

    @property
    def waiting(self) -> int:
        return len(self.line)

    def start(self) -> None:
        """Start the worker processes, each from its thread (a spawn writes the backend to the
        new process, which imports torch first)."""
        if self.grammars is not None:
            for worker in self.workers:
                self.threads.submit(worker.start)

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.threads.shutdown(wait=False, cancel_futures=True)

    async def check(self, param: str, constraint: Constraint, gone) -> None:
        """None when the grammar backend takes constraint. Else an APIError naming param: a 400
        when it is refused (check_constraint's sentence: no backend or over MAX_CONSTRAINT
        bytes, at once; the backend's sentence; its CPU budget spent), a 429 when max_waiting
        checks wait already, a 499 when the async gone() says that the client went away (its
        check ended: nobody is left to read the error)."""
        size = len(constraint.spec.encode(errors="surrogatepass"))
        if self.grammars is None or size > MAX_CONSTRAINT:
            check_constraint(self.grammars, param, constraint)  # refused: nothing is asked
        if not self.idle and self.waiting >= self.max_waiting:
            raise APIError(
                429,
                f"the server is full: {self.waiting} constraint checks already wait, of "
                f"{self.max_waiting} at most; retry later",
                param,
                "rate_limit_error",
            )
        worker = await self.admit(gone)
        if (why := await self.run(worker, constraint, gone)) is not None:
            check_constraint(self.grammars, param, constraint, why)

    async def admit(self, gone) -> CheckWorker:
        """An idle worker, at once or at the check's turn in line; its turn is given up when
        the client goes away (a worker handed to it meanwhile goes to the next)."""
        if self.idle:
            return self.idle.pop()
        turn = asyncio.get_running_loop().create_future()
        self.line.append(turn)
        try:
            return await until_gone(turn, gone)
        except BaseException:
            if turn in self.line:
                self.line.remove(turn)
            elif turn.done() and not turn.cancelled():
                self.release(turn.result())
            raise

    async def run(self, worker: CheckWorker, constraint: Constraint, gone) -> str | None:
        """The backend's sentence on constraint, from worker (in its thread). A check left
        early kills the worker; the worker is released once its thread is done (with a fresh
        process, when its process ended)."""
        done = asyncio.get_running_loop().run_in_executor(self.threads, worker.ask, constraint)
        done.add_done_callback(lambda _: self.release(worker, done))
        try:
            return await until_gone(done, gone)
        except BaseException:
            worker.kill()
            raise

    def release(self, worker: CheckWorker, done: asyncio.Future | None = None) -> None:
        """The worker to the first check in line, or idle; its check's error is read (a check
        left early never will)."""
        if done is not None and not done.cancelled():
            done.exception()
        while self.line:
            turn = self.line.popleft()
            if not turn.done():
                turn.set_result(worker)
                return
        self.idle.append(worker)


async def until_gone(future: asyncio.Future, gone):
    """future's result once it is done; an APIError 499 as soon as the async gone() (asked every
    POLL_S) says that the client went away."""
    while not (await asyncio.wait([future], timeout=POLL_S))[0]:
        if await gone():
            raise APIError(499, "the client went away while its constraint was checked")
    return future.result()
