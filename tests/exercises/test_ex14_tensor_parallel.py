"""Exercise 14 - tensor parallelism: your shard_ranges splits n things over the ranks as the
package does (in order, the first n % size ranks one more), your shard_column keeps a rank's
rows of a layer and your shard_row its columns, and your row_parallel adds the ranks' partial
sums with one all-reduce, then the bias once; plugged into `shard`, the split model (float64,
with biases, KV groups that do not divide) gives the whole model's logits on ranks as threads,
quantized or not, and a ContinuousEngine over 2 ranks as processes gives every request the
tokens of its solo run on the whole model."""

import copy
from contextlib import contextmanager

import pytest
import torch

from tests.conftest import MIXED_REQUESTS, make_tiny
from tests.exercises.conftest import run_engine
from tinyllm.build import make_engine
from tinyllm.core.config import EngineConfig
from tinyllm.core.generate import solo
from tinyllm.course import seams
from tinyllm.course.check import divergence, explained, leaks
from tinyllm.ext.parallel import ThreadedRanks
from tinyllm.ext.quant import quantize
from tinyllm.ext.ranks import ParallelModel, close_group

EXERCISE = "ex14_tensor_parallel"
REF = seams.reference("14")  # the package's own four functions

# The split model adds each row-parallel layer's partial sums in another order than the whole
# model's one product does: in float64 the logits may differ in their last bits, no more.
TOL = 1e-12


def numbered(n_rows: int, n_cols: int) -> torch.Tensor:
    """A (n_rows, n_cols) weight whose entry [i, j] is 100 * i + j: every row and every column
    is told apart by its values."""
    return (100 * torch.arange(n_rows)[:, None] + torch.arange(n_cols)).double()


def span(indices: list) -> str:
    """[3, 4, 5] -> '3..5'; other lists as they are ('?' for a row that is none of W's)."""
    if indices and "?" not in indices and indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}..{indices[-1]}" if len(indices) > 1 else f"{indices[0]}"
    return str(indices)


def which(whole: torch.Tensor, part: torch.Tensor, dim: int) -> str:
    """Which of whole's rows (dim 0) or columns (dim 1) part's are, in order."""
    found = []
    for i in range(part.size(dim)):
        got = part.select(dim, i)
        match = [k for k in range(whole.size(dim)) if torch.equal(whole.select(dim, k), got)]
        found.append(match[0] if match else "?")
    return span(found)


def shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"


# ---- shard_ranges ------------------------------------------------------------------------------
def ranges_mistake(got, n: int, size: int) -> str | None:
    """What is wrong with got as shard_ranges(n, size), in words; None when it is right."""
    call = f"shard_ranges({n}, {size})"
    want = REF["shard_ranges"](n, size)
    if not isinstance(got, (list, tuple)):
        return f"{call} should give a list of (lo, hi) pairs (shard picks rank r's), got {got!r}"
    try:
        mine = [tuple(int(v) for v in r) for r in got]
    except (TypeError, ValueError):
        return f"{call} should give a list of (lo, hi) pairs, one a rank, got {got!r}"
    if mine == want:
        return None
    if len(mine) != size or any(len(r) != 2 for r in mine):
        return f"{call} should give {size} (lo, hi) pairs, one a rank: {want}; got {got!r}"
    starts = [lo for lo, _ in mine] + [n]
    if mine[0][0] != 0 or any(hi != lo for (_, hi), lo in zip(mine, starts[1:])):
        return (
            f"{call} should give ranges that follow each other from 0 to {n}, rank r + 1's lo "
            f"being rank r's hi: {want}; got {mine}"
        )
    sizes = [hi - lo for lo, hi in mine]
    if sorted(sizes) == sorted(hi - lo for lo, hi in want):
        return (
            f"{call} should give the extra {n % size} thing(s) to the first ranks, rank 0 first: "
            f"{want}; yours gives rank by rank {sizes} things, {mine}"
        )
    return (
        f"{call} should give each rank {n // size} things, the first {n % size} rank(s) one "
        f"more: {want}; yours gives rank by rank {sizes} things, {mine}"
    )


