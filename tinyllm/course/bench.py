"""Steps 03-08 - the benchmark: named workloads on named engines, Stats.summary() side by side.

    python -m tinyllm bench --workload longtail --engines static,continuous --batch 16
    python -m tinyllm bench --engines continuous,paged --batch 16 --paged-slots 64
    python -m tinyllm bench --decode-steps          # one decode step: eager, graphed, compiled
    python -m tinyllm bench --decoder compiled --dtype bf16
    python -m tinyllm bench --decode-steps --compile-mode max-autotune --batch-sizes 1,8
    python -m tinyllm bench --workload long-prompt --engines continuous,continuous+chunked
    python -m tinyllm bench --workload shared-prefix --engines paged,paged+prefix

Engines: static (03), continuous (04, slots), paged (05: the same continuous engine on a pool
of blocks, by default the memory of --batch slots, shared by --paged-slots slots), graphs
(06: continuous with the decode step replayed as CUDA graphs; eager bucketed on a CPU) and
compiled (06: continuous with the decode step compiled by torch.compile, on any device; its
compilation happens before the clock starts and is reported apart, as compile_s). A
continuous engine's name may carry the later steps: +chunked (07: at most --max-step-tokens
tokens a step) and +prefix (08, paged: a prefix cache).
Timing lives here and in the notebooks, never in a test. Besides the summary keys of every engine it
reports where a decode step's time goes: the model's forward pass against the engine's own
bookkeeping (admission, sampling, slot moves, Python).
"""

import argparse
import json
import random
import time

import torch

from tinyllm import cuda_graph
from tinyllm.checkpoints.checkpoint import resolve
from tinyllm.compiled import CompiledDecoder
from tinyllm.config import COMPILE_MODES as MODES
from tinyllm.config import EngineConfig
from tinyllm.continuous import compiled_decoder, run_continuous
from tinyllm.cuda_graph import SlotGraphDecoder
from tinyllm.generate import autocast_for
from tinyllm.model import Transformer, gpu_dtype
from tinyllm.requests import Request, longest
from tinyllm.slot_cache import SlotKVCache
from tinyllm.static import run_static
from tinyllm.workloads import WORKLOADS, workload

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


ENGINES = ("static", "continuous", "paged", "graphs", "compiled")
OPTIONS = ("chunked", "prefix")                         # +chunked (07), +prefix (08)
DEFAULT_STEP_TOKENS = 64                                # a +chunked engine's budget by default


def engine_settings(engine: str, max_step_tokens: int | None = None, prefix_cache: bool = False,
                    budget_for_all: bool = False, decoder: str = "eager",
                    compile_mode: str = "default") -> tuple[str, dict]:
    """An engine's name -> its base engine and its ContinuousEngine settings from steps 06-08:
    'continuous+chunked' -> ('continuous', {'max_step_tokens': 64}). max_step_tokens (the
    command's flag) is the budget of a +chunked engine, and of every continuous engine when
    budget_for_all (no +chunked engine was named); prefix_cache gives every paged engine a
    prefix cache; decoder (eager, graphs, compiled) is the decode step of the continuous
    engines, which the graphs and compiled engines name themselves, compile_mode the compiled
    decoder's mode (default, max-autotune)."""
    base, *opts = engine.split("+")
    if base not in ENGINES or any(o not in OPTIONS for o in opts):
        raise ValueError(f"unknown engine {engine!r}: {', '.join(ENGINES)}, the continuous "
                         f"ones with +chunked and (paged) +prefix, e.g. paged+prefix")
    if opts and base == "static":
        raise ValueError(f"{engine}: static batching has no token budget and no prefix cache")
    if "prefix" in opts and base != "paged":
        raise ValueError(f"{engine}: a prefix cache shares blocks: use paged+prefix")
    kw = {}
    if "chunked" in opts or (base != "static" and budget_for_all and max_step_tokens is not None):
        kw["max_step_tokens"] = max_step_tokens or DEFAULT_STEP_TOKENS
    if base == "paged" and (prefix_cache or "prefix" in opts):
        kw["prefix_cache"] = True
    if base in ("graphs", "compiled") or (base == "continuous" and decoder != "eager"):
        kw["decoder"] = decoder if base == "continuous" else base
    if kw.get("decoder") == "compiled" and compile_mode != "default":
        kw["compile_mode"] = compile_mode
    return base, kw


