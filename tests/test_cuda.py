"""Steps 05-06 on a GPU (make gpu-check; deselected elsewhere): the graphed, paged and slot
engines in bf16, and graphs over a paged pool, give solo generate()'s tokens, up to near-ties
(check.near_tie)."""

import pytest
import torch

import tinyllm
from tinyllm.core.cuda_graph import SlotGraphDecoder
from tinyllm.core.generate import generate
from tinyllm.core.model import gpu_dtype
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.core.workloads import workload
from tinyllm.course.check import near_tie
from tinyllm.engine import Request, make_engine, run_continuous

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu():
    if not torch.cuda.is_available():
        pytest.fail("no CUDA device: these tests need a GPU (make gpu-check on a machine with one)")
    return tinyllm.load(device="cuda")


def requests(tok, n=24):
    reqs, _ = workload("longtail", tok, n=n, seed=1)
    return [Request(r.prompt, min(r.max_new_tokens, 120)) for r in reqs] + [
        Request(tok.encode("Ham.\n"), 200, eos_id=tok.eos_id)
    ]


def assert_solo_up_to_ties(model, reqs, results, label):
    ties = []
    for i, (r, res) in enumerate(zip(reqs, results)):
        solo = generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id)
        ok, what = near_tie(model, r.prompt, solo, res.tokens)
        assert ok, f"{label}, request {i}: {what}"
        if what:
            ties.append(f"request {i}: {what}")
    if ties:
        print(f"{label}: " + "; ".join(ties))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(kv="paged", block_size=16),
        dict(kv="paged", block_size=8, kv_blocks=40),
        dict(kv="paged", block_size=8, kv_blocks=40, decoder="graphs"),
    ],
    ids=["slots", "paged", "paged-under-pressure", "paged-graphs-under-pressure"],
)
def test_engines_on_cuda_match_solo(gpu, kw):
    model, tok = gpu
    reqs = requests(tok)
    results, summary = run_continuous(model, reqs, 8, **kw)
    assert_solo_up_to_ties(model, reqs, results, str(kw))
    if kw.get("kv_blocks"):
        assert summary["preemptions"] > 0


def test_graphs_are_captured_and_replayed(gpu):
    model, tok = gpu
    cfg = model.cfg
    slots = SlotKVCache(
        cfg.n_layers, 8, cfg.n_kv_heads, cfg.head_dim, cfg.max_seq_len, gpu_dtype("cuda"), "cuda"
    )
    decoder = SlotGraphDecoder(model, slots, buckets=(32, 64, 128))
    assert decoder.capture and sorted(decoder.graphs) == [32, 64, 128]
    reqs = requests(tok)
    graphed, _ = run_continuous(model, reqs, 8, decoder=decoder)
    eager, _ = run_continuous(model, reqs, 8)
    assert_solo_up_to_ties(model, reqs, graphed, "graphed")
    same = sum(g.tokens == e.tokens for g, e in zip(graphed, eager))
    print(f"graphed == eager for {same}/{len(reqs)} requests")


def test_graphed_engine_serves_arrivals(gpu):
    model, tok = gpu
    eng = make_engine(model, 4, decoder="graphs")
    reqs = requests(tok, 8)
    rids = []
    while len(rids) < len(reqs) or eng.has_work():
        if len(rids) < len(reqs):
            rids.append(eng.add_request(reqs[len(rids)]))
        eng.step()
    assert_solo_up_to_ties(model, reqs, [eng.results[r] for r in rids], "graphed, arrivals")


def test_compiled_decoder_on_cuda(gpu):
    """torch.compile with mode="reduce-overhead" (its own CUDA graphs) per bucket: each
    request's solo tokens up to near-ties, every bucket compiled once."""
    model, tok = gpu
    reqs = requests(tok, 12)
    eng = make_engine(model, 8, decoder="compiled", max_len=256, buckets=(128, 256))
    results, _ = run_continuous(model, reqs, 8, decoder=eng.decoder)
    assert_solo_up_to_ties(model, reqs, results, "compiled")
    assert set(eng.decoder.compile_s) <= {128, 256}
