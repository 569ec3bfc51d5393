"""Step 14 - tensor parallelism: one model over several processes, with torch.distributed.

A model that outgrows one device is split across several, each layer in pieces (Megatron's
split, as vLLM's, SGLang's and nano-vllm's model code does it). In each layer:
- q, k and v, and the MLP's gate and up, are split by output (**column-parallel**): a rank holds
  the rows of W for its own heads (whole KV groups, their query heads with them) and its part
  of the MLP's width, and computes them from the whole input with no talk;
- the attention's output and the MLP's down projection are split by input
  (**row-parallel**): a rank multiplies its own columns of W with its own part of the input
  and gets a partial sum of the whole output; one **all-reduce** adds the ranks' partial sums,
  after which every rank holds the whole output, the bias added once (`row_parallel`);
- the embedding is whole on every rank (a lookup reads a row a token); the head is split by
  vocabulary (column-parallel), and rank 0 gathers the logits of the positions it samples.
So a layer costs two all-reduces of (tokens, d_model), and a rank keeps 1/size of the layers'
weights and the KV cache of its own heads. Where the KV heads do not divide (SmolLM2: 9 query
heads in 3 KV groups), the ranks take whole KV groups, unevenly (the first ranks one more):
vLLM refuses such a size; a rank never needs another rank's keys.

The runtime is the field's own, `torch.distributed`, here its gloo backend between CPU
processes (several GPUs would take NCCL, the same calls; not built here). Rank 0 is
the engine's process: it runs the scheduler and the token stage, and sends each step's plan
(the token ids, and the rows' slots, lengths and block tables: `step_plan`) to the other ranks
over ZeroMQ, the way vLLM's and nano-vllm's model runners send theirs; every rank then runs the
same forward pass on its shard and its own cache (`Rank`), the all-reduces in step. On one
machine the other ranks are spawned processes (`Ranks`); across machines every rank starts
under `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment) and joins
the same group. `ParallelModel` is what the engine holds: a model, to the engine, like any
other. A rank that dies or fails to start ends the engine with one error that names it.

    make_engine(model, EngineConfig(8, tensor_parallel_size=2))   # holds ParallelModel(model, 2)
"""

import atexit
import contextlib
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
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tinyllm.core.model import Transformer, unpacked

RANK_TIMEOUT_S = 120       # a rank that does not join, or answer within a step, for this long
START_TIMEOUT_S = 120      # spawned ranks that have not joined by then failed to start


# ---- the split (exercise 14's seams) -----------------------------------------------------------
def shard_ranges(n: int, size: int) -> list[tuple[int, int]]:
    """n things (KV groups, the MLP's width, the vocabulary) over size ranks, in order: rank r
    holds [lo, hi), the first n % size ranks one more than the others.
    Example: 3 KV groups over 2 ranks -> [(0, 2), (2, 3)]; 1536 -> [(0, 768), (768, 1536)]."""
    each, more = divmod(n, size)
    starts = [r * each + min(r, more) for r in range(size + 1)]
    return list(zip(starts, starts[1:]))


def shard_column(weight: Tensor, bias: Tensor | None, lo: int, hi: int
                 ) -> tuple[Tensor, Tensor | None]:
    """A column-parallel layer's part: output features lo..hi-1 of W (out, in, ...), the rows
    of its weight, and of its bias (None stays None).
    Example: W (6, 4), lo 2, hi 4 -> W[2:4] (2, 4) and bias[2:4]."""
    return weight[lo:hi], None if bias is None else bias[lo:hi]


def shard_row(weight: Tensor, lo: int, hi: int) -> Tensor:
    """A row-parallel layer's part: input features lo..hi-1 of W (out, in, ...), the columns of
    its weight, made contiguous (a product reads its rows). The bias is not split: it is added
    once, after the all-reduce (row_parallel).
    Example: W (4, 6), lo 0, hi 3 -> W[:, 0:3] (4, 3)."""
    return weight[:, lo:hi].contiguous()


def row_parallel(x: Tensor, local, bias: Tensor | None, all_reduce) -> Tensor:
    """A row-parallel layer's output on one rank: x (..., in / size) is this rank's part of the
    input; local(x) its partial product with its columns of W (..., out); all_reduce(t) adds
    every rank's t into t, in place. Returns the whole output, the same on every rank: the
    partial sums added over the ranks, then the bias (None: none), added once."""
    y = local(x)
    all_reduce(y)
    return y if bias is None else y + bias


