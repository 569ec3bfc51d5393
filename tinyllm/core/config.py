"""Steps 04-08 - the engine's settings: one EngineConfig, from the command line to the scheduler.

Every setting of the continuous engine has one name and one type on its whole way in: a flag of
`python -m tinyllm bench` or `serve` (`EngineConfig.add_arguments`) becomes a field of the same
name (`EngineConfig.from_args`), a benchmark's engine name (`paged+prefix+chunked`) changes
fields with `dataclasses.replace`, and the engine, its scheduler and its cache read the fields.
The config is checked when it is made, so a bad setting is named before any memory is taken.
"""

import math
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from tinyllm.core.requests import check_positive_int
from tinyllm.core.sampling import Sampling

DEFAULT_KV_MIB = 512     # the KV cache's memory when none is given (vLLM's CPU default: 4 GiB)
KV_KINDS = ("slots", "paged")
DECODERS = ("eager", "graphs", "compiled", "pieces", "fused")
COMPILE_MODES = ("default", "max-autotune")
PROPOSERS = ("ngram", "draft")


def cache_dir() -> Path:
    """Where tinyllm keeps what it fetches and builds (models, step 09; the C kernels, step
    13): $TINYLLM_CACHE, else ~/.cache/tinyllm."""
    return Path(os.environ.get("TINYLLM_CACHE") or Path.home() / ".cache" / "tinyllm")


