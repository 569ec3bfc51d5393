"""Step 10 - `python -m tinyllm serve`: a checkpoint loaded, its engine made, the server launched.

    python -m tinyllm serve [--model DIR] [--port 8000] [--slots 16] [--kv paged] ...

`serve_main` reads the flags (the server's own, then EngineConfig's), checks that a decoder
that compiles C or C++ on a CPU finds its compiler (`cannot_compile`), reads the model's
sampling defaults (served.model_defaults), loads the checkpoint (tinyllm.build.load), makes the
engine with the grammar backend (12), and launches the server (`Launched`): uvicorn in a thread
of its own, the engine started first on its event loop. No request waits for a compilation. One
line says what is served (served.banner). Ctrl-C or SIGTERM stops the server: requests in
flight end with an error, then the engine, and the command exits 0. An engine that dies or
hangs is started again by the server itself, a line saying each restart. What cannot be served
ends the command with one line that says why, and a non-zero status.
"""

import argparse
import asyncio
import os
import shutil
import signal
import sys
import threading
import time
import warnings

from tinyllm.build import add_quant_argument, load, make_engine
from tinyllm.core.config import EngineConfig
from tinyllm.ext.structured import LLGuidance
from tinyllm.serving.api import APIError
from tinyllm.serving.served import LLAMA_SERVER, banner, model_defaults
from tinyllm.serving.server import Served, build, make_app
from tinyllm.serving.watchdog import ENGINE_TIMEOUT_S

PROG = "python -m tinyllm serve"


def serve_parser() -> argparse.ArgumentParser:
    """The flags of `python -m tinyllm serve`: the server's own, then the engine's
    (EngineConfig.add_arguments)."""
    ap = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Serve a checkpoint over the OpenAI API (completions and chat completions, streamed or "
            "not) with the continuous engine, in a process of its own; Ctrl-C stops it."
        ),
    )
    g = ap.add_argument_group("the server")
    g.add_argument(
        "--model",
        default="default",
        metavar="DIR",
        help="a checkpoint directory, a .gguf file, or smollm2 (SmolLM2-135M-Instruct, "
        "fetched once) (default: the bundled model)",
    )
    add_quant_argument(g)
    defaults = ", ".join(f"{k} {v}" for k, v in LLAMA_SERVER.items())
    g.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="the sampling defaults of the fields a request leaves out, as vLLM's flag of the "
        "name says: auto, the checkpoint's (its generation_config.json, or a GGUF file's "
        f"general.sampling.* keys), else llama-server's ({defaults}); vllm, none (OpenAI's: "
        "temperature 1, nothing cut); or a folder's generation_config.json (default: auto)",
    )
    g.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)"
    )
    g.add_argument("--port", type=int, default=8000, help="the port to listen on (default: 8000)")
    g.add_argument(
        "--device", default=None, help="cpu, cuda, ... (default: cuda when there is one)"
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        metavar="N",
        help="requests that may wait for a slot; more get a 429 (default: 64)",
    )
    g.add_argument(
        "--engine-timeout",
        type=float,
        default=ENGINE_TIMEOUT_S,
        metavar="S",
        help="a step that has run S seconds with no CPU for its processes is hung: the server "
        "restarts the engine (a step that computes is never hung, however long; 0: never) "
        f"(default: {ENGINE_TIMEOUT_S:.0f})",
    )
    g.add_argument(
        "--show-prompts",
        action="store_true",
        help="the live page at / shows each slot's prompt and answer (default: keys and counts "
        "only, so that a shared server's users do not read each other's prompts there)",
    )
    EngineConfig.add_arguments(ap)
    return ap


def refuse(why: str, status: int = 2):
    """End the command with one line that says why (no usage text: the flags parsed)."""
    print(f"{PROG}: error: {why}", file=sys.stderr)
    sys.exit(status)