# ---- a shard of a model ------------------------------------------------------------------------
TALK = {"all_reduces": 0, "all_reduce_s": 0.0, "gathers": 0, "gather_s": 0.0}  # rank 0's


def all_reduce(t: Tensor) -> None:
    """Sum t over the ranks of the process's group, in place, counted and timed in TALK: an
    all-gather of every rank's t (torch.distributed) and their sum in rank order, the same
    bits on every rank. gloo's own all_reduce of a small tensor takes two rounds between the
    ranks (a reduce-scatter, then an all-gather): twice the wait of this one round on a CPU."""
    t0 = time.perf_counter()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    t.copy_(total)
    TALK["all_reduces"] += 1
    TALK["all_reduce_s"] += time.perf_counter() - t0


class RowParallelLinear(nn.Module):
    """A row-parallel layer: `local`, a layer of this rank's input columns and no bias (a float,
    C or quantized layer); the whole bias or None; all_reduce(t) sums t over the ranks in
    place. forward is `row_parallel`, as the module had it when the layer was made (a learner's
    version goes with the layer to the other ranks)."""

    def __init__(self, local: nn.Module, bias: Tensor | None, reduce=all_reduce):
        super().__init__()
        self.local, self.reduce, self.combine = local, reduce, row_parallel
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        return self.combine(x, self.local, self.bias, self.reduce)


def clone(module: nn.Module) -> nn.Module:
    """A shallow copy of a module: its own lists of children, parameters and buffers (to
    replace some), the same tensors."""
    new = object.__new__(type(module))
    new.__dict__ = module.__dict__.copy()
    for name in ("_parameters", "_buffers", "_modules"):
        new.__dict__[name] = dict(module.__dict__[name])
    return new


def column_layer(layer: nn.Module, lo: int, hi: int) -> nn.Module:
    """The rows lo..hi-1 of a linear layer (nn.Linear, a C loop's GemvLinear, a QuantLinear of
    13), as a layer of the same kind."""
    from tinyllm.ext.quant import QuantLinear

    if isinstance(layer, QuantLinear):
        q, bias = shard_column(layer.q, layer.bias, lo, hi)
        zero = None if layer.zero is None else shard_column(layer.zero, None, lo, hi)[0]
        return QuantLinear(layer.bits, q, shard_column(layer.scale, None, lo, hi)[0], zero,
                           layer.in_features, bias, layer.kernel)
    weight, bias = shard_column(layer.weight.detach(), layer.bias, lo, hi)
    return linear_like(layer, weight, bias)


