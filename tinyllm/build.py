"""The builder: an EngineConfig in, an engine made of its parts out.

Step 04's `ContinuousEngine` holds parts (core/parts.py) and never asks which kind it holds.
`make_engine` is the one way to make an engine: it reads the config and makes each part: the
cache (kv_spec.make_cache: 04's slots, 05's pool, 08's prefix cache), the decode step (the
model, 06's graphs and compiled step, 13's pieces and fused layers), the runner (step 11's
speculation wraps it), the planner (04's whole contexts, 07's budget); a grammar backend (12)
is given; with tensor_parallel_size > 1 the model is split over processes (14). It imports a
step's module only when the config asks for it, so a step's notebook builds here without
loading later steps. `run_continuous` is make_engine and run_engine in one call; `load` is
tinyllm.load with step 13's switches (quantized weights, the C attention, huge pages).

    make_engine(model, EngineConfig(8, kv="paged", prefix_cache=True))
    make_engine(model, 8, kv="paged", max_step_tokens=64, speculate="ngram")
"""

import argparse
import dataclasses

from tinyllm.core.config import EngineConfig
from tinyllm.core.continuous import ContinuousEngine, run_engine
from tinyllm.core.kv_spec import cache_spec, make_cache, spec_of
from tinyllm.core.model import Transformer
from tinyllm.core.model_runner import ModelRunner, ModelStep
from tinyllm.core.parts import DecodeStep
from tinyllm.core.requests import Request, Result
from tinyllm.core.slot_cache import SlotCache
from tinyllm.core.stats import Trace


