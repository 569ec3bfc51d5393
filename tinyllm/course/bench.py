"""Steps 03-08 - the benchmark: named workloads on named engines, Stats.summary() side by side.

    python -m tinyllm bench --workload longtail --engines static,continuous --slots 16
    python -m tinyllm bench --engines continuous,paged --slots 16 --paged-slots 64
    python -m tinyllm bench --decode-steps          # one decode step: eager, graphed, compiled

The engine's flags are EngineConfig's (as `serve`'s); each engine's name parses into the
EngineConfig it runs (engine_config). Engines: static (03), continuous (04), paged (05: a pool
of blocks shared by --paged-slots slots), graphs and compiled (06: the decode step replayed as
CUDA graphs, or compiled before the clock starts and reported apart, as compile_s). A
continuous engine's name may carry later steps: +chunked (07), +prefix (08, paged), +ngram or
+draft (11) and +tpN (14). Timing lives here and in the notebooks, never in a test. Besides
every engine's summary keys it reports the forward pass against the engine's bookkeeping, and
the run's CPU seconds (cpu_s, tok_per_cpu_s). --rounds N runs every engine N times in turn and
shows each one's median round; --temperature (with --top-k, --top-p) has the requests sample.
"""

import argparse
import json
import math
import time
from dataclasses import replace

import torch

from tinyllm.build import add_quant_argument, compiled_decoder, load, run_continuous
from tinyllm.checkpoints.checkpoint import resolve
from tinyllm.core import cuda_graph
from tinyllm.core.compiled import CompiledDecoder
from tinyllm.core.config import EngineConfig
from tinyllm.core.cuda_graph import SlotGraphDecoder
from tinyllm.core.generate import autocast_for
from tinyllm.core.model import Transformer, gpu_dtype
from tinyllm.core.requests import Request, longest
from tinyllm.core.sampling import Sampling
from tinyllm.core.slot_cache import SlotKVCache
from tinyllm.core.static import run_static
from tinyllm.core.workloads import WORKLOADS, workload

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
ENGINES = ("static", "continuous", "paged", "graphs", "compiled")
# +chunked (07), +prefix (08), +ngram and +draft (11); a decode step: +graphs, +compiled (06)
# and +pieces, +fused (13)
DECODE_STEPS = ("graphs", "compiled", "pieces", "fused")
OPTIONS = ("chunked", "prefix", "ngram", "draft", *DECODE_STEPS)
DEFAULT_STEP_TOKENS = 64                                # a +chunked engine's budget by default


def engine_name(name: str) -> tuple[str, list[str]]:
    """An engine's name -> its base engine and its options: 'paged+prefix' -> ('paged',
    ['prefix']). Raises ValueError saying what is wrong with the name."""
    base, *opts = name.split("+")
    if base not in ENGINES or any(o not in OPTIONS and not ranks(o) for o in opts):
        raise ValueError(f"unknown engine {name!r}: {', '.join(ENGINES)}, the continuous "
                         f"ones with +chunked, (paged) +prefix, +ngram or +draft (a proposer) "
                         f"and (continuous or paged) +graphs, +compiled, +pieces or +fused (a "
                         f"decode step) or +tpN (the model split over N ranks), e.g. "
                         f"paged+prefix")
    if opts and base == "static":
        raise ValueError(f"{name}: static batching has no token budget, no prefix cache and "
                         f"no decode step to choose")
    if "prefix" in opts and base != "paged":
        raise ValueError(f"{name}: a prefix cache shares blocks: use paged+prefix")
    if "ngram" in opts and "draft" in opts:
        raise ValueError(f"{name}: one proposer at a time: +ngram or +draft")
    steps = [o for o in opts if o in DECODE_STEPS]
    if steps and base not in ("continuous", "paged"):
        raise ValueError(f"{name}: +{steps[0]} is a decode step of continuous or paged")
    if len(steps) > 1:
        raise ValueError(f"{name}: one decode step at a time: +graphs, +compiled, +pieces or "
                         f"+fused")
    return base, opts


def ranks(option: str) -> int | None:
    """The ranks an engine option +tpN splits the model over (14), or None: 'tp2' -> 2."""
    digits = option.removeprefix("tp")
    return int(digits) if option.startswith("tp") and digits.isdigit() else None