def row_layer(layer: nn.Module, lo: int, hi: int, reduce=all_reduce) -> RowParallelLinear:
    """The input columns lo..hi-1 of a linear layer, in a RowParallelLinear with its bias. A
    QuantLinear's groups are split whole: lo and hi must fall on its groups' edges."""
    from tinyllm.ext.quant import QuantLinear

    if isinstance(layer, QuantLinear):
        g = layer.group_size
        if layer.scale.size(1) == 1:                    # one scale a row: any columns
            q, scale, zero = shard_row(layer.q, lo, hi), layer.scale, layer.zero
        elif lo % g or hi % g:
            raise ValueError(f"a rank's columns {lo}..{hi - 1} cut the quantized layer's groups "
                             f"of {g}: use a tensor_parallel_size whose shards hold whole groups")
        else:
            q = shard_row(layer.q, lo // g, hi // g)
            scale = shard_row(layer.scale, lo // g, hi // g)
            zero = None if layer.zero is None else shard_row(layer.zero, lo // g, hi // g)
        local = QuantLinear(layer.bits, q, scale, zero, hi - lo, None, layer.kernel)
    else:
        local = linear_like(layer, shard_row(layer.weight.detach(), lo, hi), None)
    return RowParallelLinear(local, layer.bias, reduce)


def linear_like(layer: nn.Linear, weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """A linear layer of layer's own class (nn.Linear, GemvLinear) holding weight and bias."""
    new = type(layer)(weight.size(1), weight.size(0), bias is not None, device="meta")
    new.weight = nn.Parameter(weight, requires_grad=False)
    new.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
    return new


def shard(model: Transformer, rank: int, size: int, reduce=all_reduce) -> Transformer:
    """Rank `rank`'s part of the model, of size ranks: in every layer, the q, k and v rows of
    its whole KV groups and the gate and up rows of its part of the MLP (column-parallel), the
    matching columns of the attention output and the down projection (row-parallel, each
    followed by reduce); the head's rows of its part of the vocabulary; the embedding and the
    norms whole. Its cfg says its own heads (the vocabulary stays the model's); `tp_vocab`
    says which logits its head computes. The tensors it keeps whole are the model's own."""
    cfg = model.cfg
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    if size > cfg.n_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} is more than the model's {cfg.n_kv_heads} "
                         f"KV heads: a rank holds whole KV groups")
    lo, hi = shard_ranges(cfg.n_kv_heads, size)[rank]          # this rank's KV groups
    group, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    qs, kvs = (lo * group * hd, hi * group * hd), (lo * hd, hi * hd)   # rows of q, of k and v
    unit = whole_groups(model.layers[0].mlp.down_proj)          # the MLP's width, in whole
    ff = tuple(unit * i for i in shard_ranges(cfg.d_ff // unit, size)[rank])  # quantized groups
    part = clone(model)
    part.cfg = replace(cfg, n_heads=(hi - lo) * group, n_kv_heads=hi - lo, d_ff=ff[1] - ff[0])
    part.layers = nn.ModuleList()
    for block in model.layers:
        attn, mlp = clone(block.self_attn), clone(block.mlp)
        attn.n_heads, attn.n_kv_heads = part.cfg.n_heads, part.cfg.n_kv_heads
        attn.q_proj = column_layer(attn.q_proj, *qs)
        attn.k_proj, attn.v_proj = column_layer(attn.k_proj, *kvs), column_layer(attn.v_proj, *kvs)
        attn.o_proj = row_layer(attn.o_proj, *qs, reduce)
        mlp.gate_proj = column_layer(mlp.gate_proj, *ff)
        mlp.up_proj = column_layer(mlp.up_proj, *ff)
        mlp.down_proj = row_layer(mlp.down_proj, *ff, reduce)
        new = clone(block)
        new.self_attn, new.mlp = attn, mlp
        part.layers.append(new)
    part.tp_vocab = shard_ranges(cfg.vocab_size, size)[rank]
    part.lm_head = column_layer(model.lm_head, *part.tp_vocab)
    return part


def whole_groups(layer: nn.Module) -> int:
    """The columns a row-parallel split of this layer keeps together: a quantized layer's group
    (a QuantLinear in groups along its input), else 1."""
    from tinyllm.ext.quant import QuantLinear

    if isinstance(layer, QuantLinear) and layer.scale.size(1) > 1:
        return layer.group_size
    return 1


def shard_bytes(part: Transformer) -> dict:
    """The bytes a rank keeps: its layers' weights, the norms, its part of the head, and the
    embedding (whole on every rank)."""
    def size(module: nn.Module) -> int:
        return sum(t.numel() * t.element_size()
                   for t in itertools.chain(module.parameters(), module.buffers())
                   if not t.is_meta and t.dim() > 0) if module is not None else 0
    embed = part.embed_tokens.weight
    head = size(part.lm_head)
    if getattr(part.lm_head, "weight", None) is not None and \
            part.lm_head.weight.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr():
        head = 0                                        # a tied head: rows of the embedding
    return {"layers": sum(size(b) for b in part.layers), "head": head,
            "embedding": embed.numel() * embed.element_size(), "norm": size(part.norm)}


# ---- the step's plan, and a rank's copy of the cache -------------------------------------------
@dataclass
class StepPlan:
    """What a rank needs of rank 0's cache to run a step: the rows' slots and new tokens (as
    plan_step took them), the tokens each slot holds, and a paged cache's block tables of the
    rows (None for slots)."""
    rows: list[int]
    q_lens: list[int]
    lens: list[int]
    tables: list[list[int]] | None


def step_plan(cache) -> StepPlan:
    """The plan of the step the cache has planned (plan_step), read from its books."""
    rows, q_lens = cache._planned()
    tables = None if not hasattr(cache, "tables") else [list(cache.tables[s]) for s in rows]
    return StepPlan(list(rows), list(q_lens), [cache.lens[s] for s in rows], tables)


def cache_spec(cache) -> tuple:
    """What makes a cache like this one on another rank: its kind and sizes, and its dtype."""
    dtype = cache.k[0].dtype
    if hasattr(cache, "tables"):
        return ("paged", cache.n_slots, cache.max_len, dtype, cache.n_blocks, cache.block_size)
    return ("slots", cache.n_slots, cache.max_len, dtype)


def mirror_cache(part: Transformer, spec: tuple, device=None):
    """A rank's cache of its own KV heads, with the sizes of rank 0's (cache_spec): its books
    are set from each step's plan (`follow`), its keys and values are its own."""
    from tinyllm.core.paged_kv import PagedKVCache
    from tinyllm.core.slot_cache import SlotKVCache

    cfg = part.cfg
    kind, n_slots, max_len, dtype, *paged = spec
    if kind == "paged":
        return PagedKVCache(cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, paged[0],
                            paged[1], max_len, dtype, device)
    return SlotKVCache(cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, max_len, dtype,
                       device)


def follow(cache, plan: StepPlan) -> None:
    """Set a rank's cache to rank 0's books for the step's rows, and plan the step."""
    for i, s in enumerate(plan.rows):
        cache.active[s], cache.lens[s] = True, plan.lens[i]
        if plan.tables is not None:
            cache.tables[s] = plan.tables[i]
    cache.plan_step(plan.rows, plan.q_lens)


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
    this process's threads (each gets threads // size; rank 0 keeps as many). One group a
    process (torch.distributed's default group): `group(size)` gives it."""

    def __init__(self, size: int):
        import zmq

        self.size, self.procs, self.broken = size, [], None
        self.threads = max(1, torch.get_num_threads() // size)   # the cores shared by the ranks
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
        """Stop the other ranks and leave the group."""
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
    total = 0.0
    for proc in _group.procs:
        try:
            fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


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
        for r, part in enumerate(self.others, 1):
            if self.ranks.procs:
                self.ranks.put_shard(r, part)
        if self.spec is not None:
            self.ranks.send(("cache", self.id, self.spec))

    def attach(self, cache) -> None:
        """The engine's cache, on rank 0: every rank makes a cache of its own heads like it."""
        self.cache, self.spec = cache, cache_spec(cache)
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
        plan = None if cache is None else step_plan(cache)
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
    vocab = shard_ranges(part.cfg.vocab_size, size)
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
                        follow(cache, plan)
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


# ---- ranks as threads of one process: the split checked without processes ---------------------
class ThreadedRanks:
    """size ranks as threads of this process, for a look at the split without processes (the
    notebook, exercise 14's first tests): `reduce(rank)` is rank's all-reduce, the ranks' tensors
    added in rank order once every rank has brought its own."""

    def __init__(self, size: int):
        import threading

        self.size, self.barrier, self.brought = size, threading.Barrier(size), [None] * size

    def reduce(self, rank: int):
        def all_reduce(t: Tensor) -> None:
            self.brought[rank] = t.clone()
            self.barrier.wait()
            total = self.brought[0]
            for other in self.brought[1:]:
                total = total + other
            self.barrier.wait()
            t.copy_(total)
        return all_reduce

    def logits(self, model: Transformer, idx: Tensor, parts: list | None = None) -> Tensor:
        """The whole model's logits of idx (B, T) (no cache: from position 0), computed by
        size shards in threads (made here with `shard`, or the parts given, made with
        this group's reduce), each head's part of the vocabulary put side by side."""
        import threading

        parts = parts or [shard(model, r, self.size, self.reduce(r)) for r in range(self.size)]
        out, failed = [None] * self.size, []

        def run(r: int) -> None:
            try:
                with torch.inference_mode():        # a thread's own: each rank's thread
                    x, _ = parts[r].layers_pass(idx)
                    out[r] = parts[r].compute_logits(x)
            except BaseException as e:          # a rank that fails lets the others go
                failed.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
        return torch.cat(out, dim=-1)
