"""Step 14 - tensor parallelism: a model split over ranks gives every request its solo run.

The shards of a model, put together (threads of one process, ThreadedRanks), are the model;
over 2 real processes (torch.distributed's gloo, rank 1 spawned), every request of any workload
on either cache, with preemptions, prefix hits, a token budget, arrivals, aborts and seeded
sampling, equals its solo run on the unsplit model in tokens and in logprobs within 1e-9
(float64: the all-reduce adds the ranks' partial sums, an order of additions of its own, so
the logits differ from the unsplit model's in the last bits, 1e-15 here). A rank that dies, or
that ends before it joins, ends the engine with one error that names it, and the next engine
starts new ranks. The server and torchrun's two-machine command are tested in test_server_tp.
"""

import copy
import dataclasses
import os
import signal
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_tiny
from tests.test_oracle import run_example
from tinyllm.build import make_engine
from tinyllm.core.config import EngineConfig
from tinyllm.core.continuous import run_engine
from tinyllm.core.generate import solo
from tinyllm.core.kv_spec import spec_of
from tinyllm.core.requests import Request
from tinyllm.ext import ranks
from tinyllm.ext.cpu_attention import install
from tinyllm.ext.parallel import ThreadedRanks, shard, shard_bytes
from tinyllm.ext.quant import quantize
from tinyllm.ext.ranks import ParallelModel, RankFailed

pytestmark = pytest.mark.slow  # rank processes