def test_shard_ranges_the_docstrings_examples(impl):
    """3 KV groups over 2 ranks: [(0, 2), (2, 3)]; 1536 over 2: [(0, 768), (768, 1536)]."""
    for n, size in ((3, 2), (1536, 2)):
        mistake = ranges_mistake(impl.shard_ranges(n, size), n, size)
        assert mistake is None, mistake


@pytest.mark.parametrize(
    "n, size, want",
    [
        pytest.param(8, 2, [(0, 4), (4, 8)], id="8 over 2 ranks, even"),
        pytest.param(10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)], id="10 over 4 ranks, uneven"),
        pytest.param(3, 2, [(0, 2), (2, 3)], id="3 KV groups over 2 ranks"),
        pytest.param(97, 2, [(0, 49), (49, 97)], id="a vocabulary of 97 over 2 ranks"),
        pytest.param(4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)], id="as many ranks as things"),
        pytest.param(5, 1, [(0, 5)], id="one rank holds all"),
    ],
)
def test_shard_ranges_in_order_the_first_ranks_one_more(impl, n, size, want):
    """Rank r holds [lo, hi): the ranges follow each other from 0 to n, each rank n // size
    things and the first n % size ranks one more."""
    got = impl.shard_ranges(n, size)
    mistake = ranges_mistake(got, n, size)
    assert mistake is None, mistake
    assert [tuple(r) for r in got] == want


def test_shard_ranges_agrees_with_the_package_on_every_small_split(impl):
    """Every n from 1 to 40 over every size from 1 to n (up to 8): the package's ranges."""
    for n in range(1, 41):
        for size in range(1, min(n, 8) + 1):
            mistake = ranges_mistake(impl.shard_ranges(n, size), n, size)
            assert mistake is None, mistake


# ---- shard_column ------------------------------------------------------------------------------
def column_mistake(impl, weight: torch.Tensor, bias, lo: int, hi: int, W: str = "W") -> str | None:
    """What is wrong with your shard_column(weight, bias, lo, hi), in words, weight called W;
    None if right."""
    call = f"shard_column({W} {shape(weight)}, {'None' if bias is None else 'bias'}, {lo}, {hi})"
    got = impl.shard_column(weight, bias, lo, hi)
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"{call} should return a pair ({W}'s part, the bias's part or None), got {got!r}"
    part, b = got
    want = weight[lo:hi]
    if not isinstance(part, torch.Tensor) or part.shape != want.shape:
        if isinstance(part, torch.Tensor) and torch.equal(part, weight[:, lo:hi]):
            return (
                f"{call} gives {W}'s columns {lo}..{hi - 1}, shard_row's split: a column-parallel "
                f"layer keeps its rows {lo}..{hi - 1} (the output features the rank computes), "
                f"each whole, shape {shape(want)}"
            )
        return (
            f"{call} should give {W}'s rows {lo}..{hi - 1}, shape {shape(want)}, got {shape(part)}"
        )
    if not torch.equal(part, want):
        return (
            f"{call} should give {W}'s rows {lo}..{hi - 1} (the rank's output features), in "
            f"order; yours are {W}'s rows {which(weight, part, 0)}"
        )
    if bias is None:
        if b is not None:
            return f"{call}: a layer without a bias has none to split: give None, got {b!r}"
    elif not isinstance(b, torch.Tensor) or not torch.equal(b, bias[lo:hi]):
        what = (
            b
            if not isinstance(b, torch.Tensor)
            else f"the entries {which(bias.reshape(-1, 1), b.reshape(-1, 1), 0)}"
        )
        return (
            f"{call}: the bias's part should be its entries {lo}..{hi - 1}, those of the rows "
            f"kept; yours is {what}"
        )
    return None


