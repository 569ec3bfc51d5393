"""Exercise 14 - tensor parallelism: one model split over several ranks, each layer in pieces
(Megatron's split), and the all-reduce that adds a row-parallel layer's partial sums.

Four seams of the reference package, all in `tinyllm.ext.parallel`:
- `shard_ranges` splits n things (a layer's KV groups, the MLP's width, the vocabulary) over
  size ranks, in order: each rank one contiguous range [lo, hi), the first n % size ranks one
  more than the others (3 KV groups over 2 ranks: [(0, 2), (2, 3)]);
- `shard_column` gives a column-parallel layer's part (q, k and v, the MLP's gate and up, the
  head): the rows lo..hi-1 of its weight, the output features the rank computes from the whole
  input, and the same entries of its bias;
- `shard_row` gives a row-parallel layer's part (the attention's output, the MLP's down): the
  columns lo..hi-1 of its weight, the input features the rank holds, made contiguous; its bias
  is not split;
- `row_parallel` is a row-parallel layer's forward pass on one rank: its partial product, the
  all-reduce that adds every rank's partial sum into it (after which every rank holds the whole
  output), then the bias, added once.

The engine calls them through `shard`, which builds a rank's part of a Transformer: your
shard_ranges picks the rank's KV groups (their query heads with them), its part of the MLP's
width and of the vocabulary; your shard_column and shard_row cut each layer's weights (float
ones, or a quantized layer's integers and scales, 13); each row-parallel layer becomes a
`RowParallelLinear` whose forward pass is your row_parallel (the one the module holds when the
layer is made: it goes with the shard to the other ranks). `ranks.ParallelModel(model, size)`,
which
`make_engine(model, EngineConfig(..., tensor_parallel_size=2))` builds, makes every rank's
shard in the engine's process (rank 0) and hands the others to ranks spawned as processes,
their all-reduces torch.distributed's (gloo); `ThreadedRanks(size)` runs the shards as
threads of one process, with an all-reduce of its own, to look at the split without processes.

Check your work with `make check EX=14` (or `check_exercise("14")` in notebook 14). The tests
compare your ranges, rows and columns with the rule, your row_parallel with a stand-in
all-reduce and on ranks as threads, then plug your functions into `shard` and hold the split
model (float64, with biases, 3 KV groups over 2 ranks) to the whole one through ThreadedRanks,
and run a ContinuousEngine on a paged pool over 2 ranks as processes: every request gets the
tokens of its solo run on the whole model.
"""

from torch import Tensor


def shard_ranges(n: int, size: int) -> list[tuple[int, int]]:
    """n things (KV groups, the MLP's width, the vocabulary) over size ranks, in order: rank r
    holds [lo, hi), the first n % size ranks one more than the others.
    Example: 3 KV groups over 2 ranks -> [(0, 2), (2, 3)]; 1536 -> [(0, 768), (768, 1536)]."""
    each, more = divmod(n, size)                # every rank each, the first `more` one more
    starts = [r * each + min(r, more) for r in range(size + 1)]     # rank r's lo; the last: n
    return list(zip(starts, starts[1:]))


def shard_column(weight: Tensor, bias: Tensor | None, lo: int, hi: int
                 ) -> tuple[Tensor, Tensor | None]:
    """A column-parallel layer's part: output features lo..hi-1 of W (out, in, ...), the rows
    of its weight, and of its bias (None stays None).
    Example: W (6, 4), lo 2, hi 4 -> W[2:4] (2, 4) and bias[2:4]."""
    part = weight[lo:hi]                        # (hi - lo, in, ...): this rank's outputs
    return part, None if bias is None else bias[lo:hi]


def shard_row(weight: Tensor, lo: int, hi: int) -> Tensor:
    """A row-parallel layer's part: input features lo..hi-1 of W (out, in, ...), the columns of
    its weight, made contiguous (a product reads its rows). The bias is not split: it is added
    once, after the all-reduce (row_parallel).
    Example: W (4, 6), lo 0, hi 3 -> W[:, 0:3] (4, 3)."""
    return weight[:, lo:hi].contiguous()        # (out, hi - lo, ...), rows of its own


def row_parallel(x: Tensor, local, bias: Tensor | None, all_reduce) -> Tensor:
    """A row-parallel layer's output on one rank: x (..., in / size) is this rank's part of the
    input; local(x) its partial product with its columns of W (..., out); all_reduce(t) adds
    every rank's t into t, in place. Returns the whole output, the same on every rank: the
    partial sums added over the ranks, then the bias (None: none), added once."""
    y = local(x)                                # (..., out): this rank's partial sum
    all_reduce(y)                               # (..., out): every rank's, added in place
    return y if bias is None else y + bias      # the bias once, after the sum