def engine_config(name: str, args, max_len: int | None = None, budget_for_all: bool = True,
                  speculate_for_all: bool = True) -> tuple[str, EngineConfig]:
    """An engine's name and the command's flags (args, from parser()) -> its base engine and
    the EngineConfig it runs: the flags' config (EngineConfig.from_args) with the name's
    changes, e.g. 'paged+prefix' -> ('paged', kv='paged', prefix_cache=True, ...).

    - every engine: max_len (the workload's longest request);
    - +chunked: a budget of --max-step-tokens, or DEFAULT_STEP_TOKENS; with budget_for_all (no
      +chunked engine named), --max-step-tokens is every continuous engine's budget;
    - paged: --paged-slots slots (default: --slots) on a pool of --kv-blocks blocks (default:
      the memory of --slots slots of max_len); +prefix or --prefix-cache: a prefix cache;
      --no-kv-headroom: no block kept for the running requests to grow into (05);
    - +ngram, +draft: that proposer (11); with no proposer named by any engine, --speculate is
      every continuous engine's;
    - graphs and compiled: that decoder; continuous: --decoder; compiled: --compile-mode;
      +graphs, +compiled (06), +pieces and +fused (13), after continuous or paged: that decode
      step;
    - static: batches of --slots requests; its config holds n_slots alone.
    The flags name settings of several engines at once (--prefix-cache and --no-kv-headroom the
    paged ones', --compile-mode the compiled ones'), so each name sets every field that it
    decides.
    Raises ValueError naming a bad name or setting."""
    base, opts = engine_name(name)
    if base == "static":
        return base, EngineConfig(args.n_slots)
    decoder = {"continuous": args.decoder, "graphs": "graphs", "compiled": "compiled"}.get(
        base, "eager")                                  # paged: the eager step, or its option's
    decoder = next((o for o in opts if o in DECODE_STEPS), decoder)
    chunked = "chunked" in opts or (budget_for_all and args.max_step_tokens is not None)
    budget = (args.max_step_tokens or DEFAULT_STEP_TOKENS) if chunked else None
    named = [o for o in opts if o in ("ngram", "draft")]
    speculate = named[0] if named else args.speculate if speculate_for_all else None
    tp = next((ranks(o) for o in opts if ranks(o)), args.tensor_parallel_size)
    changes = dict(max_len=max_len, kv="slots", prefix_cache=False, kv_headroom=True,
                   decoder=decoder, tensor_parallel_size=tp,
                   max_step_tokens=budget, speculate=speculate,
                   compile_mode=args.compile_mode if decoder == "compiled" else "default")
    if base == "paged":
        pool = args.kv_blocks or (max_len and args.n_slots * math.ceil(max_len / args.block_size))
        changes.update(kv="paged", n_slots=args.paged_slots or args.n_slots, kv_blocks=pool,
                       prefix_cache=args.prefix_cache or "prefix" in opts,
                       kv_headroom=args.kv_headroom)
    return base, EngineConfig.from_args(args, **changes)


def engine_configs(names: list[str], args,
                   max_len: int | None = None) -> dict[str, tuple[str, EngineConfig]]:
    """Each engine's name -> engine_config's (base engine, config); --max-step-tokens is every
    continuous engine's budget when no +chunked engine is named, --speculate every continuous
    engine's proposer when no +ngram or +draft engine is."""
    budget_for_all = not any("+chunked" in name for name in names)
    spec_for_all = not any(o in engine_name(n)[1] for n in names for o in ("ngram", "draft"))
    return {name: engine_config(name, args, max_len, budget_for_all, spec_for_all)
            for name in names}


