"""Step 14 - the ranks: a split model's processes, rank 0 saying what each step runs.

The runtime is `torch.distributed`, here its gloo backend between CPU processes (several GPUs
would take NCCL, the same calls; not built here). Rank 0 is the engine's process: it runs the
scheduler and the token stage, and sends each step's plan (the token ids, and the rows' slots,
lengths and block tables: SlotCache.planned_step) to the other ranks over ZeroMQ, as vLLM's and
nano-vllm's model runners do; every rank then runs the same forward pass on its shard
(parallel.shard) and on a cache of its own heads made from rank 0's spec (`mirror_cache`) that
follows rank 0's books (SlotCache.follow), and rank 0 gathers the logits. On one machine the
other ranks are spawned processes (`Ranks`); across machines every rank starts under `torchrun`
and joins the same group (`serve_torchrun_rank`). `ParallelModel` is what the engine holds: a
model like any other (`parallel_model`). A rank that dies or fails to start ends the engine with
one error that names it (`RankFailed`).

    make_engine(model, EngineConfig(8, tensor_parallel_size=2))   # holds ParallelModel(model, 2)
"""

import atexit
import contextlib
import dataclasses
import datetime
import itertools
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import socket
import time
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tinyllm.core.kv_spec import CacheSpec, make_cache, spec_of
from tinyllm.core.model import Transformer, unpacked
from tinyllm.core.slot_cache import SlotCache
from tinyllm.ext import parallel
from tinyllm.ext.parallel import TALK, shard

RANK_TIMEOUT_S = 120       # a rank that does not join, or answer within a step, for this long
START_TIMEOUT_S = 120      # spawned ranks that have not joined by then failed to start


# ---- a rank's copy of the cache -----------------------------------------------------------------
def mirror_cache(part: Transformer, spec: CacheSpec, device=None) -> SlotCache:
    """A rank's cache of its own KV heads, with the sizes of rank 0's (its spec): its books
    follow each step's plan (SlotCache.follow), its keys and values are its own."""
    cfg = part.cfg
    own = dataclasses.replace(spec, n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads,
                              head_dim=cfg.head_dim, prefix_cache=False, name_at_admission=False)
    return make_cache(own, device)


# ---- the processes -----------------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """Whether this process was started with a rank of its own (torchrun's environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """A rank of the tensor-parallel group died, failed to start, or raised."""


