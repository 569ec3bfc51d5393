"""Step 09 - real models: a GGUF file (llama.cpp's format) in, the same model and tokenizer out.

One `.gguf` file holds the config as metadata keys (`llama.block_count`...), the tokenizer
(`tokenizer.*`), the sampling its makers recommend when it states one (`general.sampling.*`:
read_sampling_defaults) and the weights under llama.cpp's names (`blk.0.attn_q.weight`), most of
them quantised in blocks. `load_gguf` reads it with the `gguf` package (llama.cpp's own reader),
de-quantises every tensor into the asked dtype, gives it its Hugging Face name and hands the
result to `checkpoint.load_state`, so a GGUF model is checked and built like any checkpoint.

Three things are not a renaming. llama.cpp rotates a Llama's query and key dims in pairs that
sit side by side where Hugging Face pairs dim i with dim i + head_dim/2: `unpermute` puts the q
and k rows back (Qwen2 files keep Hugging Face's order). `llama3_scaling` turns Llama 3's RoPE
factors (`rope_freqs.weight`) back into the settings `model.rope_table` takes. The tokenizer is
rebuilt from the metadata as a `tokenizers` byte-level BPE that cuts text as the file's
`tokenizer.ggml.pre` says.
"""

import os
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tinyllm.checkpoints.checkpoint import (
    CheckpointError,
    check_chat_template,
    check_heads,
    is_int,
    load_state,
    pick_device_dtype,
    positions_to_serve,
)
from tinyllm.checkpoints.tokenizer import Tokenizer
from tinyllm.core.model import ModelConfig, Transformer, llama3_frequencies

ARCHITECTURES = ("llama", "qwen2")     # general.architecture values tinyllm reads
READABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
            "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")               # tensor types de-quantised here

# llama.cpp tensor name (after "blk.N.") -> Hugging Face module name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FACTORS = "rope_freqs.weight"      # Llama 3's RoPE scaling, one factor per frequency
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}             # Llama 3.1's and 3.2's


