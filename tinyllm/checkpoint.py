"""Step 00 - checkpoints: read and write a Hugging Face Llama directory.

A directory holds `config.json` (LlamaConfig field names), `model.safetensors` (or shards
listed in `model.safetensors.index.json`) with Hugging Face tensor names, and `tokenizer.json`.
`transformers` loads the same directory as a peer. Nothing is ever unpickled: safetensors
holds raw tensors only. Every problem is reported with the file it was found in.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tinyllm.model import ModelConfig, Transformer
from tinyllm.tokenizer import Tokenizer

DEFAULT = Path(__file__).parent / "weights" / "shakespeare"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file."""


def resolve(path: str | Path) -> Path:
    """"default" is the bundled checkpoint; anything else is a directory."""
    return DEFAULT if str(path) == "default" else Path(path)


# ---- config.json <-> ModelConfig --------------------------------------------------------

def config_from_hf(hf: dict, where: Path) -> ModelConfig:
    arch = hf.get("model_type")
    if arch != "llama":
        raise CheckpointError(f"{where}: unsupported architecture model_type={arch!r} "
                              "(tinyllm reads Llama checkpoints, model_type 'llama')")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: unsupported hidden_act {hf['hidden_act']!r} (need 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise CheckpointError(f"{where}: unsupported {flag}=true (tinyllm's Llama has no biases)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"{where}: unsupported RoPE scaling {rope!r} (plain RoPE only)")
    try:
        n_heads = hf["num_attention_heads"]
        return ModelConfig(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise CheckpointError(f"{where}: missing field {e.args[0]!r}") from None


def config_to_hf(cfg: ModelConfig, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        "bos_token_id": bos_id, "eos_token_id": eos_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (a checkpoint directory needs config.json)")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


# ---- tensor names -------------------------------------------------------------------------

def hf_name(name: str) -> str:
    """tinyllm parameter name -> Hugging Face tensor name (the modules are named alike)."""
    return name if name.startswith("lm_head.") else "model." + name


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards an index lists."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
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


def load_state(model: Transformer, tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Copy checkpoint tensors into the model, checking names, shapes and values."""
    wanted = {hf_name(n): p for n, p in model.named_parameters()}  # tied head appears once
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r} "
                              f"({len(missing)} missing in all)")
    extra = sorted(set(tensors) - set(wanted) - {"lm_head.weight"})
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} (not part of a Llama "
                              f"with this config.json)")
    with torch.no_grad():
        for name, p in wanted.items():
            t = tensors[name]
            if t.shape != p.shape:
                raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, "
                                      f"config.json implies {tuple(p.shape)}")
            if not torch.isfinite(t).all():
                raise CheckpointError(f"{where}: tensor {name!r} holds NaN or inf values")
            p.copy_(t)


# ---- load and save ------------------------------------------------------------------------

def load(path: str | Path = "default", device=None, dtype: torch.dtype | None = None
         ) -> tuple[Transformer, Tokenizer]:
    """Load a Llama checkpoint directory -> (model in eval mode, tokenizer).

    path "default" is the bundled Shakespeare model. device None picks CUDA when there is
    one, else the CPU; dtype None is float32 (the engines autocast to bf16 on CUDA)."""
    path = resolve(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    hf = read_config(path)
    cfg = config_from_hf(hf, path / "config.json")
    tensors = read_tensors(path)
    model = Transformer(cfg)
    load_state(model, tensors, path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(device=device, dtype=dtype or torch.float32).eval()
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    tokenizer = Tokenizer.from_file(path / "tokenizer.json", hf.get("bos_token_id"), eos)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, but "
                              f"config.json gives the model only {cfg.vocab_size}")
    return model, tokenizer


def save(model: Transformer, tokenizer: Tokenizer, path: str | Path,
         dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json, model.safetensors (in dtype) and tokenizer.json to path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(n): p.detach().to("cpu", dtype).contiguous()
               for n, p in model.named_parameters()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = config_to_hf(model.cfg, tokenizer.bos_id, tokenizer.eos_id, dtype)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tokenizer.save(path / "tokenizer.json")
    return path
