"""Step 09 - real checkpoints: for each supported architecture, a small random model built and
saved by transformers loads in tinyllm, gives transformers' logits, and every engine gives
transformers' greedy tokens. No download: the models are made here."""

import shutil

import pytest
import torch

import tinyllm
from tinyllm.checkpoints.checkpoint import DEFAULT
from tinyllm.core.generate import generate
from tinyllm.engine import Request, run_continuous, run_static

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=0,
)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-biases": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, rope_theta=500.0),
    ),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
    ),
}
PROMPTS = [[0, 41, 441, 259], [0, 362, 12], [0, 267, 615, 31, 5, 9, 77, 1200, 14, 3], [0]]
EOS = 14


def upto_eos(row: list[int]) -> list[int]:
    """transformers pads a finished row after its EOS; tinyllm's answer ends with the EOS."""
    return row[: row.index(EOS) + 1] if EOS in row else row


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    """(transformers' model, the directory it saved, the architecture's name)."""
    config_cls, model_cls, extra = ARCHS[request.param]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**COMMON, **extra)
    peer = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # larger weights: logits far from ties
        for p in peer.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    peer.save_pretrained(path)
    shutil.copy(DEFAULT / "tokenizer.json", path / "tokenizer.json")
    return peer, path, request.param


def test_logits_equal_transformers(pair):
    peer, path, arch = pair
    model, _ = tinyllm.load(path, device="cpu")
    assert model.cfg.arch == arch.split("-")[0].replace("llama3", "llama")
    ids = torch.tensor([PROMPTS[2] * 8])  # 80 positions
    with torch.no_grad():
        ours, theirs = model(ids)[0], peer(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_every_engine_gives_transformers_greedy_tokens(pair):
    """transformers' greedy generate() on a left-padded batch == tinyllm's solo, static,
    continuous and paged engines, in float64."""
    peer, path, _ = pair
    peer64 = peer.double()
    n = 12
    L = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in PROMPTS])
    out = peer64.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    theirs = [upto_eos(row) for row in out[:, L:].tolist()]
    peer.float()
    model, _ = tinyllm.load(path, device="cpu", dtype=torch.float64)
    reqs = [Request(p, n, eos_id=EOS) for p in PROMPTS]
    engines = {
        "solo": [generate(model, p, n, eos_id=EOS) for p in PROMPTS],
        "static": [r.tokens for r in run_static(model, reqs, 3)[0]],
        "continuous": [r.tokens for r in run_continuous(model, reqs, 2)[0]],
        "paged": [
            r.tokens
            for r in run_continuous(model, reqs, 3, kv="paged", block_size=4, kv_blocks=10)[0]
        ],
    }
    for name, ours in engines.items():
        for i, (o, t) in enumerate(zip(ours, theirs)):
            assert o == t, f"{name}, prompt {i}: tinyllm {o} vs transformers {t}"


def test_several_eos_ids_from_the_generation_config_end_every_engine(tmp_path):
    """A chat model may end its turn with any of several ids (Llama 3 Instruct lists three in
    generation_config.json). tinyllm.load collects them all, and solo generate() and every
    engine stop where transformers' generate() stops: at the first of them in each answer."""
    torch.manual_seed(1)
    config_cls, model_cls, extra = ARCHS["llama"]
    peer = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra))
    with torch.no_grad():
        for p in peer.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    peer.eval().save_pretrained(tmp_path)
    shutil.copy(DEFAULT / "tokenizer.json", tmp_path / "tokenizer.json")
    model, _ = tinyllm.load(tmp_path, device="cpu", dtype=torch.float64)
    n = 16
    stops = []  # a token that first comes late in an answer
    for p in PROMPTS:
        full = generate(model, p, n)
        late = [t for i, t in enumerate(full) if i >= 2 and t not in full[:i] and t not in stops]
        stops += late[:1]
    peer.generation_config.eos_token_id = stops
    peer.save_pretrained(tmp_path)
    model, tok = tinyllm.load(tmp_path, device="cpu", dtype=torch.float64)
    assert tok.eos_ids == tuple(dict.fromkeys([COMMON["eos_token_id"], *stops]))
    peer.double()
    theirs = []
    for p in PROMPTS:
        row = peer.generate(
            torch.tensor([p]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=list(tok.eos_ids),
            pad_token_id=0,
        )[0, len(p) :].tolist()
        theirs.append(row[: next((i + 1 for i, t in enumerate(row) if t in tok.eos_ids), len(row))])
    assert sum(len(t) < n for t in theirs) >= 3, f"most answers end at an EOS id: {theirs}"
    reqs = [Request(p, n, eos_id=tok.eos_ids) for p in PROMPTS]
    engines = {
        "solo": [generate(model, p, n, eos_id=tok.eos_ids) for p in PROMPTS],
        "static": [r.tokens for r in run_static(model, reqs, 3)[0]],
        "continuous": [r.tokens for r in run_continuous(model, reqs, 2)[0]],
        "paged": [r.tokens for r in run_continuous(model, reqs, 3, kv="paged", block_size=4)[0]],
    }
    for name, ours in engines.items():
        assert ours == theirs, f"{name}: tinyllm {ours} vs transformers {theirs}"