def test_shard_column_the_docstrings_example(impl):
    """W (6, 4), lo 2, hi 4: W's rows 2 and 3, and the bias's entries 2 and 3."""
    mistake = column_mistake(impl, numbered(6, 4), 1000.0 + torch.arange(6.0), 2, 4)
    assert mistake is None, mistake


def test_shard_column_without_a_bias_gives_none(impl):
    """A layer without a bias (Llama's projections): its part's bias is None."""
    mistake = column_mistake(impl, numbered(5, 3), None, 1, 4)
    assert mistake is None, mistake


@pytest.mark.parametrize("size", [2, 3], ids=["2 ranks", "3 ranks"])
def test_shard_column_every_ranks_rows_give_the_layer_back(impl, size):
    """W (7, 5) and its bias over size ranks (uneven): each rank's part is its rows, and the
    parts stacked in rank order are the whole layer."""
    weight, bias = numbered(7, 5), 1000.0 + torch.arange(7.0)
    for lo, hi in REF["shard_ranges"](7, size):
        mistake = column_mistake(impl, weight, bias, lo, hi)
        assert mistake is None, mistake
    parts = [impl.shard_column(weight, bias, lo, hi) for lo, hi in REF["shard_ranges"](7, size)]
    assert torch.equal(torch.cat([w for w, _ in parts]), weight)
    assert torch.equal(torch.cat([b for _, b in parts]), bias)


def test_shard_column_a_quantized_layers_integers(impl):
    """A 4-bit layer of 13 holds q (out, groups, 16) uint8 and scale and zero (out, groups): a
    rank's rows are q's, scale's and zero's rows lo..hi-1, whatever follows the first axis."""
    q = torch.arange(6 * 2 * 16).reshape(6, 2, 16).to(torch.uint8)
    mistake = column_mistake(impl, q, None, 3, 6, W="q")
    assert mistake is None, mistake
    mistake = column_mistake(impl, numbered(6, 2).half(), None, 0, 3, W="scale")
    assert mistake is None, mistake


# ---- shard_row ---------------------------------------------------------------------------------
def row_mistake(impl, weight: torch.Tensor, lo: int, hi: int, W: str = "W") -> str | None:
    """What is wrong with your shard_row(weight, lo, hi), in words, weight called W; None if
    right."""
    call = f"shard_row({W} {shape(weight)}, {lo}, {hi})"
    got = impl.shard_row(weight, lo, hi)
    want = weight[:, lo:hi]
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        if isinstance(got, torch.Tensor) and torch.equal(got, weight[lo:hi]):
            return (
                f"{call} gives {W}'s rows {lo}..{hi - 1}, shard_column's split: a row-parallel "
                f"layer keeps its columns {lo}..{hi - 1} (the input features the rank holds) of "
                f"every row, shape {shape(want)}"
            )
        return (
            f"{call} should give {W}'s columns {lo}..{hi - 1} of every row, shape {shape(want)}, "
            f"got {shape(got)}"
        )
    if not torch.equal(got, want):
        return (
            f"{call} should give {W}'s columns {lo}..{hi - 1} (the rank's input features), in "
            f"order; yours are {W}'s columns {which(weight, got, 1)}"
        )
    if not got.is_contiguous():
        return (
            f"{call} gives the right columns as a view that strides over {W}'s rows: make it "
            f"contiguous (.contiguous()), so that the rank's product reads rows of its own"
        )
    return None


def test_shard_row_the_docstrings_example(impl):
    """W (4, 6), lo 0, hi 3: W's columns 0, 1 and 2 of every row, contiguous."""
    mistake = row_mistake(impl, numbered(4, 6), 0, 3)
    assert mistake is None, mistake