@dataclass(frozen=True)
class EngineConfig:
    """A continuous engine's settings, checked when made.

    The KV budget (kv_mib) bounds the defaults: a slot cache's max_len (n_slots slots of
    max_len positions each) and the paged pool (the memory of n_slots such slots); settings
    given explicitly that need more than the budget are refused. Size it to the work: max_len
    as long as the longest request.
    """
    n_slots: int                            # requests decoded together, one slot each
    max_len: int | None = None              # positions a request may use (None: the model's)
    temperature: float = 0.0                # the default sampling; a request's own overrides it
    top_k: int | None = None
    top_p: float | None = None
    kv: str = "slots"                       # the KV cache: "slots" (04) or "paged" (05)
    block_size: int = 16                    # positions per block of the paged pool (05)
    kv_blocks: int | None = None            # the paged pool (None: the slots' memory)
    kv_headroom: bool = True                # the pool admits a newcomer only with a block left
                                            # for every running request to grow into (05)
    decoder: str = "eager"                  # decode step: eager, graphs, compiled (06), pieces
                                            # or fused (13)
    compile_mode: str = "default"           # the compiled step's torch.compile mode (06)
    buckets: tuple[int, ...] | None = None  # the bucketed decoders' windows (None: powers of two)
    max_step_tokens: int | None = None      # tokens computed per step at most (07; None: no budget)
    prefix_cache: bool = False              # share the blocks of common prefixes (08, kv="paged")
    kv_mib: float | None = None             # the KV cache's memory, MiB (None: DEFAULT_KV_MIB)
    speculate: str | None = None            # the proposer (11): "ngram", "draft", None (none)
    spec_tokens: int = 4                    # guesses per request per step at most (11)
    draft_layers: int | None = None         # a draft of the target's first layers (None: half)
    prompt_lookup_max: int = 4              # the n-gram proposer's longest and shortest n (11)
    prompt_lookup_min: int = 1
    tensor_parallel_size: int = 1           # ranks the model is split over (14; 1: not split)

    def __post_init__(self):
        check_positive_int("n_slots", self.n_slots)
        for name in ("max_len", "kv_blocks"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_positive_int("block_size", self.block_size)
        for name, allowed in (("kv", KV_KINDS), ("decoder", DECODERS),
                              ("compile_mode", COMPILE_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, "
                                 f"got {getattr(self, name)!r}")
        if self.compile_mode != "default" and self.decoder != "compiled":
            raise ValueError(f"compile_mode is the compiled decoder's: use decoder='compiled' "
                             f"(got decoder={self.decoder!r})")
        self._check_buckets()
        if self.max_step_tokens is not None:
            check_positive_int("max_step_tokens", self.max_step_tokens)
            if self.max_step_tokens < self.n_slots:
                raise ValueError(f"max_step_tokens {self.max_step_tokens} is less than n_slots "
                                 f"{self.n_slots}: every running request decodes one token a step")
        for name in ("prefix_cache", "kv_headroom"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.kv_headroom and self.kv != "paged":
            raise ValueError("kv_headroom is the paged pool's admission: use kv='paged'")
        if self.prefix_cache and self.kv != "paged":
            raise ValueError("prefix_cache shares blocks of a paged cache: use kv='paged'")
        if self.kv_mib is not None and (isinstance(self.kv_mib, bool) or
                                        not isinstance(self.kv_mib, (int, float)) or
                                        not 0 < self.kv_mib < math.inf):
            raise ValueError(f"kv_mib must be a finite number of MiB > 0, got {self.kv_mib!r}")
        Sampling(self.temperature, self.top_k, self.top_p)     # checks the sampling
        check_speculation(self)
        check_parallel(self)

    def _check_buckets(self) -> None:
        if self.buckets is None:
            return
        if not isinstance(self.buckets, (tuple, list)) or not self.buckets:
            raise ValueError(f"buckets must be a non-empty tuple of window sizes, got "
                             f"{self.buckets!r}")
        for b in self.buckets:
            check_positive_int("each bucket", b)

    def changed(self, **settings) -> "EngineConfig":
        """This config with the given fields changed (checked anew), or itself when none is."""
        return replace(self, **settings) if settings else self

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p)

    def kv_sizes(self, model_max_len: int, bytes_per_token: int) -> tuple[int, int | None]:
        """(max_len, the paged pool's blocks or None) within the KV budget: the settings given,
        or the defaults cut to the budget. Raises naming what does not fit."""
        mib = DEFAULT_KV_MIB if self.kv_mib is None else self.kv_mib
        budget = int(mib * 2**20) // bytes_per_token            # positions the budget holds
        max_len = model_max_len if self.max_len is None else self.max_len
        if max_len > model_max_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {model_max_len}")
        if self.kv == "slots":
            if self.max_len is None:
                max_len = min(max_len, budget // self.n_slots)
            need = self.n_slots * max_len
            what = f"{self.n_slots} slots of {max(max_len, 1)} positions"
            n_blocks = None
        else:
            n_blocks = self.kv_blocks or min(self.n_slots * math.ceil(max_len / self.block_size),
                                             budget // self.block_size)
            need, what = n_blocks * self.block_size, f"{n_blocks} blocks of {self.block_size}"
        if max_len < 1 or (n_blocks is not None and n_blocks < 1) or need > budget:
            raise ValueError(f"the KV cache of {what} needs {need * bytes_per_token / 2**20:.1f} "
                             f"MiB, over kv_mib={mib:g} ({budget} positions of "
                             f"{bytes_per_token} bytes): raise kv_mib, or ask for fewer slots "
                             f"or a shorter max_len")
        return max_len, n_blocks

    # ---- the command line: one flag per field, of the field's name --------------------------
    @staticmethod
    def add_arguments(parser, n_slots: int = 16, kv: bool = True) -> None:
        """The engine's flags, shared by `bench` and `serve`: each sets the field of its name
        (--max-step-tokens sets max_step_tokens), and from_args reads them back. kv=False
        leaves out --kv, for a command whose engine names pick the cache (bench's paged)."""
        g = parser.add_argument_group("the engine (EngineConfig)")
        g.add_argument("--slots", dest="n_slots", type=int, default=n_slots, metavar="N",
                       help=f"requests decoded together (default: {n_slots})")
        add_kv_arguments(g, kv)
        g.add_argument("--max-step-tokens", type=int, default=None, metavar="N",
                       help="at most N tokens computed a step, prompts in chunks (step 07)")
        g.add_argument("--prefix-cache", action="store_true",
                       help="requests share the blocks of common prefixes (step 08, paged)")
        g.add_argument("--decoder", choices=DECODERS, default="eager",
                       help="the decode step: eager, CUDA graphs (their eager bucketed twin on "
                            "a CPU) or compiled by torch.compile (step 06), or each layer "
                            "compiled in pieces around attention, or each layer in one C call "
                            "on a CPU (step 13) (default: eager)")
        g.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                       help="the compiled step's mode: max-autotune generates GEMM kernels for "
                            "the step's batch, a faster step for a longer compilation "
                            "(default: default)")
        add_speculation_arguments(g)
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="split the model over N processes, one rank each (step 14: "
                            "torch.distributed's gloo; under torchrun, the ranks of its "
                            "machines) (default: 1)")

    @classmethod
    def from_args(cls, args, **changes) -> "EngineConfig":
        """The config of parsed flags (add_arguments'), with `changes` on top; raises
        ValueError naming a bad setting."""
        names = {f.name for f in fields(cls)}
        given = {k: v for k, v in vars(args).items() if k in names}
        return cls(**{**given, **changes})


def check_speculation(config: EngineConfig) -> None:
    """Raise ValueError naming a bad speculation setting (11)."""
    if config.speculate is not None and config.speculate not in PROPOSERS:
        raise ValueError(f"speculate must be one of {', '.join(map(repr, PROPOSERS))} or "
                         f"None, got {config.speculate!r}")
    for name in ("spec_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        check_positive_int(name, getattr(config, name))
    if config.draft_layers is not None:
        check_positive_int("draft_layers", config.draft_layers)
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError(f"prompt_lookup_min {config.prompt_lookup_min} is more than "
                         f"prompt_lookup_max {config.prompt_lookup_max}")
    if config.speculate is not None and config.decoder in ("graphs", "compiled"):
        raise ValueError(f"speculation verifies its guesses in a ragged eager pass: use "
                         f"decoder='eager', 'pieces' or 'fused' (got {config.decoder!r})")


def check_parallel(config: EngineConfig) -> None:
    """Raise ValueError naming a setting that a model split over ranks (14) cannot take: a
    decode step of its own (graphs, compiled, pieces, fused: each runs the whole model in one
    process) or a draft from the target's first layers (split too)."""
    check_positive_int("tensor_parallel_size", config.tensor_parallel_size)
    if config.tensor_parallel_size == 1:
        return
    if config.decoder != "eager":
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} splits the eager "
                         f"forward pass over ranks: use decoder='eager' (got "
                         f"{config.decoder!r}, whose step runs the whole model in one process)")
    if config.speculate == "draft":
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}: speculate='draft' "
                         f"drafts with the target's first layers, which are split over the "
                         f"ranks; use speculate='ngram' or None")


