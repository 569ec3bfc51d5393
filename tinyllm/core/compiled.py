"""Step 06 - the compiled decoder: the CUDA graphs' idea where there is no GPU.

On a CPU a small model's decode step pays per operation: each is dispatched from Python,
allocates its output and is read back for the next. `torch.compile` (inductor) traces the step
for a fixed shape and generates one program that fuses the small operations (RMSNorm, rotary
embedding, SwiGLU gate, mask) and calls the matrix products directly. It fits the graph decoder
exactly: the same static buffers, window buckets and decode step (`cuda_graph.decode_step`); a
bucket's step compiles the first time it is needed (`decoder.graphs[W]`) or ahead (`warm_up`).

Two modes: "default" leaves the products to the math library; "max-autotune" on a CPU also
freezes the weights into the program and generates a GEMM micro-kernel per product's shape (a
faster step, a longer compilation, a packed copy of the weights; a later change to the weights
is not seen). On CUDA it compiles with `mode="reduce-overhead"`. Its logits differ from the
eager step's by rounding (about 1e-6 in float32), so greedy tokens part only at a near-tie
(check.near_tie); in float64 they agree.
"""

import time

import torch

from tinyllm.core.config import COMPILE_MODES
from tinyllm.core.cuda_graph import SlotGraphDecoder
from tinyllm.core.model import Transformer
from tinyllm.core.paged_kv import PagedKVCache
from tinyllm.core.slot_cache import SlotKVCache


def compile_settings(mode: str, device: torch.device,
                     dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    """A mode on a device, for weights of a dtype -> torch.compile's keywords, and the inductor
    settings its compilation runs under. On CUDA, CUDA graphs: mode "reduce-overhead", or
    "max-autotune", which includes them. On a CPU, for max-autotune: frozen weights
    (`freezing`) and inductor's own GEMM kernels (`max_autotune` with its C++ GEMM template
    alone, which has kernels for float32, bf16 and float16, so there is nothing to benchmark;
    float64 keeps the library's GEMM). Those are set around the compiling call rather than
    passed as torch.compile's options, because the tracer must see `freezing` too: it is what
    keeps the weights as constants of the graph instead of inputs."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, COMPILE_MODES))}, got {mode!r}")
    if device.type == "cuda":
        return {"mode": "reduce-overhead" if mode == "default" else "max-autotune"}, {}
    if mode == "default":
        return {}, {}
    gemm = "ATEN" if dtype == torch.float64 else "CPP"
    return {}, {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": gemm}


# Every (decoder, bucket) is one compiled entry of the same code (run_eager): lift the default
# limit of 8, past which a compilation with fullgraph=True fails, by every decoder's buckets.
RECOMPILE_LIMIT = 64


def lift_recompile_limit(buckets: int) -> None:
    """torch.compile's recompile limit, in this process, raised to hold a new decoder's
    buckets beside every compiled entry so far (at least RECOMPILE_LIMIT)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT) + buckets


class CompiledStep:
    """A bucket's decode step compiled for its shapes, replayed like a captured graph:
    replay() runs it from the decoder's static buffers and leaves its logits (S, 1, V) in
    decoder.logits[W]. Its first replay compiles (decoder.compile_s[W] records how long it took)."""

    def __init__(self, decoder: "CompiledDecoder", W: int):
        self.decoder, self.W = decoder, W
        self.fn = torch.compile(decoder.run_eager, dynamic=False, fullgraph=True,
                                **decoder.compile_kwargs)

    def replay(self) -> None:
        dec, W = self.decoder, self.W
        first = W not in dec.compile_s
        t0 = time.perf_counter()
        with torch._inductor.config.patch(dec.inductor):    # read when (re)compiling
            dec.logits[W] = self.fn(W)                                   # (S, 1, V)
        if first:
            dec.compile_s[W] = time.perf_counter() - t0


class CompiledSteps(dict):
    """The decoder's compiled steps by bucket, each made when first asked for."""

    def __init__(self, decoder: "CompiledDecoder"):
        super().__init__()
        self.decoder = decoder

    def __missing__(self, W: int) -> CompiledStep:
        if W not in self.decoder.buckets:
            raise KeyError(f"{W} is not a bucket: the decoder compiles {self.decoder.buckets}")
        self[W] = step = CompiledStep(self.decoder, W)
        return step


class CompiledDecoder(SlotGraphDecoder):
    """The graph decoder with each bucket's step compiled by torch.compile instead of captured
    as a CUDA graph: the same interface, buckets and static buffers, on any device.

    capture is True (decode_step replays graphs[W]), but nothing is recorded at construction:
    graphs[W] compiles bucket W the first time a step needs it. compile_s[W]: the seconds that
    first step took, compilation included. warm_up() compiles buckets ahead, while the slots
    are free, so that no request waits for a compilation. mode: "default" or "max-autotune"
    (frozen weights and generated GEMM kernels: a faster step, a longer compilation)."""

    def __init__(self, model: Transformer, slots: SlotKVCache | PagedKVCache, buckets=None,
                 mode: str = "default"):
        # torch.compile's keywords and the inductor settings of every bucket (refuses a bad mode)
        self.compile_kwargs, self.inductor = compile_settings(mode, slots.k[0].device,
                                                              slots.k[0].dtype)
        super().__init__(model, slots, buckets, capture=False)
        self.mode, self.compiles = mode, True
        lift_recompile_limit(len(self.buckets))
        self.capture = True                             # decode_step replays graphs[W]
        self.graphs = CompiledSteps(self)
        self.compile_s: dict[int, float] = {}

    def __getstate__(self):
        """Sent to another process, the decoder goes without its compiled steps, which stay in
        the process that compiled them: it compiles them there (warm_up, or the first steps)."""
        return {**self.__dict__, "graphs": None, "logits": {}, "compile_s": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        lift_recompile_limit(len(self.buckets))
        self.graphs = CompiledSteps(self)

    @torch.no_grad()
    def warm_up(self, buckets=None, progress=None) -> dict[int, float]:
        """Compile these buckets now (default: every one) -> the seconds each took. Runs each
        bucket's step once on the free slots (it writes their position 0, which a prefill
        overwrites), so it needs every slot free. progress(W, seconds), if given, hears of each
        bucket as it is compiled."""
        if any(self.slots.active):
            raise ValueError("warm_up writes into the slots: call it while they are free")
        self.tokens.zero_()
        self.lens.zero_()
        self.fill_tables([])                            # a paged pool: every row on the pad
        for W in buckets or self.buckets:
            self.graphs[W].replay()
            if progress is not None:
                progress(W, self.compile_s[W])
        return {W: self.compile_s[W] for W in buckets or self.buckets}