def run(model, tok, workload_name: str, config: EngineConfig, n: int = 64, seed: int = 0,
        progress=None, static: bool = False, draft=None, sampling: Sampling | None = None
        ) -> dict:
    """One benchmark run of the workload's n requests (fixed by seed; those of no sampling of
    their own sample with `sampling`, each seeded: workload) -> its Stats.summary():
    static batching (03) of config.n_slots requests at a time when static, else the
    continuous engine of config (engine_config's), whose max_len, where it is None, is the
    workload's longest request. A compiled decoder compiles every bucket before the clock
    starts, decoder "pieces" its pieces for every bucket of rows: the summary's compile_s.
    progress: a tqdm bar, told of finished requests. draft: the model a +draft engine's
    proposer runs (None: the model's first layers)."""
    reqs, arrivals = workload(workload_name, tok, n, seed, sampling)
    if static:
        if any(arrivals):
            raise ValueError(f"static batching is offline: it cannot take the {workload_name} "
                             f"workload, whose requests arrive over time")
        return cpu_timed(lambda: run_static(model, reqs, config.n_slots, progress=progress))
    if config.max_len is None:
        config = replace(config, max_len=longest(reqs))
    grammars = None
    if any(r.sampling is not None and r.sampling.constraint is not None for r in reqs):
        from tinyllm.ext.structured import LLGuidance  # step 12's, imported when a run asks
        grammars = LLGuidance(tok, model.cfg.vocab_size)                # the json workload (12)
    split = config.tensor_parallel_size > 1
    if split:                                   # 14: the ranks start before the clock
        from tinyllm.ext.parallel import TALK
        from tinyllm.ext.ranks import parallel_model
        parallel_model(model, config.tensor_parallel_size).start()
        talk = dict(TALK)
    serve = lambda **decoder: cpu_timed(lambda: run_continuous(
        model, reqs, config, arrivals, progress=progress, draft=draft, grammars=grammars,
        **decoder), ranks=split)
    if split:
        summary = serve()
        return {**summary, **{k: v - talk[k] for k, v in TALK.items()}}
    if config.decoder == "pieces":                  # every bucket compiled before the clock
        from tinyllm.ext.piecewise import PiecewiseDecoder  # step 13's, imported when asked
        compile_s = PiecewiseDecoder(model).warm_up(config.n_slots)
        return {**serve(), "compile_s": compile_s}
    if config.decoder != "compiled":
        return serve()
    decoder = compiled_decoder(model, config)
    return {**serve(decoder=decoder), "compile_s": sum(decoder.compile_s.values())}


def cpu_timed(serve, ranks: bool = False) -> dict:
    """serve() -> (results, summary), run once: its summary, with the CPU seconds this
    process spent in it (cpu_s, every thread's; with ranks, a split model's other ranks' too,
    14) and tok_per_cpu_s, its tokens over them. On a shared machine the CPU time hardly moves
    when other jobs take turns on the cores; the wall clock does."""
    others = lambda: 0.0                        # noqa: E731
    if ranks:                                   # 14's, imported when a run asks
        from tinyllm.ext.ranks import other_ranks_cpu_s as others
    t0 = time.process_time() + others()
    summary = serve()[1]
    cpu_s = time.process_time() + others() - t0
    return {**summary, "cpu_s": cpu_s, "tok_per_cpu_s": summary["useful_tokens"] / cpu_s}


def _median_step_ms(step, slots: SlotKVCache, iters: int, sync) -> float:
    """The median of iters decode steps of every live slot, in ms (a median shrugs off a step
    the OS interrupted), after 3 untimed ones. Each step is planned as the engine plans it,
    then rolled back, so every step sees the same context."""
    busy = slots.live_slots()

    def one_step():
        slots.plan_step(busy, [1] * len(busy))
        step()
        for s in busy:
            slots.rollback(s, 1)

    for _ in range(3):
        one_step()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        one_step()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _decode_step_row(model: Transformer, B: int, context: int, max_len: int, iters: int,
                     compiled: bool, compile_mode: str) -> dict:
    """decode_step_times' row of batch size B: its slots of max_len positions, each holding
    `context` tokens, stepped by each decoder."""
    cfg, device = model.cfg, next(model.parameters()).device
    dtype = gpu_dtype(device) if device.type == "cuda" else next(model.parameters()).dtype
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    slots = SlotKVCache(cfg.n_layers, B, cfg.n_kv_heads, cfg.head_dim, max_len, dtype, device)
    decoder = SlotGraphDecoder(model, slots)                # captures while the slots are idle
    if compiled:                            # compiles the one bucket the steps use, timed apart
        fast = CompiledDecoder(model, slots, mode=compile_mode)
        compile_s = fast.warm_up([cuda_graph.choose_bucket(fast.buckets, context + 1)])
    for s in range(B):                      # every slot holds `context` tokens (their values
        slots.admit(s, context)             # do not change the time)
        slots.lens[s] = context
    tokens = torch.ones(B, 1, dtype=torch.long, device=device)

    def eager():
        with autocast_for(device):
            model(tokens, cache=slots)

    timed = lambda step: _median_step_ms(step, slots, iters, sync)
    row = {"batch": B, "eager_ms": timed(eager),
           "graphed_ms" if decoder.capture else "bucketed_ms": timed(lambda: decoder.step(tokens))}
    if compiled:
        row["compiled_ms"] = timed(lambda: fast.step(tokens))
        row["compile_s"] = sum(compile_s.values())
    return row