class Ranks:
    """The process's tensor-parallel group, seen from rank 0: this process is rank 0; ranks 1 to
    size-1 are processes spawned here, or (under torchrun) started elsewhere with the same
    command. `send` hands every other rank a message (ZeroMQ, one PUSH socket a rank: a rank
    waits for the next step as long as it takes, where a collective would time out); the
    forward passes' all-reduces and the logits' gather are torch.distributed's. The ranks share
    this process's threads while the group runs (each gets threads // size). One group a
    process (torch.distributed's default group): `group(size)` gives it."""

    def __init__(self, size: int):
        import zmq

        self.size, self.procs, self.broken = size, [], None
        self.threads_before = torch.get_num_threads()
        self.threads = max(1, self.threads_before // size)   # the cores shared by the ranks
        torch.set_num_threads(self.threads)
        self.shards = {}                                # rank -> a queue of shards (spawned)
        timeout = datetime.timedelta(seconds=RANK_TIMEOUT_S)
        if launched_by_torchrun():
            if int(os.environ["RANK"]) != 0 or int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(f"this process is rank {os.environ['RANK']} of "
                                 f"{os.environ['WORLD_SIZE']} (torchrun's environment), not "
                                 f"rank 0 of tensor_parallel_size {size}")
            host = os.environ["MASTER_ADDR"]
            dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        else:
            host, address = "127.0.0.1", f"tcp://127.0.0.1:{free_port()}"
            self.spawn(address)
            dist.init_process_group("gloo", init_method=address, rank=0,
                                    world_size=size, timeout=timeout)
        self.zmq = zmq.Context()                        # bound where the other ranks reach
        where = "tcp://127.0.0.1" if host == "127.0.0.1" else "tcp://*"
        self.out, addresses = {}, [{}, None]
        for r in range(1, size):
            self.out[r] = self.zmq.socket(zmq.PUSH)
            addresses[0][r] = f"tcp://{host}:{self.out[r].bind_to_random_port(where)}"
        self.errors = self.zmq.socket(zmq.PULL)
        addresses[1] = f"tcp://{host}:{self.errors.bind_to_random_port(where)}"
        dist.broadcast_object_list(addresses, src=0)

    def spawn(self, address: str) -> None:
        """Start ranks 1..size-1 (torch.multiprocessing, spawn) and wait until each says it is
        about to join (or raise naming the one that ended first)."""
        ctx = torch.multiprocessing.get_context("spawn")
        joining = ctx.SimpleQueue()
        if multiprocessing.current_process().daemon:    # a daemon (the server's engine
            multiprocessing.current_process().daemon = False   # process) may not have children
        for r in range(1, self.size):
            self.shards[r] = ctx.Queue()
            proc = ctx.Process(target=rank_main, name=f"tinyllm-rank-{r}", daemon=True,
                               args=(r, self.size, address, self.shards[r], joining,
                                     self.threads))
            proc.start()
            self.procs.append(proc)
        self.wait_joining(joining)

    def wait_joining(self, joining) -> None:
        waiting, t0 = set(range(1, self.size)), time.monotonic()
        while waiting:
            while not joining.empty():
                waiting.discard(joining.get())
            for r, proc in enumerate(self.procs, 1):
                if r in waiting and not proc.is_alive():
                    self.close()
                    raise RankFailed(f"tensor-parallel rank {r} failed to start: its process "
                                     f"ended with exit code {proc.exitcode}")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                self.close()
                raise RankFailed(f"tensor-parallel ranks {sorted(waiting)} did not start within "
                                 f"{START_TIMEOUT_S} s")
            time.sleep(0.01)

    def send(self, message) -> None:
        """Hand every other rank a message (pickled once)."""
        import zmq

        self.check()
        data, t0 = pickle.dumps(message), time.monotonic()
        for r, sock in self.out.items():    # a rank gone takes no message: that is no wait
            while not sock.poll(50, zmq.POLLOUT):
                if any(not p.is_alive() for p in self.procs) or \
                        time.monotonic() - t0 > RANK_TIMEOUT_S:
                    raise self.failed(RuntimeError(f"rank {r} takes no message")) or \
                        RankFailed(f"tensor-parallel rank {r} took no message for "
                                   f"{RANK_TIMEOUT_S} s")
            sock.send(data, zmq.NOBLOCK)

    def drop(self, model_id: int) -> None:
        """The other ranks let a model's shards and cache go (its ParallelModel is gone)."""
        if _group is self and self.broken is None:
            with contextlib.suppress(Exception):
                self.send(("drop", model_id))

    def put_shard(self, rank: int, part: Transformer) -> None:
        """A shard for a spawned rank, through its queue (shared memory: not copied)."""
        self.shards[rank].put(part)

    def check(self) -> None:
        if self.broken is not None:
            raise RankFailed(self.broken)

    def failed(self, e: Exception) -> RankFailed | None:
        """The error of a collective that failed: what a rank said before it ended, else which
        rank's process ended (the group is broken from then on); None when every spawned rank
        lives and none said a word (the error was rank 0's own)."""
        import zmq

        said, t0 = None, time.monotonic()             # a rank that raised says so, then ends
        while said is None and time.monotonic() - t0 < 2:
            if self.errors.poll(50, zmq.POLLIN):
                said = pickle.loads(self.errors.recv())
            elif any(not p.is_alive() for p in self.procs) and time.monotonic() - t0 > 0.2:
                break
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        if said is not None:
            why = f"tensor-parallel rank {said[0]} failed: {said[1]}"
        elif dead:
            why = (f"tensor-parallel rank {dead[0][0]} died (exit code {dead[0][1]}) during a "
                   f"step: the engine cannot go on")
        elif self.procs:
            return None                                 # every rank lives, and none said a word
        else:                                           # torchrun's ranks: only what gloo said
            why = f"the tensor-parallel group failed during a step: {str(e).splitlines()[0]}"
        self.broken = why
        return RankFailed(why)

    def close(self) -> None:
        """Stop the other ranks and leave the group; this process gets its threads back."""
        torch.set_num_threads(self.threads_before)
        if getattr(self, "out", None):
            import zmq
            for sock in self.out.values():
                try:
                    sock.send(pickle.dumps(("stop",)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass                                # a rank gone
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if getattr(self, "zmq", None) is not None:
            self.zmq.destroy(linger=0)
            self.zmq = None


_group: Ranks | None = None


def other_ranks_cpu_s() -> float:
    """The CPU seconds the process's spawned ranks have used so far (Linux's /proc; 0 where
    it is not, or no group runs): a run's CPU cost is every rank's."""
    if _group is None:
        return 0.0
    return sum(process_cpu_s(proc.pid) for proc in _group.procs)


def process_cpu_s(pid: int, waited: bool = False) -> float:
    """A process's CPU seconds so far (/proc's utime and stime; with waited, its children's it
    waited for too, cutime and cstime); 0 where it is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(t) for t in fields[11:15 if waited else 13]) / os.sysconf("SC_CLK_TCK")


def group(size: int) -> Ranks:
    """The process's group of size ranks: the one running, or a new one (closing one of
    another size, or a broken one)."""
    global _group
    if _group is not None and (_group.size != size or _group.broken is not None):
        close_group()
    if _group is None:
        _group = Ranks(size)
        atexit.register(close_group)                    # the other ranks stop with this process,
        multiprocessing.util.Finalize(None, close_group, exitpriority=10)   # a child's too
    return _group


def close_group() -> None:
    """Stop the process's group, if one runs (its models then refuse to step)."""
    global _group
    if _group is not None:
        _group.close()
        _group, ParallelModel.ids = None, itertools.count()


class ParallelModel(nn.Module):
    """A model split over size ranks, as the engine sees it: layers_pass, compute_logits and the
    forward pass of a Transformer, each run by every rank on its shard, rank 0 (this process)
    saying what to run. `cfg` is rank 0's shard's (its KV heads: the engine's cache holds
    those; the vocabulary is the model's). The shards are made at once (`shard`), the ranks
    start at the first pass or `start()`; an engine's cache is announced with `attach`, and a
    rank's copy follows each step's plan. A ParallelModel pickles before it starts (to the
    server's engine process, shards in shared memory) and belongs to its process after."""

    ids = itertools.count()

    def __init__(self, model: Transformer, size: int):
        super().__init__()
        own = int(os.environ["RANK"]) if launched_by_torchrun() else None
        if own not in (None, 0):
            raise ValueError(f"this process is rank {own}: it serves steps (serve_rank), rank 0 "
                             f"holds the ParallelModel")
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("tensor_parallel_size > 1 splits a model over CPU processes (gloo); "
                             "several GPUs (NCCL) are not supported yet")
        shards = [shard(model, r, size) for r in range(size if own is None else 1)]
        self.size, self.shard, self.others = size, shards[0], shards[1:]
        self.cfg, self.quant = self.shard.cfg, getattr(model, "quant", None)
        self.id, self.ranks, self.cache, self.spec = None, None, None, None

    @property
    def layers(self):
        return self.shard.layers

    def __getstate__(self):
        if self.ranks is not None:
            raise TypeError("a started ParallelModel belongs to its process (its ranks answer "
                            "it alone): pickle it before its first pass")
        return super().__getstate__()

    def start(self) -> None:
        """Join (or start) the process's group of size ranks and hand each rank its shard; a
        model whose group was closed (another size started one) joins the new group, unless its
        engine's cache holds requests, which the new ranks never saw."""
        if self.ranks is not None:
            self.ranks.check()
            if _group is self.ranks:
                return
            if self.cache is not None and any(self.cache.active):
                raise RankFailed("this model's tensor-parallel group was closed while its "
                                 "engine served requests")
        self.ranks, self.id = group(self.size), next(ParallelModel.ids)
        self.ranks.send(("load", self.id))
        weakref.finalize(self, self.ranks.drop, self.id)   # its shards go when it does
        for r, part in enumerate(self.others, 1):
            if self.ranks.procs:
                self.ranks.put_shard(r, part)
        if self.spec is not None:
            self.ranks.send(("cache", self.id, self.spec))

    def attach(self, cache) -> None:
        """The engine's cache, on rank 0: every rank makes a cache of its own heads like it."""
        self.cache, self.spec = cache, spec_of(cache)
        if self.ranks is not None and (self.ranks.broken is not None or self.ranks is not _group):
            self.ranks = None                           # a new engine starts a new group
        if self.ranks is not None:
            self.ranks.send(("cache", self.id, self.spec))

    def layers_pass(self, idx: Tensor, cache=None):
        """Transformer.layers_pass on every rank: the plan sent, then rank 0's own shard."""
        self.start()
        if cache is not None and cache is not self.cache:
            raise ValueError("this ParallelModel's ranks hold another engine's cache: one engine "
                             "at a time (attach the cache first)")
        plan = None if cache is None else cache.planned_step()
        self.ranks.send(("layers", self.id, idx.cpu(), plan))
        with self.in_step():
            return self.shard.layers_pass(idx, cache)

    def compute_logits(self, x: Tensor) -> Tensor:
        """The final norm and the head over the ranks: x (..., d) -> logits (..., V), each rank
        computing its part of the vocabulary, rank 0 gathering them."""
        self.start()
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.size(-1))                                     # (M, d)
        self.ranks.send(("head", self.id, x2.cpu()))
        with self.in_step():
            parts = gather_logits(self.shard, x2, self.size, dst=True)
        return parts.reshape(*lead, -1)

    @contextlib.contextmanager
    def in_step(self):
        """Rank 0's part of a pass. A collective that fails is a rank gone (Ranks.failed); any
        other error leaves the ranks out of step (one waits in a collective rank 0 left): the
        group is closed, the error raised, and the next engine starts new ranks."""
        try:
            yield
        except RankFailed:
            raise
        except BaseException as e:
            failed = self.ranks.failed(e) if isinstance(e, RuntimeError) else None
            if failed is not None:
                raise failed from None
            close_group()
            raise

    def forward(self, idx: Tensor, cache=None, targets: Tensor | None = None):
        if targets is not None:
            raise ValueError("a ParallelModel serves: it computes no loss")
        x, where = self.layers_pass(idx, cache)
        return unpacked(self.compute_logits(x), where, *idx.shape), None


def gather_logits(part: Transformer, x2: Tensor, size: int, dst: bool) -> Tensor | None:
    """Every rank's logits of x2 (M, d) for its part of the vocabulary, gathered on rank 0 (dst:
    this is rank 0, which gets (M, V); the others get None). A rank's part is padded to the
    widest part: a gather moves tensors of one shape."""
    vocab = parallel.shard_ranges(part.cfg.vocab_size, size)   # the seam, as shard cut it
    width = max(hi - lo for lo, hi in vocab)
    local = part.compute_logits(x2)                                        # (M, width or less)
    if local.size(-1) < width:
        local = F.pad(local, (0, width - local.size(-1)))
    into = [torch.empty_like(local) for _ in range(size)] if dst else None
    t0 = time.perf_counter()
    dist.gather(local.contiguous(), into, dst=0)
    TALK["gathers"] += 1
    TALK["gather_s"] += time.perf_counter() - t0
    if not dst:
        return None
    return torch.cat([p[:, :hi - lo] for p, (lo, hi) in zip(into, vocab)], dim=-1)


# ---- the other ranks ---------------------------------------------------------------------------
def rank_main(rank: int, size: int, address: str, shards, joining, n_threads: int) -> None:
    """A spawned rank's process: join the group, then serve steps (serve_rank)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C is rank 0's to handle
    torch.set_num_threads(n_threads)
    joining.put(rank)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    serve_rank(rank, size, shards.get)


def serve_rank(rank: int, size: int, next_shard) -> None:
    """Rank `rank`'s loop, once it has joined the group: each message of rank 0 acted on
    ("load": take the next shard, next_shard(); "cache": make a cache like rank 0's; "layers"
    and "head": run the pass on the shard; "drop"; "stop"). An error is sent to rank 0 in one
    line, and the rank ends; so does a rank whose rank 0 is gone."""
    import zmq

    addresses = [None, None]
    dist.broadcast_object_list(addresses, src=0)
    ctx = zmq.Context()
    inbox, errors = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(addresses[0][rank])
    errors.connect(addresses[1])
    models, caches = {}, {}
    parent = multiprocessing.parent_process()
    try:
        with torch.inference_mode():
            while True:
                if not inbox.poll(1000):
                    if parent is not None and not parent.is_alive():
                        return
                    continue
                message = pickle.loads(inbox.recv())
                kind = message[0]
                if kind == "stop":
                    return
                if kind == "load":
                    models[message[1]] = next_shard()
                elif kind == "drop":
                    models.pop(message[1], None)
                    caches.pop(message[1], None)
                elif kind == "cache":
                    caches[message[1]] = mirror_cache(models[message[1]], message[2])
                elif kind == "layers":
                    _, mid, idx, plan = message
                    cache = None if plan is None else caches[mid]
                    if plan is not None:
                        cache.follow(plan)
                    models[mid].layers_pass(idx, cache)
                elif kind == "head":
                    gather_logits(models[message[1]], message[2], size, dst=False)
    except Exception as e:
        line = traceback.format_exception_only(e)[-1].strip()
        errors.send(pickle.dumps((rank, line)))
        errors.close(linger=2000)
        raise SystemExit(1) from None
    finally:
        ctx.destroy(linger=0)
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_torchrun_rank(model: Transformer, size: int) -> None:
    """Under torchrun, rank RANK > 0's whole life: its shard of the model (loaded here by the
    same command as rank 0's), the group joined, steps served until rank 0 stops."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"torchrun started {world} processes; tensor_parallel_size is {size}")
    part = shard(model, rank, size)
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    serve_rank(rank, size, lambda: part)


def parallel_model(model: Transformer, size: int) -> ParallelModel:
    """The ParallelModel of a model over size ranks (a ParallelModel given is itself), made once
    and kept while the model lives, so that the engines of one model share its shards and
    ranks."""
    if isinstance(model, ParallelModel):
        if model.size != size:
            raise ValueError(f"the ParallelModel given is split over {model.size} ranks, the "
                             f"config asks for tensor_parallel_size {size}")
        return model
    made = _made.setdefault(model, {})
    if size not in made:
        made[size] = ParallelModel(model, size)
    return made[size]


_made: "weakref.WeakKeyDictionary[Transformer, dict]" = weakref.WeakKeyDictionary()