@pytest.mark.parametrize("size", [2, 3], ids=["2 ranks", "3 ranks"])
def test_shard_row_every_ranks_columns_give_the_layer_back(impl, size):
    """W (5, 7) over size ranks (uneven): each rank's part is its columns, contiguous, and the
    parts side by side in rank order are the whole weight; W is left as it was."""
    weight = numbered(5, 7)
    for lo, hi in REF["shard_ranges"](7, size):
        mistake = row_mistake(impl, weight, lo, hi)
        assert mistake is None, mistake
    parts = [impl.shard_row(weight, lo, hi) for lo, hi in REF["shard_ranges"](7, size)]
    assert torch.equal(torch.cat(parts, dim=1), weight)
    assert torch.equal(weight, numbered(5, 7)), "shard_row changed W"


def test_shard_row_a_quantized_layers_groups(impl):
    """A 4-bit layer's columns are whole groups: q (out, groups, 16) is cut along its groups,
    q[:, lo:hi], contiguous."""
    q = torch.arange(4 * 3 * 16).reshape(4, 3, 16).to(torch.uint8)
    mistake = row_mistake(impl, q, 1, 3, W="q")
    assert mistake is None, mistake


# ---- row_parallel ------------------------------------------------------------------------------
def close(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and torch.allclose(a, b, rtol=TOL, atol=TOL)
    )


def row_parallel_mistake(impl, with_bias: bool) -> str | None:
    """Your row_parallel on one rank of several, its all_reduce a stand-in that adds the other
    ranks' partial sums into the tensor it is handed: what is wrong, in words; None if right."""
    gen = torch.Generator().manual_seed(14)
    w = torch.randn(5, 3, generator=gen, dtype=torch.float64)  # this rank's columns of W
    x = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)  # its part of the input
    others = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64)  # the others' sums
    bias = torch.randn(5, generator=gen, dtype=torch.float64) if with_bias else None
    partial = x @ w.T  # (2, 4, 5): this rank's partial sum
    once = 0 if bias is None else bias
    handed = []

    def all_reduce(t: torch.Tensor) -> None:
        handed.append(t.clone())
        t.add_(others)

    got = impl.row_parallel(x.clone(), lambda t: t @ w.T, bias, all_reduce)
    if not handed:
        return (
            "your row_parallel never calls all_reduce: each rank holds only its partial sum "
            "(its columns of W times its part of x); call all_reduce(y) on y = local(x) before "
            "returning, to add the other ranks' partial sums into it"
        )
    if len(handed) > 1:
        return (
            f"your row_parallel calls all_reduce {len(handed)} times: one all-reduce adds every "
            "rank's partial sum, a second one adds them again"
        )
    if bias is not None and close(handed[0], partial + bias):
        return (
            "your row_parallel adds the bias before the all-reduce: every rank adds it, so the "
            "sum holds it size times; add it once, after all_reduce(y)"
        )
    if not close(handed[0], partial):
        return (
            "your row_parallel hands all_reduce something other than y = local(x), the rank's "
            "partial sum (its columns of W times its part of x)"
        )
    if close(got, partial + once):
        return (
            "your row_parallel returns the rank's own partial sum: all_reduce(y) adds the other "
            "ranks' sums into y in place (it returns None); return that y, then the bias"
        )
    if bias is not None and close(got, partial + others):
        return "your row_parallel leaves the bias out: add it once, after all_reduce(y)"
    if not close(got, partial + others + once):
        return (
            f"your row_parallel should return the all-reduced sum{' plus the bias' * with_bias}"
            f", shape (2, 4, 5); got {shape(got)}"
            + (
                f", off by up to {float((got - partial - others - once).abs().max()):.3g}"
                if isinstance(got, torch.Tensor) and got.shape == partial.shape
                else ""
            )
        )
    return None


def test_row_parallel_adds_the_other_ranks_sums_then_the_bias(impl):
    """x (2, 4, 3) on one rank, a stand-in all_reduce: the rank's partial sum local(x) goes to
    all_reduce, once; what comes back plus the bias is returned."""
    mistake = row_parallel_mistake(impl, with_bias=True)
    assert mistake is None, mistake