def load(path="default", device=None, dtype=None, max_seq_len: int | None = None,
         download: bool = False, *, quant: str | None = None, c_attention: bool = True,
         huge_pages: bool = False, wait_for_kernels: bool = True):
    """tinyllm.load's (model, tokenizer), with step 13's switches. quant: None ("none") keeps float
    weights in plain linear layers; "float" keeps them too, a few rows read by a C loop
    (quant.GemvLinear); "int8" (per output channel) or "int4" (groups of 32) quantizes every
    linear layer (quant.quantize); "gguf" keeps a GGUF file's Q8_0, Q4_0 and Q4_1 blocks as they
    are (keep_gguf_blocks; a GGUF file only). On a CPU: c_attention puts the C attention
    in each layer (cpu_attention.install), where the kernels build (with wait_for_kernels
    False, as a server loads, a step does not wait for their first build: it attends with the
    library meanwhile); huge_pages moves the weights into memory that asked for 2 MB pages
    (huge_pages.place), which a decode step streams faster."""
    from tinyllm.checkpoints.checkpoint import resolve
    from tinyllm.checkpoints.loading import load as load_plain
    from tinyllm.ext.quant import MODES

    quant = None if quant == "none" else quant
    for name, value in (("c_attention", c_attention), ("huge_pages", huge_pages),
                        ("wait_for_kernels", wait_for_kernels)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if quant not in (None, *MODES):
        raise ValueError(f"quant must be one of {', '.join(MODES)} or None, got {quant!r}")
    if quant == "gguf" and not (resolve(path).is_file() and resolve(path).suffix == ".gguf"):
        raise ValueError(f"quant='gguf' keeps a GGUF file's own blocks; {resolve(path)} is not a "
                         f".gguf file (quant='int8' or 'int4' quantizes any checkpoint)")
    model, tok = load_plain(path, device, dtype, max_seq_len, download)
    if quant == "gguf":
        keep_gguf_blocks(model, resolve(path))
    elif quant is not None:
        from tinyllm.ext.quant import quantize
        quantize(model, quant)
    if next(model.parameters()).device.type == "cpu":
        if c_attention:
            from tinyllm.ext.cpu_attention import install
            install(model, wait_for_kernels)
        if huge_pages:
            from tinyllm.ext.huge_pages import place
            place(model)
    return model, tok


def add_quant_argument(parser, several: bool = False) -> None:
    """The one --quant flag, serve's and bench's: the weights load takes (none: float weights in
    plain layers, or a mode of quant.MODES); with several, comma-separated to compare them (the
    value is then a list)."""
    from tinyllm.ext.quant import MODES

    def modes(text: str):
        got = text.split(",")
        bad = [m for m in got if m not in ("none", *MODES)]
        if bad or (len(got) > 1 and not several):
            raise argparse.ArgumentTypeError(f"{text!r}: give {'modes' if several else 'one mode'}"
                                             f" of none, {', '.join(MODES)}")
        return got if several else got[0]

    parser.add_argument("--quant", type=modes, default="none",
                        metavar="MODES" if several else "MODE",
                        help="the weights (step 13): none (float), float (a C loop's products), "
                             "int8 (per output channel), int4 (groups of 32) or gguf (a GGUF "
                             "file's own Q8_0, Q4_0 and Q4_1 blocks)"
                             + (", comma-separated to compare them" if several else "")
                             + " (default: none)")


def keep_gguf_blocks(model: Transformer, path) -> Transformer:
    """A model loaded from a GGUF file (gguf_file.load_gguf, 09) with each linear layer whose
    tensor is in Q8_0, Q4_0 or Q4_1 blocks put in a QuantLinear of the file's blocks (13:
    quant.from_gguf;
    a Llama's q and k rows put back in Hugging Face's order, blocks and all); the head tied to
    the embeddings gets token_embd's. In place; returns the model, whose quant says "gguf"."""
    import numpy as np
    import torch

    from tinyllm.checkpoints import gguf_file as g
    from tinyllm.checkpoints.checkpoint import hf_name
    from tinyllm.ext.quant import GGUF_BLOCKS, from_gguf

    by_name = {t.name: t for t in g.open_reader(path).tensors}
    cfg, names = model.cfg, {g.to_hf_name(n, path): n for n in by_name if n != g.ROPE_FACTORS}
    names.setdefault("lm_head.weight", names["model.embed_tokens.weight"])    # a tied head
    device = next(model.parameters()).device
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            gguf_name = names.get(hf_name(f"{parent_name}.{name}.weight".lstrip(".")))
            if not isinstance(child, torch.nn.Linear) or gguf_name is None:
                continue
            tensor = by_name[gguf_name]
            if tensor.tensor_type.name not in GGUF_BLOCKS:
                continue
            blocks = torch.from_numpy(np.array(tensor.data))               # (N, bytes) uint8
            if cfg.arch == "llama" and name in ("q_proj", "k_proj"):
                blocks = g.unpermute(blocks, cfg.n_heads if name == "q_proj" else cfg.n_kv_heads)
            setattr(parent, name, from_gguf(tensor.tensor_type.name, blocks, child.bias).to(device))
    model.quant = "gguf"
    return model


def make_engine(model: Transformer, config: EngineConfig | int, *, generator=None,
                trace: Trace | None = None, draft: Transformer | None = None, grammars=None,
                engine: type[ContinuousEngine] = ContinuousEngine, **settings) -> ContinuousEngine:
    """The continuous engine of a config (or n_slots and keywords, or a config and keywords to
    change; a built `decoder` is used as it is, and a bucketed one of 06 lends its cache: see
    settings_of), with every part the config asks for. `draft` proposes (speculate="draft",
    11), `grammars` constrains (12), `generator` serves every request without a seed, a Trace
    records every step; `engine` is the class made (ContinuousEngine or a subclass)."""
    config, lent = settings_of(config, settings)
    if config.tensor_parallel_size > 1:                 # the model split over ranks (14)
        from tinyllm.ext.ranks import parallel_model
        if draft is not None:
            raise ValueError("a draft model is not split over ranks: tensor_parallel_size > 1 "
                             "takes speculate='ngram' or None")
        model = parallel_model(model, config.tensor_parallel_size)
    device = next(model.parameters()).device
    if lent is not None and lent.slots is not None:
        cache, decoder = lent_cache(model, config, device, lent), lent
    else:
        cache = make_cache(cache_spec(model, config, device), device)
        decoder = lent or make_decoder(model, config, cache) or ModelStep(model)
        if config.tensor_parallel_size > 1:
            model.attach(cache)                         # every rank makes one like it
    if config.kv == "paged":
        cache.headroom = config.kv_headroom             # its admission (05)
    runner = ModelRunner(model, cache, decoder, device)
    if config.speculate is not None or draft is not None:   # speculation around it (11)
        from tinyllm.ext.speculative import SpeculatingRunner, make_speculator
        runner = SpeculatingRunner(runner, make_speculator(model, config, cache, draft, decoder))
    return engine(model, config, cache, runner, planner=make_planner(config),
                  grammars=grammars, generator=generator, trace=trace)


def run_continuous(model: Transformer, requests: list[Request], config: EngineConfig | int,
                   arrivals: list[float] | None = None, *, generator=None,
                   trace: Trace | None = None, progress=None,
                   **settings) -> tuple[list[Result], dict]:
    """Continuous batching of `requests` on make_engine's engine: each joins when the clock
    since the start reaches its arrival time (None: all at 0), the engine steps until every
    request is done (continuous.run_engine). Returns the Results in request order and the
    summary."""
    engine = make_engine(model, config, generator=generator, trace=trace, **settings)
    return run_engine(engine, requests, arrivals, progress)


def make_decoder(model: Transformer, config: EngineConfig, cache: SlotCache):
    """The engine's decode step when it is not the model's own: CUDA graphs or the compiled
    step over the cache (06), the step compiled in pieces or each layer in one C call (13)."""
    if config.decoder == "graphs":
        from tinyllm.core.cuda_graph import SlotGraphDecoder
        return SlotGraphDecoder(model, cache, config.buckets)
    if config.decoder == "compiled":
        from tinyllm.core.compiled import CompiledDecoder
        return CompiledDecoder(model, cache, config.buckets, config.compile_mode)
    if config.decoder == "pieces":
        from tinyllm.ext.piecewise import PiecewiseDecoder
        return PiecewiseDecoder(model, max_rows=config.n_slots)
    if config.decoder == "fused":
        from tinyllm.ext.fused_layer import FusedDecoder
        return FusedDecoder(model)
    return None


def make_planner(config: EngineConfig):
    """The scheduler's planner: a token budget's (07) when the config has one, else step 04's
    (None: the engine's own, every context whole)."""
    if config.max_step_tokens is None:
        return None
    from tinyllm.core.chunked_prefill import TokenBudget
    return TokenBudget(config.max_step_tokens)


def settings_of(config: EngineConfig | int, settings: dict):
    """The EngineConfig of make_engine's arguments (n_slots and keywords, or a config and
    keywords to change), and the decoder passed to use, if one was: `decoder` names a kind
    ("eager", "graphs", "compiled", ...) or passes a built decode step (parts.DecodeStep); a
    bucketed decoder (06: SlotGraphDecoder, CompiledDecoder) brings its cache, whose kind and
    sizes (max_len; a paged pool's blocks and prefix cache), and its kind and compile mode, the
    config then takes."""
    lent = settings.pop("decoder", None)
    if isinstance(lent, DecodeStep) and lent.slots is not None:    # a bucketed decoder
        from tinyllm.core.compiled import CompiledDecoder
        if isinstance(lent, CompiledDecoder):
            settings["decoder"] = "compiled"
            if settings.setdefault("compile_mode", lent.mode) != lent.mode:
                raise ValueError(f"compile_mode {settings['compile_mode']!r}: the decoder "
                                 f"given was compiled in mode {lent.mode!r}")
        else:
            settings["decoder"] = "graphs"
        spec = spec_of(lent.slots)                      # by default, its cache's settings
        settings.setdefault("max_len", spec.max_len)
        if spec.kind == "paged":
            for name, value in (("kv", "paged"), ("kv_blocks", spec.n_blocks),
                                ("block_size", spec.block_size),
                                ("prefix_cache", spec.prefix_cache)):
                settings.setdefault(name, value)
    elif lent is not None and not isinstance(lent, DecodeStep):
        settings["decoder"], lent = lent, None
    if isinstance(config, EngineConfig):
        return dataclasses.replace(config, **settings), lent
    return EngineConfig(config, **settings), lent


def lent_cache(model: Transformer, config: EngineConfig, device, decoder) -> SlotCache:
    """A lent decoder's own cache (and its graphs or compiled steps), if it is the cache of
    these settings (cache_spec; a prefix cache that names blocks at admission only without a
    token budget) and is idle; else a ValueError."""
    cache = decoder.slots
    have, want = spec_of(cache), cache_spec(model, config, device)
    same = dataclasses.replace(have, name_at_admission=False) == \
        dataclasses.replace(want, name_at_admission=False)
    if decoder.model is not model or not same or any(cache.active) or \
            (have.name_at_admission and config.max_step_tokens is not None):
        raise ValueError(f"the decoder serves another model, or its cache is not the "
                         f"{config.kv} cache of these settings ({config.n_slots} idle slots of "
                         f"{want.max_len} positions)")
    return cache


def compiled_decoder(model: Transformer, config: EngineConfig):
    """A compiled decoder (06) over the cache make_engine(model, config) would have, every
    bucket compiled now, before any clock starts: pass it as `decoder=` to the engines that
    time it. Its compile_s says what the compilation took."""
    decoder = make_engine(model, dataclasses.replace(config, decoder="compiled")).decoder
    decoder.warm_up()
    return decoder