def add_kv_arguments(g, kv: bool = True) -> None:
    """The KV cache's flags (04, 05) in the engine's argument group; kv=False leaves out --kv."""
    if kv:
        g.add_argument("--kv", choices=KV_KINDS, default="slots",
                       help="the KV cache: slots (step 04) or a paged pool (05) "
                            "(default: slots)")
    g.add_argument("--block-size", type=int, default=16, metavar="N",
                   help="positions per block of the paged pool (default: 16)")
    g.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="the paged pool's blocks (default: the memory of the slots)")
    g.add_argument("--no-kv-headroom", dest="kv_headroom", action="store_false",
                   help="the paged pool admits newcomers while their blocks are free, "
                        "keeping none for the running requests to grow into (step 05)")
    g.add_argument("--kv-mib", type=float, default=None, metavar="MIB",
                   help=f"the KV cache's memory budget (default: {DEFAULT_KV_MIB}); it bounds "
                        f"the positions a request may use on slots")


def add_speculation_arguments(g) -> None:
    """The flags of speculative decoding (11), in the engine's argument group."""
    g.add_argument("--speculate", choices=PROPOSERS, default=None,
                   help="speculative decoding (step 11): guesses by prompt lookup (ngram) "
                        "or by a draft model (draft: the target's first layers)")
    g.add_argument("--spec-tokens", type=int, default=4, metavar="K",
                   help="guesses per request per step at most: a request makes as many as "
                        "its recent guesses show pay (default: 4)")
    g.add_argument("--draft-layers", type=int, default=None, metavar="N",
                   help="the draft is the target's first N layers (default: half of them)")
    g.add_argument("--draft", default=None, metavar="MODEL",
                   help="a draft checkpoint of its own, with the target's tokenizer (a "
                        "directory, a GGUF file or a known name, as --model takes)")
    g.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N",
                   help="the ngram proposer's longest n (default: 4)")
    g.add_argument("--prompt-lookup-min", type=int, default=1, metavar="N",
                   help="the ngram proposer's shortest n (default: 1)")
