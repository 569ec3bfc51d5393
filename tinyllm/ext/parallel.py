"""Step 14 - tensor parallelism: a model split over ranks, each layer in pieces.

Each layer is split as Megatron splits it (as vLLM's, SGLang's and nano-vllm's model code do):
q, k, v and the MLP's gate and up by output (**column-parallel**: a rank holds its own heads,
whole KV groups, the first ranks one more where they do not divide, and its part of the MLP's
width); the attention's output and the MLP's down projection by input (**row-parallel**: one
**all-reduce** adds the ranks' partial sums, the bias added once, `row_parallel`). The
embedding is whole on every rank; the head is split by vocabulary, and rank 0 gathers the
logits of the positions it samples.

`shard(model, rank, size)` is a rank's part of a model, its row-parallel layers calling
torch.distributed's all-reduce (`all_reduce`; ranks.py runs them) or `ThreadedRanks`' (the ranks
as threads). Seams (exercise 14): `shard_ranges`, `shard_column`, `shard_row`, `row_parallel`.

    parts = [shard(model, r, 2, ThreadedRanks(2).reduce(r)) for r in range(2)]
"""

import itertools
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tinyllm.core.model import Transformer


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
    """The bytes a rank keeps: its layers' weights, the norms, its part of the head (none for a
    float head tied to the embedding: rows of it), and the embedding (whole on every rank).
    Counted from the shapes, so a model on the meta device (shapes, no memory) is counted too."""
    def size(module: nn.Module) -> int:
        return sum(t.numel() * t.element_size()
                   for t in itertools.chain(module.parameters(), module.buffers()) if t.dim() > 0)
    embed = part.embed_tokens.weight
    tied = part.cfg.tie_embeddings and type(part.lm_head) is nn.Linear
    head = 0 if tied else size(part.lm_head)
    return {"layers": sum(size(b) for b in part.layers), "head": head,
            "embedding": embed.numel() * embed.element_size(), "norm": size(part.norm)}


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

    def run(self, work) -> list:
        """work(rank, all_reduce) on every rank, each in a thread of its own with this group's
        all-reduce -> their answers in rank order; the first error a rank raises is raised here
        (a rank that fails lets the others go)."""
        import threading

        out, failed = [None] * self.size, []

        def run(r: int) -> None:
            try:
                out[r] = work(r, self.reduce(r))
            except BaseException as e:
                failed.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
        return out

    def logits(self, model: Transformer, idx: Tensor, parts: list | None = None) -> Tensor:
        """The whole model's logits of idx (B, T) (no cache: from position 0), computed by
        size shards in threads (made here with `shard`, or the parts given, made with
        this group's reduce), each head's part of the vocabulary put side by side."""
        parts = parts or [shard(model, r, self.size, self.reduce(r)) for r in range(self.size)]

        def logits_of(r: int, _) -> Tensor:
            with torch.inference_mode():            # a thread's own: each rank's thread
                x, _ = parts[r].layers_pass(idx)
                return parts[r].compute_logits(x)

        out = self.run(logits_of)
        return torch.cat(out, dim=-1)