@lru_cache(maxsize=1)
def reader_class():
    """gguf.GGUFReader, parsing from a plain view of its map of the file (one class a process).

    The reader parses every metadata value as a slice of that map: SmolLM2's vocabulary and
    merges alone are some 200,000 slices. A slice of numpy's np.memmap runs Python code of that
    subclass; a slice of a plain ndarray over the same map does not, and reads the same bytes
    (SmolLM2's file opens in 2 s, not 5.5). An array of numbers is one slice here, not one an
    element, and an array of strings is read with plain slices of memory (memoryview's), its
    lengths as Python ints, in a file of this machine's byte order: 0.3 s. Raises ImportError
    without the gguf package."""
    import gguf

    STRING, ARRAY = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):                           # the reader's np.memmap of the file
            self._data = mapped.view(np.ndarray)

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            """(bytes read, parts, the parts that hold values, types), the base class's, with
            an array's values in fewer parts: a number array's in one, a string's two each."""
            if raw_type != ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            kind, n, offs = gguf.GGUFValueType(int(itype[0])), int(count[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(kind)
            if nptype is not None:
                values = self._get(offs, nptype, n)
                return 12 + values.nbytes, [itype, count, values], [2], [ARRAY, kind]
            if kind != STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            mem, parts = memoryview(self._data), [itype, count]
            for _ in range(n):                            # (length: u64, bytes) each
                size = int.from_bytes(mem[offs:offs + 8], "little")
                parts += (mem[offs:offs + 8], mem[offs + 8:offs + 8 + size])
                offs += 8 + size
            return offs - orig_offs, parts, list(range(3, len(parts), 2)), [ARRAY, STRING]

    return Reader


def open_reader(path: Path):
    """A GGUF reader over the file (it maps the file; tensors are read when touched). The
    reader's parse of the metadata (a vocabulary of 49,152 strings: about a second) is kept
    for the last few files, by path, size and modification time: a second load of the same
    file parses nothing."""
    try:
        Reader = reader_class()
    except ImportError:
        raise CheckpointError(f"{path}: reading a GGUF file needs the gguf package "
                              "(pip install gguf)") from None
    try:
        stat = os.stat(path)
        return parsed(Reader, str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    except Exception as e:  # the reader raises ValueError, struct or numpy errors on a bad file
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None


@lru_cache(maxsize=4)
def parsed(Reader, path: str, size: int, mtime_ns: int):
    """Reader(path), once for a file of this size and modification time."""
    return Reader(path)


def field_value(field):
    """A metadata field's value: a str, int, float or bool, or a list of them. The reader keeps
    raw parts; field.types is [type], or [ARRAY, element type] for a list."""
    kind = field.types[-1].name
    parts = [field.parts[i] for i in field.data]
    if kind == "STRING":
        values = [bytes(part).decode("utf-8") for part in parts]
    else:
        values = np.concatenate(parts).tolist() if parts else []
        values = [bool(v) for v in values] if kind == "BOOL" else values
    return values if field.types[0].name == "ARRAY" else values[0]


def read_metadata(reader, where: Path) -> dict:
    """Every metadata key's value; a string that is not UTF-8 is refused with its key."""
    meta = {}
    for name, field in reader.fields.items():
        try:
            meta[name] = field_value(field)
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{where}: metadata key {name!r} holds a string that is not "
                                  f"UTF-8 ({e})") from None
    return meta


# llama.cpp's general.sampling.* keys (its converter writes them from generation_config.json,
# and llama-server takes them for the fields a request leaves out) -> the field each states
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                 "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


def read_sampling_defaults(path: Path) -> dict:
    """The sampling defaults a GGUF file states in llama.cpp's general.sampling.* keys, as the
    fields they set ({} when it states none); a float32 value rounded to 6 decimals (0.95, not
    0.949999988). A value that is no number is refused with its key."""
    reader, out = open_reader(path), {}
    for key, name in SAMPLING_KEYS.items():
        if key not in reader.fields:
            continue
        value = field_value(reader.fields[key])
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{path}: {key} must be a number, got {value!r:.80}")
        out[name] = round(value, 6) if isinstance(value, float) else value
    return out


# ---- metadata -> ModelConfig --------------------------------------------------------------

def config_from_gguf(meta: dict, names: set[str], vocab_size: int, where: Path,
                     max_seq_len: int | None = None,
                     rope_factors: torch.Tensor | None = None) -> ModelConfig:
    """The `{arch}.*` metadata keys -> ModelConfig. names: the file's tensor names (a missing
    `output.weight` means a tied head, `attn_q.bias` means q, k and v have biases);
    rope_factors: the values of rope_freqs.weight when the file has it."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: unsupported architecture general.architecture={arch!r} "
                              f"(tinyllm reads {' and '.join(ARCHITECTURES)})")

    def get(key, default=None, kind="int"):
        """{arch}.{key}: an int >= 1 (kind "int") or a number > 0 (kind "float")."""
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{where}: missing metadata key '{arch}.{key}'")
        ok = (is_int(value, 1) if kind == "int" else
              isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)
        if not ok:
            want = "an int >= 1" if kind == "int" else "a number > 0"
            raise CheckpointError(f"{where}: {arch}.{key} must be {want}, got {value!r}")
        return value

    rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_type != "none":
        raise CheckpointError(f"{where}: unsupported RoPE scaling {arch}.rope.scaling.type="
                              f"{rope_type!r} (plain RoPE and Llama 3's only)")
    d_model, n_heads = get("embedding_length"), get("attention.head_count")
    n_kv_heads = get("attention.head_count_kv", n_heads)
    head_dim = get("attention.key_length", d_model // n_heads)
    keys = ("head_count", "head_count_kv", "key_length")
    check_heads(n_heads, n_kv_heads, head_dim, where, tuple(f"{arch}.attention.{k}" for k in keys))
    if get("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"{where}: unsupported partial RoPE ({arch}.rope.dimension_count="
                              f"{meta[f'{arch}.rope.dimension_count']}, head_dim {head_dim})")
    theta = float(get("rope.freq_base", 10000.0, kind="float"))
    scaling = None if rope_factors is None else llama3_scaling(rope_factors, head_dim, theta, where)
    return ModelConfig(
        vocab_size=vocab_size, d_model=d_model, n_layers=get("block_count"), n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim,
        d_ff=get("feed_forward_length"),
        max_seq_len=positions_to_serve(get("context_length"), max_seq_len, where,
                                       f"{arch}.context_length"),
        rope_theta=theta, norm_eps=float(get("attention.layer_norm_rms_epsilon", kind="float")),
        tie_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names, rope_scaling=scaling, arch=arch)


def llama3_scaling(factors: torch.Tensor, head_dim: int, theta: float, where: Path) -> dict:
    """llama.cpp stores Llama 3's RoPE scaling as what each frequency is divided by (1: kept,
    `factor`: slowed, between: blended). This is the llama3 rope_scaling that gives those
    factors: Llama 3.1's and 3.2's settings with the largest factor; other factors are refused."""
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_ROPE}
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if factors.shape != inv_freq.shape or not torch.allclose(
            llama3_frequencies(inv_freq, scaling), inv_freq / factors, rtol=1e-4, atol=0):
        raise CheckpointError(f"{where}: unsupported RoPE scaling: {ROPE_FACTORS} is not Llama "
                              f"3's with factor {scaling['factor']:g}, low_freq_factor 1, "
                              "high_freq_factor 4 and 8192 original positions")
    return scaling


# ---- tensors ------------------------------------------------------------------------------

def to_hf_name(name: str, where: Path) -> str:
    """llama.cpp tensor name -> Hugging Face name: blk.3.ffn_up.weight ->
    model.layers.3.mlp.up_proj.weight, token_embd.weight -> model.embed_tokens.weight."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    raise CheckpointError(f"{where}: unexpected tensor {name!r} (not part of a Llama or Qwen2 "
                          "model as tinyllm builds it)")


def dequantize(tensor, where: Path) -> torch.Tensor:
    """One reader tensor -> float32 (rows, cols) in PyTorch's layout, de-quantised with
    llama.cpp's own arithmetic: by blocks_to_float for the blocks of 32 (Q4_0, Q4_1, Q8_0),
    else by the gguf package. GGUF lists dims innermost first (ne0 = the input features), so
    the shape reads backwards."""
    from gguf import quants
    kind = tensor.tensor_type.name
    if kind not in READABLE:
        raise CheckpointError(f"{where}: tensor {tensor.name!r} has type {kind}, which tinyllm "
                              f"does not de-quantise (it reads {', '.join(READABLE)})")
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if kind in BLOCKS_OF_32:
        return blocks_to_float(kind, np.asarray(tensor.data)).reshape(shape)
    values = quants.dequantize(tensor.data, tensor.tensor_type)        # float32, blocks undone
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).reshape(shape)