@torch.no_grad()
def decode_step_times(model: Transformer, batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                      context: int = 100, iters: int = 20, compiled: bool = True,
                      compile_mode: str = "default") -> list[dict]:
    """Milliseconds per decode step (median) of `batch` slots all holding `context` tokens: the
    plain eager step, the graph decoder's step (replayed graphs on CUDA, `graphed_ms`; its eager
    bucketed step elsewhere, `bucketed_ms`) and, when compiled, the compiled decoder's step
    (`compiled_ms`, in compile_mode), whose first step's seconds, compilation included, are
    `compile_s`."""
    # the KV cache fits the work: each slot holds the bucket the steps run at (128 for 100 tokens)
    max_seq_len = model.cfg.max_seq_len
    max_len = cuda_graph.choose_bucket(cuda_graph.default_buckets(max_seq_len),
                                       context + 1) or max_seq_len
    return [_decode_step_row(model, B, context, max_len, iters, compiled, compile_mode)
            for B in batch_sizes]


def _bar(total: int, desc: str, quiet: bool):
    """A tqdm progress bar when tqdm is installed (the notebooks extra), else nothing."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", disable=quiet, leave=False)


def warm_up(model: Transformer) -> None:
    """One small batch through both engines before any clock starts: the first calls of a
    process pay for allocator growth and kernel selection, which no engine should be charged."""
    reqs = [Request([1, 2, 3], 8), Request([4, 5], 4)]
    run_static(model, reqs, 2)
    run_continuous(model, reqs, 2)


def decode_steps_table(rows: list[dict]) -> str:
    """decode_step_times' rows: ms per step by batch size, the speed-ups over eager, and the
    steps after which the compiled step has repaid its compilation."""
    keys = [k for k in rows[0] if k.endswith("_ms")]
    head = ["batch"] + [k[:-3] for k in keys] + [f"{k[:-3]} x" for k in keys[1:]]
    if "compile_s" in rows[0]:
        head += ["compile_s", "repaid after"]
    lines = ["".join(f"{h:>13}" for h in head)]
    for r in rows:
        cells = [f"{r['batch']:>13}"] + [f"{r[k]:>13.2f}" for k in keys] + \
                [f"{r['eager_ms'] / r[k]:>12.2f}x" for k in keys[1:]]
        if "compile_s" in r:
            saved = r["eager_ms"] - r["compiled_ms"]
            cells += [f"{r['compile_s']:>13.1f}",
                      f"{r['compile_s'] * 1e3 / saved:>7.0f} steps" if saved > 0
                      else f"{'never':>13}"]
        lines.append("".join(cells))
    return "\n".join(lines)


def table(runs: dict[str, dict]) -> str:
    """The summaries side by side, one row per key of any of them ('-' where a run has none,
    as compile_s beside an engine that compiles nothing)."""
    names = list(runs)
    w = [max(14, len(n) + 2) for n in names]
    lines = [f"{'':22}" + "".join(f"{n:>{k}}" for n, k in zip(names, w))]
    for key in dict.fromkeys(k for summary in runs.values() for k in summary):
        cells = [runs[n].get(key, "-") for n in names]
        lines.append(f"{key:22}" + "".join(
            f"{c:>{k}.3f}" if isinstance(c, float) else f"{str(c):>{k}}" for c, k in zip(cells, w)))
    return "\n".join(lines)


# ---- the command line --------------------------------------------------------------------------
DESCRIPTION = f"""\
Compare serving engines on a named workload: every engine serves the same requests, and their
Stats.summary() are printed side by side (--json for a machine).

