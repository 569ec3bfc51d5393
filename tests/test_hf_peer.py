"""Step 00 - the bundled model is a real Llama: transformers loads it and agrees with tinyllm."""

import pytest
import torch

from tinyllm.build import make_engine
from tinyllm.checkpoints.checkpoint import DEFAULT
from tinyllm.core.generate import generate

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Ham.\nTo be, or not to be",
    "Rom.\nBut soft, what light",
    "First Citizen.\n",
    "Lady Macbeth.\nCome, you spirits",
    "Fool.\n",
]


@pytest.fixture(scope="module")
def peer():
    return transformers.LlamaForCausalLM.from_pretrained(DEFAULT).float().eval()


def test_same_logits_as_transformers(bundled, peer):
    """float32 logits of tinyllm and transformers' LlamaForCausalLM agree to 1e-4."""
    model, tok = bundled
    ids = torch.tensor([tok.encode(PROMPTS[0] + ", that is the question.")])
    with torch.no_grad():
        ours, theirs = model(ids)[0], peer(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_same_greedy_tokens_as_transformers(bundled, peer):
    """transformers' own generate() (greedy, its KV cache) gives tinyllm's tokens."""
    model, tok = bundled
    for text in PROMPTS:
        prompt = tok.encode(text)
        ours = generate(model, prompt, 40, eos_id=tok.eos_id)
        out = peer.generate(
            torch.tensor([prompt]),
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.eos_id,
        )
        theirs = out[0, len(prompt) :].tolist()
        assert ours == theirs, f"{text!r}: tinyllm {ours} vs transformers {theirs}"


def test_peer_benchmark_agrees_with_solo(bundled, monkeypatch):
    """The peer comparison runs every engine, tinyllm's and transformers', on one workload and
    counts the requests whose tokens equal solo generate(): all of them, greedy. Its compiled
    row gets the graph decoder's eager bucketed step in place of a compiled one: what is tested
    here is the row (a decoder built before the clock, its compile_s reported); the compiled
    step's tokens are test_compiled's, on tiny shapes, where compiling is quick."""
    from tinyllm.core.workloads import workload
    from tinyllm.course import peers

    model, tok = bundled

    def eager_stand_in(m, config):
        decoder = make_engine(m, config, decoder="graphs", compile_mode="default").decoder
        decoder.compile_s = {W: 0.5 for W in decoder.buckets}
        return decoder

    monkeypatch.setattr(peers, "compiled_decoder", eager_stand_in)
    peer = peers.peer_model(DEFAULT, "cpu")
    reqs, _ = workload("longtail", tok, n=5, seed=2)
    reqs = [type(r)(r.prompt, min(r.max_new_tokens, 12)) for r in reqs]
    rows = peers.compare(model, peer, reqs, 2)
    assert set(rows) == {
        "tinyllm solo",
        "tinyllm static",
        "tinyllm continuous",
        "tinyllm compiled",
        "tinyllm paged",
        "hf generate",
        "hf continuous",
    }
    for name, r in rows.items():
        assert r["agree"] == 5 and r["tokens"] == sum(r_.max_new_tokens for r_ in reqs), name
    assert "hf continuous" in peers.table(rows)
    assert 0 < rows["tinyllm paged"]["kv_mib"] < 1, "the KV cache is sized to the workload"
    assert rows["tinyllm compiled"]["compile_s"] == 0.5, "compiled before its clock started"