def test_row_parallel_without_a_bias(impl):
    """A layer without a bias (Llama's o_proj and down_proj): the all-reduced sum alone."""
    mistake = row_parallel_mistake(impl, with_bias=False)
    assert mistake is None, mistake


def on_threads(size: int, work):
    """work(rank, all_reduce) on size ranks as threads of this process, ThreadedRanks's
    all-reduce between them; their answers in rank order (the first error raised)."""
    return ThreadedRanks(size).run(work)


@pytest.mark.parametrize("size", [2, 3], ids=["2 ranks", "3 ranks"])
def test_row_parallel_on_ranks_as_threads_gives_the_whole_product(impl, size):
    """W (5, 7) with a bias, over size ranks as threads: each rank's row_parallel of its
    columns and its part of x returns x @ W.T + bias, the whole output, on every rank."""
    gen = torch.Generator().manual_seed(size)
    w = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    bias = torch.randn(5, generator=gen, dtype=torch.float64)
    x = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    spans = REF["shard_ranges"](7, size)

    def work(r: int, all_reduce):
        lo, hi = spans[r]
        local = lambda t: t @ w[:, lo:hi].T
        return impl.row_parallel(x[:, lo:hi], local, bias, all_reduce)

    got = on_threads(size, work)
    want = x @ w.T + bias
    for r, y in enumerate(got):
        lo, hi = spans[r]
        hint = ""
        if close(y, want + (size - 1) * bias):
            hint = (
                f": it holds the bias {size} times, once from each rank; add the bias after "
                "the all-reduce, not before"
            )
        elif close(y, x[:, lo:hi] @ w[:, lo:hi].T + bias):
            hint = (
                ": it is the rank's partial sum alone; call all_reduce(y) to add the other "
                "ranks' partial sums"
            )
        assert close(y, want), f"rank {r} of {size} does not return x @ W.T + bias{hint}"


# ---- the split model ---------------------------------------------------------------------------
def first_ranges_mistake(impl) -> str | None:
    """Your shard_ranges on the splits the models below use, and a few more."""
    for n, size in ((3, 2), (161, 2), (97, 2), (10, 4), (6, 3)):
        mistake = ranges_mistake(impl.shard_ranges(n, size), n, size)
        if mistake is not None:
            return mistake
    return None


def what_differs(impl) -> str | None:
    """The first of your functions that gives what the package's does not, in words; None
    when each one alone is right on these small cases (or is still the stub, which the error
    names already)."""
    probes = {
        "shard_ranges": lambda: first_ranges_mistake(impl),
        "shard_column": lambda: column_mistake(
            impl, numbered(7, 5), 1000.0 + torch.arange(7.0), 2, 5
        ),
        "shard_row": lambda: row_mistake(impl, numbered(5, 7), 2, 5),
        "row_parallel": lambda: row_parallel_mistake(impl, with_bias=True),
    }
    for name, probe in probes.items():
        try:
            mistake = probe()
        except NotImplementedError:
            mistake = None
        except Exception as e:
            mistake = f"your {name} raised {type(e).__name__}: {e}"
        if mistake is not None:
            return mistake
    return None


@contextmanager
def explained_with_hint(impl, what: str):
    """explained(what), and a failure inside it told with the first of your functions that
    is wrong on its own, when one is."""
    try:
        with explained(what):
            yield
    except AssertionError as e:
        hint = what_differs(impl)
        if hint is None:
            raise
        raise AssertionError(f"{e}; {hint}") from e


# tiny Llamas of make_tiny's (64 wide, 2 layers, a vocabulary of 97): 3 KV groups of 2 query
# heads, an MLP 161 wide, biases on q, k, v and o; or make_tiny's own 2 KV groups, no bias
UNEVEN = dict(n_heads=6, n_kv_heads=3, d_ff=161, qkv_bias=True, o_bias=True)
MODELS = {  # a model, and how many ranks split it
    "3 KV groups over 2 ranks, biases": (UNEVEN, 2),
    "3 KV groups over 3 ranks, biases": (UNEVEN, 3),
    "2 KV groups over 2 ranks, no bias": ({}, 2),
}