workloads (--requests of them, fixed by --seed):
  uniform     every prompt 16 random tokens and 64 new tokens, no EOS: all end together
  longtail    prompts of 8-32 random tokens; most answers short, a few 256 tokens, no EOS
  eos         a speaker's prompt ("Ham.", "My lord,"), sampled at temperature 0.8: the
              model's own <|endoftext|> ends each answer, most after a line (at most 256)
  poisson     the eos requests arriving over time, 8 a second on average (continuous
              engines only: static batching is offline)
  shared-prefix  a 360-token system prompt shared by all, then a distinct 40-token question
              each, 16 new tokens; arriving over time, 16 a second (continuous engines only)
  long-prompt short requests (8-32 prompt tokens, 32-96 new) and every 16th a 448-token
              prompt, which joins while the others decode
  chat        a few dozen English questions in the model's chat template, greedy, each
              ended by the model's EOS (at most 128 tokens); with --peers on a real model
  quote       a passage of five questions written twice, and the model goes on (greedy):
              it writes the passage again, which is in the prompt (where +ngram finds it)
  json        the chat questions, every other one constrained to a JSON object of one short
              answer (step 12), the others free

engines (--engines, comma-separated), each with its KV cache sized to the workload's longest
request:
  static      step 03: a batch of --slots requests runs until its longest one ends
  continuous  step 04: requests join and leave --slots slots at every decode step; its decode
              step is --decoder's
  paged       step 05: continuous on a pool of --kv-blocks blocks of --block-size (default:
              the memory of --slots slots) shared by --paged-slots slots
  graphs      step 06: continuous with the decode step replayed as CUDA graphs (their
              eager bucketed twin on a CPU)
  compiled    step 06: continuous with the decode step compiled by torch.compile, one shape
              per bucket (any device), in --compile-mode; compiled before the clock starts:
              compile_s
  +chunked    step 07, after a continuous engine's name: at most --max-step-tokens tokens
              a step (default {DEFAULT_STEP_TOKENS}), decodes first, prompts in chunks;
              with no +chunked engine named, every continuous engine has that budget
  +prefix     step 08, after paged: requests share the blocks of a common prefix, as every
              paged engine does with --prefix-cache
  +ngram      step 11: up to --spec-tokens guesses a request a step, by prompt lookup,
  +draft      or by a draft (the model's first --draft-layers layers), verified in one pass;
              with neither named, every continuous engine speculates as --speculate says
  +graphs     step 06, after continuous or paged: the graph decoder's step (a paged pool's
  +compiled   block tables in a static buffer), or that step compiled
  +pieces     step 13, after continuous or paged: each layer's decode compiled in pieces
              around the eager attention (any cache), on first use (seconds)
  +fused      step 13, after continuous or paged: each layer's decode in one C call (float
              weights on a CPU), nothing compiled"""

EPILOG = """\
examples:
  python -m tinyllm bench --workload eos --engines static,continuous --slots 8 --requests 32
  python -m tinyllm bench --engines continuous,paged --slots 16 --paged-slots 64
  python -m tinyllm bench --requests 256 --paged-slots 64 --rounds 3 \
      --engines static,continuous,paged
  python -m tinyllm bench --decode-steps
  python -m tinyllm bench --decoder compiled --dtype bf16
  python -m tinyllm bench --decode-steps --compile-mode max-autotune --batch-sizes 1,8
  python -m tinyllm bench --workload long-prompt --engines continuous,continuous+chunked
  python -m tinyllm bench --workload shared-prefix --engines paged,paged+prefix
  python -m tinyllm bench --engines paged,paged+compiled --slots 16 --paged-slots 64
  python -m tinyllm bench --model smollm2 --workload chat --slots 1 --requests 4 \
      --engines continuous,continuous+pieces --quant none,float,int8,int4
  python -m tinyllm bench --model smollm2 --workload chat --slots 1 --requests 4 \
      --engines continuous+pieces,continuous+fused --quant float"""


def batch_sizes(text: str) -> list[int]:
    """--batch-sizes' value: '1,2,4' -> [1, 2, 4]."""
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers separated by commas, got {text!r}") from None