def run(model, tok, workload_name: str, engine: str, batch: int, n: int = 64, seed: int = 0,
        progress=None, paged_slots: int | None = None, block_size: int = 16,
        kv_blocks: int | None = None, max_step_tokens: int | None = None,
        prefix_cache: bool = False, budget_for_all: bool = False, decoder: str = "eager",
        compile_mode: str = "default") -> dict:
    """One benchmark run -> its Stats.summary(). batch: static's batch size, the slots of the
    continuous engines; the paged engine gets paged_slots slots (default: batch) and kv_blocks
    blocks of block_size (default: the memory of `batch` slots). The KV cache is sized to the
    workload: max_len is its longest request. engine may carry +chunked and +prefix, decoder
    is the continuous engines' decode step, compile_mode a compiled one's mode
    (engine_settings). A compiled decoder compiles every bucket before the clock starts: the
    summary's compile_s."""
    base, kw = engine_settings(engine, max_step_tokens, prefix_cache, budget_for_all, decoder,
                               compile_mode)
    reqs, arrivals = workload(workload_name, tok, n, seed)
    if base == "static":
        if any(arrivals):
            raise ValueError(f"static batching is offline: it cannot take the {workload_name} "
                             f"workload, whose requests arrive over time")
        return run_static(model, reqs, batch, progress=progress)[1]
    slots, max_len = batch, longest(reqs)
    kw["max_len"] = max_len
    if base == "paged":
        slots = paged_slots or batch
        kw.update(kv="paged", block_size=block_size,
                  kv_blocks=kv_blocks or batch * -(-max_len // block_size))
    if kw.get("decoder") != "compiled":
        return run_continuous(model, reqs, slots, arrivals, progress=progress, **kw)[1]
    kw["decoder"] = decoder = compiled_decoder(model, EngineConfig(slots, **kw))
    summary = run_continuous(model, reqs, slots, arrivals, progress=progress, **kw)[1]
    return {**summary, "compile_s": sum(decoder.compile_s.values())}


@torch.no_grad()
def decode_step_times(model: Transformer, batch_sizes=(1, 2, 4, 8, 16, 32, 64), context: int = 100,
                      iters: int = 20, compiled: bool = True,
                      compile_mode: str = "default") -> list[dict]:
    """Milliseconds per decode step (median) of `batch` slots all holding `context` tokens: the
    plain eager step, the graph decoder's step (replayed graphs on CUDA, `graphed_ms`; its eager
    bucketed step elsewhere, `bucketed_ms`) and, when compiled, the compiled decoder's step
    (`compiled_ms`, in compile_mode), whose first step's seconds, compilation included, are
    `compile_s`."""
    device = next(model.parameters()).device
    cfg = model.cfg
    dtype = gpu_dtype(device) if device.type == "cuda" else next(model.parameters()).dtype
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(fn, slots) -> float:
        """The median of iters steps, in ms (a median shrugs off a step the OS interrupted).
        Each step is planned as the engine plans it, then rolled back, so every step sees
        the same context."""
        busy = slots.live_slots()

        def one_step():
            slots.plan_step(busy, [1] * len(busy))
            fn()
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

    # the KV cache fits the work: each slot holds the bucket the steps run at (128 for 100 tokens)
    max_len = cuda_graph.choose_bucket(cuda_graph.default_buckets(cfg.max_seq_len),
                                       context + 1) or cfg.max_seq_len
    rows = []
    for B in batch_sizes:
        slots = SlotKVCache(cfg.n_layers, B, cfg.n_kv_heads, cfg.head_dim, max_len, dtype, device)
        decoder = SlotGraphDecoder(model, slots)                # captures while the slots are idle
        if compiled:                        # compiles the one bucket the steps use, timed apart
            fast = CompiledDecoder(model, slots, mode=compile_mode)
            compile_s = fast.warm_up([cuda_graph.choose_bucket(fast.buckets, context + 1)])
        for s in range(B):                  # every slot holds `context` tokens (their values
            slots.admit(s, context)         # do not change the time)
            slots.lens[s] = context
        tokens = torch.ones(B, 1, dtype=torch.long, device=device)

        def eager():
            with autocast_for(device):
                model(tokens, cache=slots)

        row = {"batch": B, "eager_ms": timed(eager, slots),
               "bucketed_ms" if not decoder.capture else "graphed_ms": timed(lambda: decoder.step(tokens), slots)}
        if compiled:
            row["compiled_ms"] = timed(lambda: fast.step(tokens), slots)
            row["compile_s"] = sum(compile_s.values())
        rows.append(row)
    return rows


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
    """The summaries side by side, one row per key."""
    names = list(runs)
    w = [max(14, len(n) + 2) for n in names]
    lines = [f"{'':22}" + "".join(f"{n:>{k}}" for n, k in zip(names, w))]
    for key in runs[names[0]]:
        cells = [runs[n][key] for n in names]
        lines.append(f"{key:22}" + "".join(
            f"{c:>{k}.3f}" if isinstance(c, float) else f"{str(c):>{k}}" for c, k in zip(cells, w)))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m tinyllm bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
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

engines (--engines, comma-separated):
  static      step 03: a batch of --batch requests runs until its longest one ends
  continuous  step 04: requests join and leave --batch slots at every decode step
  paged       step 05: continuous on a pool of blocks (--block-size, --kv-blocks) shared
              by --paged-slots slots
  graphs      step 06: continuous with the decode step replayed as CUDA graphs (their
              eager bucketed twin on a CPU)
  compiled    step 06: continuous with the decode step compiled by torch.compile, one shape
              per bucket (any device); compiled before the clock starts: compile_s
  +chunked    step 07, after a continuous engine's name: at most --max-step-tokens tokens a
              step (default %d), decodes first, prompts in chunks
  +prefix     step 08, after paged: requests share the blocks of a common prefix""" % DEFAULT_STEP_TOKENS,
        epilog="""\
examples:
  python -m tinyllm bench --workload eos --engines static,continuous --batch 8 --requests 32
  python -m tinyllm bench --engines continuous,paged --batch 16 --paged-slots 64
  python -m tinyllm bench --decode-steps
  python -m tinyllm bench --decoder compiled --dtype bf16
  python -m tinyllm bench --decode-steps --compile-mode max-autotune --batch-sizes 1,8
  python -m tinyllm bench --workload long-prompt --engines continuous,continuous+chunked
  python -m tinyllm bench --workload shared-prefix --engines paged,paged+prefix""")
    default = " (default: %(default)s)"
    ap.add_argument("--workload", default="longtail", choices=WORKLOADS,
                    metavar="NAME", help="the requests to serve, see above" + default)
    ap.add_argument("--engines", default="static,continuous", metavar="NAMES",
                    help=", ".join(ENGINES) + " (+chunked, +prefix), comma-separated" + default)
    ap.add_argument("--batch", type=int, default=16, metavar="N",
                    help="static's batch size, the continuous engines' slots" + default)
    ap.add_argument("--paged-slots", type=int, default=None, metavar="N",
                    help="the paged engine's slots (default: --batch)")
    ap.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV block" + default)
    ap.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                    help="the paged engine's pool of blocks (default: the KV memory of --batch slots)")
    ap.add_argument("--max-step-tokens", type=int, default=None, metavar="N",
                    help="the +chunked engines compute at most N tokens a step (step 07; "
                         "default %d); with no +chunked engine named, every continuous engine "
                         "does" % DEFAULT_STEP_TOKENS)
    ap.add_argument("--prefix-cache", action="store_true",
                    help="every paged engine shares the blocks of common prefixes (step 08)")
    ap.add_argument("--peers", action="store_true",
                    help="tinyllm's engines (eager, compiled, compiled bf16) against transformers' "
                         "(and llama.cpp's on a .gguf) on the same weights, and stop")
    ap.add_argument("--decode-steps", action="store_true",
                    help="time one decode step per batch size: eager, graphed (bucketed on a "
                         "CPU) and compiled, and stop")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", metavar="N,N",
                    help="--decode-steps' batch sizes (each costs a compilation)" + default)
    ap.add_argument("--decoder", default="eager", choices=("eager", "graphs", "compiled"),
                    help="the decode step of the continuous engines on slots" + default)
    ap.add_argument("--compile-mode", default="default", choices=MODES,
                    help="the compiled decoder's mode: max-autotune freezes the weights and "
                         "generates GEMM kernels for the step's batch, a faster step for a "
                         "longer compilation" + default)
    ap.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                    help="the weights' and KV cache's dtype (default: float32 on a CPU, bf16 on "
                         "a GPU that has it); bf16 is faster on CPUs that compute in it "
                         "(avx512_bf16, AMX) and matches float32 up to near-ties")
    ap.add_argument("--requests", type=int, default=64, metavar="N", help="how many requests" + default)
    ap.add_argument("--seed", type=int, default=0, metavar="N", help="the workload's seed" + default)
    ap.add_argument("--model", default="default", metavar="DIR",
                    help="a checkpoint directory (runs/shakespeare), a .gguf file, or smollm2 (fetched "
                         "once) (default: the bundled model)")
    ap.add_argument("--device", default=None,
                    help="cpu, cuda, cuda:1, ... (default: cuda when there is one, else cpu)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)

    import tinyllm
    model, tok = tinyllm.load(args.model, device=args.device, dtype=DTYPES.get(args.dtype))
    device = next(model.parameters()).device
    if args.peers:
        from tinyllm.course import peers
        path = resolve(args.model)
        peer = peers.peer_model(path, device, next(model.parameters()).dtype)
        reqs, _ = workload(args.workload, tok, args.requests, args.seed)
        low = None if next(model.parameters()).dtype != torch.float32 else \
            tinyllm.load(args.model, device=device, dtype=torch.bfloat16)[0]
        rows = peers.compare(model, peer, reqs, args.batch,
                             gguf=path if path.suffix == ".gguf" else None, bf16_model=low,
                             compile_mode=args.compile_mode)
        if args.json:
            print(json.dumps({"workload": args.workload, "device": str(device), "rows": rows}, indent=2))
            return
        print(f"workload {args.workload}: {args.requests} requests, batch/slots {args.batch}, "
              f"{path.name} on {device} ({torch.get_num_threads()} threads), compiled rows in "
              f"compile mode {args.compile_mode}\n")
        print(peers.table(rows))
        print("\n== solo: requests whose tokens equal tinyllm's solo generate(); KV MiB: the KV "
              "cache tinyllm reserved, sized to the workload")
        return
    if args.decode_steps:
        try:
            sizes = [int(n) for n in args.batch_sizes.split(",")]
        except ValueError:
            ap.error(f"--batch-sizes takes numbers separated by commas, got {args.batch_sizes!r}")
        rows = decode_step_times(model, sizes, compile_mode=args.compile_mode)
        if args.json:
            print(json.dumps({"device": str(device), "context": 100, "rows": rows}, indent=2))
            return
        print(f"one decode step, every slot holding 100 tokens, {next(model.parameters()).dtype} "
              f"on {device} ({torch.get_num_threads()} threads), compile mode "
              f"{args.compile_mode}, ms per step\n")
        print(decode_steps_table(rows))
        if "graphed_ms" not in rows[0]:
            print("\nno CUDA here: bucketed is the graph decoder's eager bucketed step")
        print("compile_s: the first compiled step, compilation included; repaid after: the steps "
              "the compiled step must save it")
        return
    names = args.engines.split(",")
    budget_for_all = not any("+chunked" in name for name in names)
    for name in names:                                  # refuse a bad name before any run
        try:
            engine_settings(name, args.max_step_tokens, args.prefix_cache, budget_for_all,
                            args.decoder, args.compile_mode)
        except ValueError as e:
            ap.error(str(e))
    warm_up(model)
    runs = {}
    for name in names:
        bar = _bar(args.requests, name, quiet=args.json)
        runs[name] = run(model, tok, args.workload, name, args.batch, args.requests, args.seed, bar,
                         args.paged_slots, args.block_size, args.kv_blocks,
                         args.max_step_tokens, args.prefix_cache, budget_for_all, args.decoder,
                         args.compile_mode)
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps({"workload": args.workload, "batch": args.batch, "requests": args.requests,
                          "device": str(device), "torch_threads": torch.get_num_threads(),
                          "runs": runs}, indent=2))
        return
    print(f"workload {args.workload}: {args.requests} requests, batch/slots {args.batch}, "
          f"{device} ({torch.get_num_threads()} threads)\n")
    print(table(runs))
    print("\ndecode_overhead: the share of a decode step spent outside the model's forward pass")