def held_to_whole(impl, what: str, got, want) -> None:
    """The split model's logits are the whole model's, to float64's rounding."""
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
        f"{what}: the logits should be {tuple(want.shape)}, got {shape(got)}"
    )
    err = float((got - want).detach().abs().max())
    assert err <= TOL, (
        f"{what}: the split model's logits differ from the whole model's by up to {err:.3g} "
        f"(float64 allows {TOL:g}: the all-reduce adds the partial sums in another order, "
        f"nothing more); "
        + (
            what_differs(impl)
            or "each of your functions alone gives the package's answer on the tests' small cases"
        )
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_the_split_model_gives_the_whole_models_logits(impl, plug, name):
    """Your functions plugged into `shard`, the model's ranks run as threads (ThreadedRanks):
    the logits of two prompts of 11 tokens are the whole model's, float64, to rounding. With
    biases on q, k, v and o, a bias added on every rank shows; 3 KV groups over 2 ranks split
    the heads, the MLP (161 wide) and the vocabulary (97) unevenly."""
    overrides, size = MODELS[name]
    model = make_tiny(seed=14, **overrides)
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        want, _ = model(idx)
    plug()
    with explained_with_hint(
        impl, f"the model split over {size} ranks (threads) with your functions"
    ):
        got = ThreadedRanks(size).logits(model, idx)
    held_to_whole(impl, name, got, want)


def test_a_quantized_model_split_gives_its_whole_logits(impl, plug):
    """The tiny model (with biases) quantized to int4 (13: q (out, groups, 16), scale and zero
    (out, groups)), split over 2 ranks by your functions: the whole quantized model's logits.
    Your shard_column and shard_row cut the integers and their scales as they cut a weight;
    the MLP's 5 groups of 32 go 3 and 2."""
    model = make_tiny(seed=14, qkv_bias=True, o_bias=True)
    model = quantize(copy.deepcopy(model), "int4", kernel="eager")
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        want, _ = model(idx)
    plug()
    with explained_with_hint(
        impl, "the int4 model split over 2 ranks (threads) with your functions"
    ):
        got = ThreadedRanks(2).logits(model, idx)
    held_to_whole(impl, "int4, 2 KV groups over 2 ranks", got, want)


def test_the_engine_over_two_processes_equals_solo(impl, plug):
    """ParallelModel(model, 2) made with your functions (float64, biases, 3 KV groups over 2
    ranks): rank 0 is this process, rank 1 a process of its own that runs your row_parallel on
    its shard, their all-reduces torch.distributed's (gloo). A ContinuousEngine on a paged pool
    holds it as its model: every request, greedy or seeded, gets the tokens of its solo run on
    the whole model, and nothing is left behind."""
    model = make_tiny(seed=14, **UNEVEN)
    reqs = MIXED_REQUESTS
    expected = [solo(model, r).tokens for r in reqs]
    plug()
    what = "the engine over 2 ranks (processes) with your functions"
    try:
        with explained_with_hint(impl, "ParallelModel(model, 2) with your functions"):
            split = ParallelModel(model, 2)  # every rank's shard is made here, with your functions
        config = EngineConfig(3, kv="paged", block_size=4, kv_blocks=7, tensor_parallel_size=2)
        eng = make_engine(split, config)
        with explained_with_hint(impl, what):
            rids = run_engine(eng, reqs, what, every=2, expected=expected)
        for i, (want, rid) in enumerate(zip(expected, rids)):
            why = divergence(f"request {i}", want, eng.results.pop(rid).tokens)
            assert why is None, "; ".join(filter(None, [why, what_differs(impl)]))
        assert eng.stats.preemptions > 0, "the test's pool is tight enough to preempt"
        left = leaks(eng)
        assert left is None, f"after every request finished: {left}"
    finally:
        close_group()  # rank 1's process ends with the test