def positive_int(text: str) -> int:
    """--rounds' value: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    """The command's parser: the benchmark's flags, then the engine's (EngineConfig's, as
    `serve` has them, but --kv: the engine names pick the cache). Flags are named in full:
    --batch is not --batch-sizes."""
    ap = argparse.ArgumentParser(prog="python -m tinyllm bench", description=DESCRIPTION,
                                 epilog=EPILOG, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    default = " (default: %(default)s)"
    ap.add_argument("--workload", default="longtail", choices=WORKLOADS,
                    metavar="NAME", help="the requests to serve, see above" + default)
    ap.add_argument("--engines", default="static,continuous", metavar="NAMES",
                    help=", ".join(ENGINES) + " (+chunked, +prefix, +ngram, +draft), "
                         "comma-separated" + default)
    ap.add_argument("--paged-slots", type=int, default=None, metavar="N",
                    help="the paged engines' slots (default: --slots)")
    ap.add_argument("--peers", action="store_true",
                    help="tinyllm's engines (eager, compiled, compiled bf16) against "
                         "transformers' (and llama.cpp's on a .gguf) on the same weights, "
                         "batches or slots of --slots, and stop")
    ap.add_argument("--prefill", type=batch_sizes, default=None, metavar="N,N",
                    help="time one prompt of each length to its first token on a slot of its "
                         "own, for each continuous engine of --engines (with --peers, beside "
                         "llama.cpp's evaluation of it), and stop (course/one_request.py)")
    ap.add_argument("--solo", type=int, default=None, metavar="N",
                    help="time one request's N new tokens at batch 1, after a 16-token prompt, "
                         "for each continuous engine of --engines and each --quant (with "
                         "--peers, beside llama.cpp's), and stop (course/one_request.py)")
    ap.add_argument("--serve-start", action="store_true", help="time `serve` to the first "
                    "token of one streamed request, each --quant, and stop (server_start.py)")
    ap.add_argument("--empty-caches", action="store_true", help="--serve-start with "
                    "TorchInductor's and the C kernels' caches empty, as on a new machine")
    ap.add_argument("--pages", default="2m", choices=("2m", "4k", "both"),
                    help="--solo: every contender's weights on 2 MB pages, on 4 KB pages, or "
                         "each on both, side by side" + default)
    ap.add_argument("--decode-steps", action="store_true",
                    help="time one decode step per batch size: eager, graphed (bucketed on a "
                         "CPU) and compiled, and stop")
    ap.add_argument("--batch-sizes", type=batch_sizes, default="1,2,4,8,16,32,64", metavar="N,N",
                    help="--decode-steps' batch sizes (each costs a compilation)" + default)
    ap.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                    help="the weights' and KV cache's dtype (default: float32 on a CPU, bf16 on "
                         "a GPU that has it); bf16 is faster on CPUs that compute in it "
                         "(avx512_bf16, AMX) and matches float32 up to near-ties")
    ap.add_argument("--requests", type=int, default=64, metavar="N",
                    help="how many requests" + default)
    ap.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                    help="run every engine N times, in turn, and show each engine's median "
                         "round by tokens per CPU-second" + default)
    ap.add_argument("--seed", type=int, default=0, metavar="N",
                    help="the workload's seed" + default)
    add_sampling_arguments(ap)
    ap.add_argument("--model", default="default", metavar="DIR",
                    help="a checkpoint directory (runs/shakespeare), a .gguf file, or smollm2 "
                         "(fetched once) (default: the bundled model)")
    add_quant_argument(ap, several=True)
    ap.add_argument("--device", default=None,
                    help="cpu, cuda, cuda:1, ... (default: cuda when there is one, else cpu)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    EngineConfig.add_arguments(ap, kv=False)
    return ap


def add_sampling_arguments(ap) -> None:
    """--temperature, --top-k, --top-p: how the workload's greedy requests sample, read back
    by sampling_from_flags."""
    ap.add_argument("--temperature", type=float, default=0.0, metavar="T",
                    help="--engines: the workload's greedy requests sample at temperature T "
                         "instead, each with a seed of its own (default: 0, greedy)")
    ap.add_argument("--top-k", type=int, default=None, metavar="K",
                    help="with --temperature: sample from the K likeliest tokens")
    ap.add_argument("--top-p", type=float, default=None, metavar="P",
                    help="with --temperature: sample from the likeliest tokens that hold P of "
                         "the probability")


def where(model) -> str:
    """The model's dtype and device, and the threads torch computes with."""
    p = next(model.parameters())
    return f"{p.dtype} on {p.device} ({torch.get_num_threads()} threads)"