BLOCKS_OF_32 = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}     # a block's bytes: float16 scale(s), values


def blocks_to_float(kind: str, data: np.ndarray) -> torch.Tensor:
    """A tensor's GGUF blocks of 32 (bytes) -> its float32 values, flat, as the gguf package
    computes them (the same float32 products and sums, one by one: the same bits), in whole-
    tensor operations: Q8_0 d q; Q4_0 d (q - 8); Q4_1 d q + m, each 4-bit q of a block's 16
    bytes the low nibble (values 0..15), then the high one (16..31)."""
    raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, BLOCKS_OF_32[kind]))
    d = raw[:, 0:2].contiguous().view(torch.float16).float()           # (blocks, 1)
    if kind == "Q8_0":
        return (raw[:, 2:].contiguous().view(torch.int8).float() * d).reshape(-1)
    packed = raw[:, 4:] if kind == "Q4_1" else raw[:, 2:]                # (blocks, 16)
    q = torch.cat([packed & 15, packed >> 4], dim=1).float()            # (blocks, 32)
    if kind == "Q4_0":
        return (d * (q - 8)).reshape(-1)
    m = raw[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(-1)


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order for a Llama q or k projection (weight or bias). Per head, row
    2i + j of the file is row i + j * head_dim/2 of Hugging Face's layout."""
    rest = w.shape[1:]
    half = w.shape[0] // n_heads // 2
    return (w.reshape(n_heads, half, 2, *rest)      # (heads, hd/2, pair, ...) as stored
            .transpose(1, 2)                        # (heads, pair, hd/2, ...) halves first
            .reshape(w.shape))


def read_tensors(reader, cfg: ModelConfig, where: Path,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor, de-quantised, under its Hugging Face name, in dtype (one float32 tensor
    exists at a time); a Llama's q and k rows back in Hugging Face's order."""
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FACTORS:                 # read into the config, not a weight
            continue
        name = to_hf_name(tensor.name, where)
        w = dequantize(tensor, where)
        if cfg.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = unpermute(w, cfg.n_heads if ".q_proj." in name else cfg.n_kv_heads)
        tensors[name] = w.to(dtype)
    return tensors


# ---- tokenizer ----------------------------------------------------------------------------

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre (llama.cpp's names) -> how text is cut before BPE: GPT-2's regex, the same
# after every digit is cut off on its own (SmolLM2, StarCoder), or Llama 3's or Qwen2's regex
PRE_TOKENIZERS = {"gpt-2": "gpt2", "smollm": "digits", "starcoder": "digits",
                  "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT,
                  "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4      # tokenizer.ggml.token_type values (1 is a normal token)


def pre_tokenizer(pre: str):
    """The `tokenizers` pre-tokenizer for a tokenizer.ggml.pre name: a cut, then bytes mapped to
    the byte-level alphabet (Ġ for a space)."""
    split = PRE_TOKENIZERS[pre]
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=False)])


def token_id(meta: dict, key: str, n_tokens: int, where: Path) -> int | None:
    """tokenizer.ggml.{key} as a token id, or None when the file has none."""
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is not None and not (is_int(value, 0) and value < n_tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.{key} must be a token id below "
                              f"{n_tokens}, got {value!r}")
    return value


def flag(meta: dict, key: str, default: bool, where: Path) -> bool:
    """tokenizer.ggml.{key}: true or false (default when the file has none)."""
    value = meta.get(f"tokenizer.ggml.{key}", default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: tokenizer.ggml.{key} must be true or false, "
                              f"got {value!r:.80}")
    return value


def check_list(meta: dict, key: str, ok, want: str, where: Path) -> list:
    """The list a metadata key holds (empty when the file has none), every entry ok(entry);
    anything else is refused, naming the first entry that is not."""
    value = meta.get(key, [])
    if not isinstance(value, list):
        raise CheckpointError(f"{where}: {key} must be {want}, got {value!r:.80}")
    bad = next((i for i, v in enumerate(value) if not ok(v)), None)
    if bad is not None:
        raise CheckpointError(f"{where}: {key} must be {want}, but entry {bad} is "
                              f"{value[bad]!r:.80}")
    return value


def read_vocabulary(meta: dict, where: Path) -> tuple[list[str], list[str], list[int]]:
    """tokenizer.ggml.tokens, .merges ("Ġ t", two tokens and a space) and .token_type (one int
    per token, or none at all), each checked."""
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{where}: missing metadata key 'tokenizer.ggml.tokens'")
    tokens = check_list(meta, "tokenizer.ggml.tokens", lambda t: isinstance(t, str),
                        "a list of strings", where)
    merges = check_list(meta, "tokenizer.ggml.merges", lambda m: isinstance(m, str) and " " in m,
                        "a list of strings 'a b' (two tokens and a space)", where)
    types = check_list(meta, "tokenizer.ggml.token_type", lambda k: is_int(k, 0),
                       "a list of token types (ints >= 0)", where)
    if types and len(types) != len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.token_type holds {len(types)} token "
                              f"types for {len(tokens)} tokens (it needs one per token)")
    return tokens, merges, types


def tokenizer_from_gguf(meta: dict, where: Path) -> Tokenizer:
    """The file's byte-level BPE (tokenizer.ggml.model "gpt2") as a tinyllm Tokenizer: control
    tokens (<|im_start|>) are special tokens, bos is added in front when add_bos_token says so,
    and every end-of-generation id (eos, eot, eom) ends a turn."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"{where}: unsupported tokenizer tokenizer.ggml.model={model!r} "
                              "(tinyllm reads byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{where}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r:.80} "
                              f"(tinyllm reads {', '.join(PRE_TOKENIZERS)})")
    tokens, merges, types = read_vocabulary(meta, where)
    try:
        # Llama 3's BPE takes a piece found whole in the vocabulary before any merge (as
        # llama.cpp does for it); the others merge from single bytes
        bpe = models.BPE({t: i for i, t in enumerate(tokens)},
                         [tuple(m.split(" ", 1)) for m in merges],
                         ignore_merges=PRE_TOKENIZERS[pre] == LLAMA3_SPLIT)
    except Exception as e:  # tokenizers raises a bare Exception: "Token `x` out of vocabulary"
        raise CheckpointError(f"{where}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens "
                              f"({e})") from None
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    # control tokens (<|im_start|>) are matched whole and dropped by decode(skip_special_tokens);
    # user-defined ones are matched whole and decoded as text
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos = token_id(meta, "bos_token_id", len(tokens), where)
    eos_ids = [i for key in ("eos_token_id", "eot_token_id", "eom_token_id")
               if (i := token_id(meta, key, len(tokens), where)) is not None]
    add_bos = flag(meta, "add_bos_token", PRE_TOKENIZERS[pre] == LLAMA3_SPLIT, where)
    first = [bos] if add_bos and bos is not None else []
    last = eos_ids[:1] if flag(meta, "add_eos_token", False, where) else []
    if first or last:                             # ids put around every encoded text
        tok.post_processor = processors.TemplateProcessing(
            single=[tokens[i] for i in first] + ["$A"] + [tokens[i] for i in last],
            special_tokens=[(tokens[i], i) for i in first + last])
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        template = check_chat_template(template, where, "tokenizer.chat_template")
    return Tokenizer(tok, bos_id=bos, eos_ids=eos_ids, chat_template=template)


# ---- load ---------------------------------------------------------------------------------

def load_gguf(path: str | Path, device=None, dtype: torch.dtype | None = None,
              max_seq_len: int | None = None) -> tuple[Transformer, Tokenizer]:
    """Load a GGUF file -> (model in eval mode, tokenizer), with checkpoint.load_dir's defaults:
    device None picks CUDA when there is one, dtype None is the GPU's low precision there and
    float32 on the CPU; max_seq_len defaults to the file's context_length, at most MAX_SEQ_LEN.
    (Step 13 keeps the file's blocks instead: tinyllm.build.keep_gguf_blocks.)"""
    path = Path(path)
    device, dtype = pick_device_dtype(device, dtype)
    reader = open_reader(path)
    meta = read_metadata(reader, path)
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise CheckpointError(f"{path}: missing tensor 'token_embd.weight'")
    vocab_size = int(by_name["token_embd.weight"].shape[1])         # (d_model, vocab) in GGUF
    rope_factors = dequantize(by_name[ROPE_FACTORS], path) if ROPE_FACTORS in by_name else None
    cfg = config_from_gguf(meta, set(by_name), vocab_size, path, max_seq_len, rope_factors)
    tokenizer = tokenizer_from_gguf(meta, path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path}: {tokenizer.vocab_size} tokens, but token_embd.weight "
                              f"gives the model only {cfg.vocab_size}")
    tensors = read_tensors(reader, cfg, path, dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    load_state(model, tensors, path, device, dtype)
    return model.eval(), tokenizer


def write_dequantized(src: str | Path, dst: str | Path, kind: str = "F32") -> Path:
    """Copy a GGUF file with every tensor de-quantised to `kind` (F32, or BF16 or Q8_0 for the
    matrices), its metadata as it was: llama.cpp then computes on the very values tinyllm loads
    (the peers' 'same values' comparison), or on its own 8 bits made from them. Written under
    a temporary name, then renamed."""
    import gguf
    src, dst = Path(src), Path(dst)
    if kind not in ("F32", "BF16", "Q8_0"):
        raise ValueError(f"kind must be 'F32', 'BF16' or 'Q8_0', got {kind!r}")
    reader = open_reader(src)
    arch = field_value(reader.fields["general.architecture"])
    part = dst.with_name(f"{dst.name}.{os.getpid()}.part")
    writer = gguf.GGUFWriter(part, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field_value(field), field.types[0], sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if kind != "F32" and values.ndim > 1:      # llama.cpp keeps norms and biases in F32
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    part.rename(dst)
    return dst
