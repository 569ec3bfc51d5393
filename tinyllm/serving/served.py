"""Step 10 - what a server serves, said where a practitioner looks: the startup line, `/health`
and `/v1/models`.

`describe(engine)` says what the engine is made of: the weights (their dtype, or --quant's
mode), the decode step (eager, graphs, compiled, pieces, fused), the speculation (none, ngram or
a draft, with its guesses a step), the KV cache (slots, or a paged pool with its block size,
its blocks and whether a prefix cache shares them) and the token budget a step
(max_step_tokens). `banner` writes it in one line.

`ModelDefaults` are the sampling values the fields a request leaves out take, as vLLM's
`--generation-config auto` applies a checkpoint's generation_config.json: `model_defaults` reads
them from the checkpoint where it states them (generation_config.json, a GGUF file's
general.sampling.* keys), and takes llama-server's (LLAMA_SERVER) where it states none.
`--generation-config vllm` serves none (OpenAI's defaults, as vLLM's flag of that name does); a
request's own fields always win (api.with_defaults).
"""

from pathlib import Path
from typing import NamedTuple

from tinyllm.checkpoints.loading import generation_defaults
from tinyllm.core.kv_spec import spec_of
from tinyllm.serving.api import COMPLETIONS, APIError, sampling_of

# llama-server's sampling defaults (llama.cpp's common_params_sampling: temperature 0.8, the 40
# likeliest tokens, the nucleus of 0.95, and no token under 0.05 of the likeliest's probability)
LLAMA_SERVER = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
WEIGHTS = {  # --quant's modes, as the weights they serve
    "float": "{dtype}, a C loop's products",
    "int8": "int8 per output channel",
    "int4": "int4 in groups of 32",
    "gguf": "the GGUF file's own blocks",
}


class ModelDefaults(NamedTuple):
    """The sampling values for the fields a request leaves out, and where they come from:
    "checkpoint", "llama-server", "none" or a generation_config.json's path."""

    values: dict
    source: str


NO_DEFAULTS = ModelDefaults({}, "none")


def model_defaults(model: str, setting: str = "auto") -> ModelDefaults:
    """The sampling defaults to serve for the checkpoint `model` (a name or a path), as vLLM's
    --generation-config says: "auto", the checkpoint's where it states any, else llama-server's;
    "vllm", none; a folder, its generation_config.json's. Raises ValueError when the folder has
    no such file or a value is out of the range a request's field would be refused outside."""
    if setting == "vllm":
        return NO_DEFAULTS
    if setting == "auto":
        stated = generation_defaults(model)
        defaults = ModelDefaults(stated, "checkpoint") if stated else None
    else:
        file = Path(setting) / "generation_config.json"
        if not file.is_file():
            raise ValueError(f"--generation-config {setting}: no generation_config.json there")
        defaults = ModelDefaults(generation_defaults(Path(setting)), str(file))
    defaults = defaults or ModelDefaults(dict(LLAMA_SERVER), "llama-server")
    try:
        sampling_of(dict(defaults.values), COMPLETIONS, 1)
    except APIError as e:
        raise ValueError(f"the sampling defaults of {defaults.source}: {e.message}") from None
    return defaults


def describe(engine) -> dict:
    """What an engine serves, as /health says it: its weights, decoder, speculation, KV cache,
    token budget a step and the ranks its model is split over (14)."""
    model, config = engine.model, engine.config
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    quant = getattr(model, "quant", None)
    return {
        "weights": dtype if quant is None else WEIGHTS[quant].format(dtype=dtype),
        "decoder": config.decoder,
        "speculation": speculation(engine),
        "kv_cache": kv_cache(engine),
        "max_step_tokens": config.max_step_tokens,
        "tensor_parallel_size": config.tensor_parallel_size,
    }


def speculation(engine) -> str:
    """The speculation (11): none, n-gram lookups, or a draft model (its own, or the
    target's first layers), with the guesses a request a step at most."""
    config = engine.config
    if config.speculate is None:
        return "none"
    guesses = f"up to {config.spec_tokens} guesses a step"
    if config.speculate == "ngram":
        n = f"{config.prompt_lookup_min}-{config.prompt_lookup_max}"
        return f"ngram (prompt lookup, n {n}), {guesses}"
    draft = engine.runner.speculator.proposer.model
    return f"draft of {draft.cfg.n_layers} layers, {guesses}"


def kv_cache(engine) -> dict:
    """The KV cache: its kind, slots, positions a request and MiB; a paged pool's block size
    and blocks, and whether a prefix cache shares them."""
    spec, st = spec_of(engine.cache), engine.stats
    out = {"kind": spec.kind, "slots": spec.n_slots, "max_len": spec.max_len}
    if spec.kind == "paged":
        out |= {
            "block_size": spec.block_size,
            "blocks": spec.n_blocks,
            "prefix_cache": spec.prefix_cache,
        }
    return out | {"mib": round(st.kv_reserved_tokens * st.kv_bytes_per_token / 2**20, 1)}


def banner(about: dict, defaults: ModelDefaults) -> str:
    """What is served in one line: weights, decoder, speculation, cache, budget, defaults."""
    kv = about["kv_cache"]
    cache = f"kv {kv['kind']}: {kv['slots']} slots of up to {kv['max_len']} positions"
    if kv["kind"] == "paged":
        prefix = ", prefix cache" if kv["prefix_cache"] else ""
        cache += f", {kv['blocks']} blocks of {kv['block_size']}{prefix}"
    budget = about["max_step_tokens"]
    values = ", ".join(f"{k} {v}" for k, v in defaults.values.items()) or "OpenAI's"
    ranks = about["tensor_parallel_size"]
    split = f", split over {ranks} ranks" if ranks > 1 else ""
    a_rank = " a rank" if ranks > 1 else ""
    return (
        f"weights {about['weights']}{split}; decoder {about['decoder']}; speculation "
        f"{about['speculation']}; {cache}, {kv['mib']:g} MiB{a_rank}; max_step_tokens "
        f"{budget if budget is not None else 'none (whole prompts)'}; sampling defaults "
        f"{values} ({defaults.source})"
    )