def compare_peers(args, model, tok) -> None:
    """--peers: tinyllm's engines against transformers' (and llama.cpp's) on the workload."""
    import tinyllm
    from tinyllm.course import peers
    path, p = resolve(args.model), next(model.parameters())
    peer = peers.peer_model(path, p.device, p.dtype)
    reqs, _ = workload(args.workload, tok, args.requests, args.seed)
    low = None if p.dtype != torch.float32 else \
        tinyllm.load(args.model, device=p.device, dtype=torch.bfloat16)[0]
    rows = peers.compare(model, peer, reqs, args.n_slots,
                         gguf=path if path.suffix == ".gguf" else None, bf16_model=low,
                         compile_mode=args.compile_mode)
    if args.json:
        print(json.dumps({"workload": args.workload, "device": str(p.device), "rows": rows},
                         indent=2))
        return
    print(f"workload {args.workload}: {args.requests} requests, batch/slots {args.n_slots}, "
          f"{path.name} on {p.device} ({torch.get_num_threads()} threads), compiled rows in "
          f"compile mode {args.compile_mode}\n")
    print(peers.table(rows))
    print("\n== solo: requests whose tokens equal tinyllm's solo generate(); KV MiB: the KV "
          "cache tinyllm reserved, sized to the workload")


def time_decode_steps(args, model, quant: str = "none") -> None:
    """--decode-steps: one decode step's time per batch size, eager, graphed and compiled (a
    quantized model's eager step only: its layers compile their own loops)."""
    from tinyllm.ext.quant import weight_bytes
    rows = decode_step_times(model, args.batch_sizes, compiled=quant == "none",
                             compile_mode=args.compile_mode)
    if args.json:
        device = str(next(model.parameters()).device)
        print(json.dumps({"device": device, "context": 100, "rows": rows}, indent=2))
        return
    print(f"one decode step, every slot holding 100 tokens, {where(model)}, weights "
          f"{'float' if quant == 'none' else quant} ({weight_bytes(model) / 2**20:.1f} MiB "
          f"read a step), compile mode {args.compile_mode}, ms per step\n")
    print(decode_steps_table(rows))
    if "graphed_ms" not in rows[0]:
        print("\nno CUDA here: bucketed is the graph decoder's eager bucketed step")
    print("compile_s: the first compiled step, compilation included; repaid after: the steps "
          "the compiled step must save it")