def biased(seed: int = 5):
    """A tiny model with biases on q, k, v and the attention's output: a row-parallel bias
    added on every rank would show."""
    model = make_tiny(seed=seed, n_layers=2, qkv_bias=True, o_bias=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and not torch.all(p == 1):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("weights", ["float", "int4", "C attention", "biases"])
def test_the_shards_put_together_are_the_model(weights):
    """2 shards in threads, each all-reduce adding the two partial sums: the logits of the
    whole model, within float64's last bits."""
    model = biased() if weights == "biases" else make_tiny(seed=41, n_layers=3)
    if weights == "int4":
        model = quantize(model, "int4")
    if weights == "C attention":
        model = install(copy.deepcopy(model))
    idx = torch.randint(1, model.cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want, _ = model(idx)
    got = ThreadedRanks(2).logits(model, idx)
    assert (got - want).abs().max() < 1e-12


def test_a_shard_holds_its_heads_and_half_the_layers():
    """Rank r of 2 holds its whole KV group (its query heads with it), half the MLP's width
    and half the vocabulary's head rows; the embedding whole."""
    model = make_tiny(seed=41, n_layers=3)
    cfg = model.cfg
    parts = [shard(model, r, 2) for r in range(2)]
    for part in parts:
        assert (part.cfg.n_heads, part.cfg.n_kv_heads) == (cfg.n_heads // 2, cfg.n_kv_heads // 2)
        assert part.layers[0].self_attn.q_proj.weight.shape == (
            cfg.n_heads // 2 * cfg.head_dim,
            cfg.d_model,
        )
        assert part.embed_tokens.weight.shape == (cfg.vocab_size, cfg.d_model)
    whole = sum(p.numel() * p.element_size() for b in model.layers for p in b.parameters())
    norms = sum(
        p.numel() * p.element_size() for n, p in model.layers.named_parameters() if "norm" in n
    )  # whole on each rank
    held = [shard_bytes(p)["layers"] for p in parts]
    assert sum(held) == whole + norms and held[0] == held[1]
    assert [p.tp_vocab for p in parts] == [(0, 49), (49, 97)]


def test_uneven_kv_groups_split_whole():
    """3 KV groups over 2 ranks: 2 and 1 (SmolLM2's 9 query heads in 3 groups: 6 and 3)."""
    model = make_tiny(seed=3, n_layers=1, n_heads=6, n_kv_heads=3)
    parts = [shard(model, r, 2) for r in range(2)]
    assert [(p.cfg.n_heads, p.cfg.n_kv_heads) for p in parts] == [(4, 2), (2, 1)]
    idx = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, _ = model(idx)
    assert (ThreadedRanks(2).logits(model, idx) - want).abs().max() < 1e-12
    with pytest.raises(ValueError, match="tensor_parallel_size 4 is more than the model's 3 KV"):
        shard(model, 0, 4)


@pytest.mark.parametrize(
    "setting, value", [("decoder", "graphs"), ("decoder", "fused"), ("speculate", "draft")]
)
def test_the_config_refuses_what_a_split_model_cannot_take(setting, value):
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        EngineConfig(2, tensor_parallel_size=2, **{setting: value})
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        EngineConfig(2, tensor_parallel_size=0)


@settings(
    max_examples=int(os.environ.get("TP_EXAMPLES", 20)),
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
@given(data=st.data())
def test_a_model_over_2_ranks_gives_every_request_its_solo_run(data):
    """The oracle's draws (test_oracle: both caches, pools down to the tightest, prefix hits,
    a token budget, n-gram guesses, arrivals, aborts, seeded sampling, penalties, grammars,
    logprobs), every model split over 2 processes: each choice is its solo run on the unsplit
    model, tokens and logprobs; the books sound after every step; a combination refused by
    name."""
    run_example(data, tp_sizes=(2,))


def requests(n: int = 5) -> list[Request]:
    g = torch.Generator().manual_seed(7)
    lengths = (3, 9, 17, 5, 30)[:n]
    return [Request(torch.randint(1, 97, (k,), generator=g).tolist(), 8) for k in lengths]


def test_a_rank_that_dies_ends_the_engine_with_one_error():
    """Rank 1 killed mid-run: the next step raises at once, naming rank 1 and how it ended; so
    does every step after; the next engine starts new ranks and serves."""
    model = make_tiny(seed=41, n_layers=3)
    eng = make_engine(model, EngineConfig(3, tensor_parallel_size=2))
    for r in requests():
        eng.add_request(r)
    eng.step()
    os.kill(ranks._group.procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 died \(exit code -9\)"):
        while eng.has_work():
            eng.step()
    assert time.monotonic() - t0 < 10
    with pytest.raises(RankFailed, match="rank 1 died"):
        eng.step()
    results, _ = run_engine(make_engine(model, EngineConfig(3, tensor_parallel_size=2)), requests())
    assert [r.tokens for r in results] == [solo(model, r).tokens for r in requests()]


def test_a_rank_that_fails_to_start_ends_the_engine_with_one_error(monkeypatch):
    """Rank 1's process ends before it joins the group (killed as it starts): the first pass
    raises naming rank 1, within seconds, not torch.distributed's timeout."""
    ranks.close_group()
    wait = ranks.Ranks.wait_joining

    def killed_first(ranks, joining):
        for proc in ranks.procs:
            proc.kill()
        wait(ranks, joining)

    monkeypatch.setattr(ranks.Ranks, "wait_joining", killed_first)
    model = make_tiny(seed=41, n_layers=3)
    eng = make_engine(model, EngineConfig(2, tensor_parallel_size=2))
    eng.add_request(requests(1)[0])
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed to start: its process ended"):
        eng.step()
    assert time.monotonic() - t0 < 10


def test_a_rank_that_raises_says_why():
    """An error on rank 1 (here: a shard of the wrong shape for its cache) reaches rank 0 as
    one line naming the rank and the error."""
    model = make_tiny(seed=41, n_layers=3)
    pm = ParallelModel(model, 2)
    eng = make_engine(pm, EngineConfig(2, tensor_parallel_size=2))
    pm.start()
    short = dataclasses.replace(spec_of(eng.cache), max_len=2)  # too short for the step
    pm.ranks.send(("cache", pm.id, short))
    eng.add_request(requests(1)[0])
    with pytest.raises(RankFailed, match="rank 1 failed: ValueError"):
        eng.step()