def cannot_compile(decoder: str, device: str | None) -> str | None:
    """Why a decoder cannot run on this CPU (device None: the CPU where there is no CUDA), in
    one sentence, or None: the compiled step and the pieces need TorchInductor's C++ compiler
    (Inductor's own search: $CXX, else g++ or clang++), the fused layers the C kernels built
    here (cpu_kernels: a C and a C++ compiler)."""
    import torch

    if not (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu"):
        return None
    if decoder == "fused":
        from tinyllm.ext import cpu_kernels

        with warnings.catch_warnings():  # the sentence below says it
            warnings.simplefilter("ignore")
            if cpu_kernels.available():
                return None
        return (
            f"--decoder fused runs C kernels built on this machine, and they are not: "
            f"{cpu_kernels.why_not_built()}; install a C and a C++ compiler (apt install "
            f"build-essential), or serve with --decoder eager"
        )
    if decoder in ("pieces", "compiled") and (why := inductor_compiler_missing()):
        return (
            f"--decoder {decoder} compiles its step with TorchInductor, which finds no C++ "
            f"compiler ({why}); install one (apt install g++, or point $CXX at one), or serve "
            f"with --decoder eager"
        )
    return None


def inductor_compiler_missing() -> str | None:
    """What TorchInductor says when it finds no working C++ compiler (its own search, which
    reads $CXX), or None when it finds one. Without $CXX, Inductor takes g++ from the PATH:
    where that is there, it is taken as found without loading Inductor here (1.8 CPU-seconds
    of imports; the engine's process loads it to compile)."""
    if "CXX" not in os.environ and shutil.which("g++"):
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another layout of torch's internals: the warm-up will tell
        return None
    try:
        get_cpp_compiler()
    except Exception as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


def serve_main(argv=None) -> None:
    """python -m tinyllm serve: load a checkpoint, make its engine, launch the server."""
    from tinyllm.checkpoints.checkpoint import resolve

    ap = serve_parser()
    args = ap.parse_args(argv)
    try:
        config = EngineConfig.from_args(args)
    except ValueError as e:
        ap.error(str(e))
    if why := cannot_compile(config.decoder, args.device):
        refuse(why)
    try:
        defaults = model_defaults(args.model, args.generation_config)
    except ValueError as e:
        refuse(str(e))
    model, tok = load(
        args.model, device=args.device, quant=args.quant, huge_pages=True, wait_for_kernels=False
    )
    if config.tensor_parallel_size > 1:
        serve_other_rank(model, config.tensor_parallel_size)  # returns on rank 0 alone
    draft = None if args.draft is None else load(args.draft, device=args.device)[0]
    try:
        grammars = LLGuidance(tok, model.cfg.vocab_size)  # structured output (12)
        engine = make_engine(model, config, draft=draft, grammars=grammars)
    except ValueError as e:
        refuse(str(e))
    name = "tinyllm-" + resolve(args.model).name.removesuffix(".gguf")
    if args.engine_timeout < 0:
        ap.error(f"--engine-timeout is {args.engine_timeout}: seconds, 0 for none")
    served = build(
        engine,
        tok,
        name,
        args.max_waiting,
        engine_timeout=args.engine_timeout,
        defaults=defaults,
        show_prompts=args.show_prompts,
    )
    print(f"{name}: {banner(served.about, defaults)}", flush=True)
    signal.signal(signal.SIGTERM, stop_as_ctrl_c)  # what systemd, Docker and Kubernetes send
    launched = Launched(served, args.host, args.port)
    if launched.failure is not None:
        refuse(launched.failure, 1)
    print(
        f"serving {name} at http://{args.host}:{args.port}/v1 (up to {engine.max_len} "
        f"positions a request), the engine drawn live at http://{args.host}:{args.port}/; "
        f"Ctrl-C stops",
        flush=True,
    )
    launched.wait()
    # Stopped: the engine's process has ended and the sockets are closed. The interpreter's
    # own exit would still join the worker threads of asyncio's executor and finalize torch's
    # and ZeroMQ's threads, which may wait on a stopped peer or crash; nothing is left for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_other_rank(model, size: int) -> None:
    """Under torchrun (step 14), every rank but rank 0 serves rank 0's steps with its shard of
    the model, then leaves; rank 0 (and a serve not started by torchrun) returns to serve."""
    from tinyllm.ext.ranks import launched_by_torchrun, serve_torchrun_rank

    if not launched_by_torchrun() or int(os.environ["RANK"]) == 0:
        return
    rank = os.environ["RANK"]
    print(f"rank {rank} of {size}: serving rank 0's steps with its shard", flush=True)
    try:
        serve_torchrun_rank(model, size)
    except ValueError as e:
        refuse(str(e))
    print(f"rank {rank}: rank 0 stopped", flush=True)
    sys.stdout.flush()
    os._exit(0)


def stop_as_ctrl_c(signum, frame) -> None:
    """SIGTERM stops the server as Ctrl-C does."""
    raise KeyboardInterrupt


STOP_S = 30  # the longest a graceful stop is waited for


class Launched:
    """uvicorn in a thread of its own, serving `served` on host:port, the engine started first
    on the same event loop (a decode step that compiles before it is Ready says each line of
    how it goes as it comes); the caller's thread gets Ctrl-C. Made, it has started, or says
    in `failure` why it could not (the engine's sentence, or the address)."""

    def __init__(self, served: Served, host: str, port: int):
        import uvicorn

        self.served, self.failure = served, None
        self.uv = uvicorn.Server(
            uvicorn.Config(make_app(served), host=host, port=port, log_level="warning")
        )
        self.loop = self.task = None
        self.ended = threading.Event()  # set as the thread ends
        self.thread = threading.Thread(target=self.run, name="uvicorn", daemon=True)
        self.thread.start()
        try:
            while not self.uv.started and not self.ended.is_set():
                time.sleep(0.05)
        except KeyboardInterrupt:
            self.stop()
            sys.exit(130)
        if not self.uv.started:
            self.thread.join()
            self.failure = self.failure or f"could not serve on {host}:{port}"

    def run(self) -> None:
        """The thread: an event loop of uvicorn's kind (uvloop where there is one), running
        main until it returns."""
        factory = getattr(self.uv.config, "get_loop_factory", lambda: None)()
        loop = factory() if factory is not None else asyncio.new_event_loop()
        try:
            loop.run_until_complete(self.main())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            self.ended.set()

    async def main(self) -> None:
        """Start the engine (a line a compiled bucket), then serve until asked to stop."""
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            await self.served.loop.start(lambda line: print(line, flush=True))
        except asyncio.CancelledError:
            return
        except RuntimeError as e:
            self.failure = str(e)
            return
        await self.uv.serve()

    def stop(self) -> None:
        """A graceful stop: requests in flight end at once with a 503 (a stream with an error
        event) and the live page's streams too, then the engine's process; an engine still
        compiling its decode step is ended at once. A stop that takes over STOP_S says so and
        gives up waiting (the command then exits)."""
        stopping = APIError(503, "the server is stopping", kind="server_error")
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.served.loop.end_all, stopping)
        self.uv.should_exit = True
        self.served.pages.stop()  # the live page's streams end too
        if not self.served.loop.started and self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        if not self.ended.wait(STOP_S):
            print(f"the server did not stop within {STOP_S} s: ending it", flush=True)

    def wait(self) -> None:
        """Serve until Ctrl-C, then stop gracefully."""
        try:  # a join interrupted by Ctrl-C may leave the thread looking ended: a plain sleep
            while not self.ended.is_set():
                time.sleep(0.2)
        except KeyboardInterrupt:
            print("stopping: requests in flight end, then the engine's process", flush=True)
            self.stop()