def median_run(summaries: list[dict]) -> dict:
    """Of one engine's rounds, the one whose tok_per_cpu_s is the median (the lower of the
    middle two for an even number): every figure of the row comes from one real run."""
    return sorted(summaries, key=lambda s: s["tok_per_cpu_s"])[(len(summaries) - 1) // 2]


def compare_one_request(ap, args, models: dict) -> None:
    """--prefill or --solo: one request alone on each continuous engine of --engines (static
    ones left out), each --quant, and with --peers llama.cpp; a table, or JSON."""
    from tinyllm.course import one_request  # imported when a run asks
    names = [n for n in args.engines.split(",") if not n.startswith("static")] or ["continuous"]
    try:
        configs = {n: c for n, (_, c) in engine_configs(names, args).items()}
        rows = (one_request.measure if args.prefill else one_request.measure_solo)(
            args, models, configs)
    except ValueError as e:
        ap.error(str(e))
    what = "prefill" if args.prefill else "solo"
    if args.json:
        print(json.dumps({what: rows, "torch_threads": torch.get_num_threads()}, indent=2))
        return
    rounds = f"the median of {args.rounds} round{'s' * (args.rounds != 1)}"
    if args.prefill:
        print(f"prefill: one prompt a slot, {torch.get_num_threads()} threads; {rounds}\n")
        print(one_request.table(rows))
        return
    print(f"decode at batch 1: {args.solo} new tokens after {one_request.SOLO_PROMPT} prompt "
          f"tokens, {torch.get_num_threads()} threads; {rounds}; the memory reads "
          f"{rows[0]['read_gb_per_s']:.1f} GB a CPU-second\n")
    print(one_request.solo_table(rows))
    print("\nof bound: the bytes a token times tokens a CPU-second, over the memory's read "
          "speed (llama.cpp: its file's bytes)")


def compare_starts(args) -> None:
    """--serve-start: `serve` started --rounds times for each --quant, the median start of
    each; a table, or JSON."""
    from tinyllm.course import server_start  # imported when a run asks
    rows = server_start.measure(args)
    if args.json:
        print(json.dumps({"serve_start": rows}, indent=2))
        return
    print(f"serve, launched to the first of {server_start.TOKENS} streamed tokens; the median "
          f"of {args.rounds} start{'s' * (args.rounds != 1)} by CPU-seconds of its processes\n")
    print(server_start.table(rows))


def sampling_from_flags(ap, args) -> Sampling | None:
    """--temperature, --top-k and --top-p as the Sampling the workload's greedy requests take
    instead (None: greedy); a bad value is refused, by name."""
    if not args.temperature:
        if args.top_k is not None or args.top_p is not None:
            ap.error("--top-k and --top-p cut what a request samples: give --temperature too")
        return None
    try:
        return Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        ap.error(str(e))


def sampled(sampling: Sampling | None) -> str:
    """How the greedy requests sample, in a few words: 'temperature 0.8, top_p 0.9'."""
    if sampling is None:
        return "greedy"
    cuts = [f"{k} {getattr(sampling, k)}" for k in ("top_k", "top_p") if getattr(sampling, k)]
    return ", ".join([f"temperature {sampling.temperature}"] + cuts)


def compare_engines(ap, args, models: dict, tok) -> None:
    """--engines: each engine, its config parsed from its name and the flags, on the same
    requests (sampled as --temperature says), on each model of --quant (named "engine int8"
    when there are several); their summaries side by side. A bad name is refused before any
    run."""
    sampling = sampling_from_flags(ap, args)
    reqs, _ = workload(args.workload, tok, args.requests, args.seed, sampling)
    try:
        engines = engine_configs(args.engines.split(","), args, max_len=longest(reqs))
    except ValueError as e:
        ap.error(str(e))
    rounds: dict[str, list[dict]] = {}
    for quant, model in models.items():
        warm_up(model)
    for r in range(args.rounds):                    # each round runs every engine once
        for quant, model in models.items():
            for name, (base, config) in engines.items():
                key = name if len(models) == 1 else f"{name} {quant}"
                bar = _bar(args.requests, key if args.rounds == 1 else f"{key} ({r + 1})",
                           quiet=args.json)
                rounds.setdefault(key, []).append(run(
                    model, tok, args.workload, config, args.requests, args.seed, bar,
                    static=base == "static", draft=args.draft_model, sampling=sampling))
                if bar is not None:
                    bar.close()
    runs = {key: median_run(summaries) for key, summaries in rounds.items()}
    device = next(model.parameters()).device
    if args.json:
        print(json.dumps({"workload": args.workload, "slots": args.n_slots,
                          "requests": args.requests, "sampling": sampled(sampling),
                          "device": str(device),
                          "torch_threads": torch.get_num_threads(), "runs": runs}, indent=2))
        return
    print(f"workload {args.workload}: {args.requests} requests, batch/slots {args.n_slots}, "
          + (f"its greedy requests at {sampled(sampling)}, " if sampling else "")
          + f"{device} ({torch.get_num_threads()} threads)"
          + (f"; each engine's median round of {args.rounds} by tok_per_cpu_s"
             if args.rounds > 1 else "") + "\n")
    print(table(runs))
    print("\ndecode_overhead: the share of a decode step spent outside the model's forward pass")


def main(argv=None) -> None:
    """python -m tinyllm bench: the engines on a workload, or --peers, --decode-steps, one
    request (--prefill, --solo) or a server's start (--serve-start)."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.serve_start:                                # servers of their own: nothing loaded here
        compare_starts(args)
        return
    models = {}
    for quant in args.quant:                            # step 13's weights, pages and attention
        models[quant], tok = load(args.model, device=args.device, dtype=DTYPES.get(args.dtype),
                                  quant=quant, huge_pages=True)
    model = next(iter(models.values()))
    args.draft_model = None if args.draft is None else \
        load(args.draft, device=args.device, dtype=DTYPES.get(args.dtype), huge_pages=True)[0]
    if args.prefill or args.solo:
        compare_one_request(ap, args, models)
    elif args.peers:
        compare_peers(args, model, tok)
    elif args.decode_steps:
        for quant, model in models.items():
            time_decode_steps(args, model, quant)
    else:
        compare_engines(ap, args, models, tok)
