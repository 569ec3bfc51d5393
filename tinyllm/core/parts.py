"""Step 04 - the engine's parts: every plug point of ContinuousEngine, in one file.

The engine is made of parts and never asks which kind it holds. Step 04 gives each part its
simplest kind; a later step brings another kind through the same interface, and
`tinyllm.build.make_engine` makes the parts an EngineConfig asks for:

    part         step 04's kind                       later kinds
    cache        SlotKVCache (slot_cache.py)          PagedKVCache (05), its PrefixCache (08)
    decode step  ModelStep: the model itself          graphs, compiled (06); pieces, fused (13)
    planner      WholeContexts (scheduler.py)         TokenBudget (07)
    runner       ModelRunner (model_runner.py)        SpeculatingRunner (11) around it
    grammars     none                                 LLGuidance (12)

A step passes two records between them: the scheduler's `StepPlan` and the runner's
`StepOutput`.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from tinyllm.core.requests import Sequence


@dataclass
class StepPlan:
    """One step's work, as the scheduler planned it: a token for each decoding sequence
    (`decodes`, slot order), then the context chunks (sequence, the tokens it computes now,
    whether they end its context: only then is a token sampled); the tokens the step's budget
    leaves (None: no budget); who was preempted to make room."""
    decodes: list[Sequence]
    chunks: list[tuple[Sequence, list[int], bool]]
    budget_left: int | None = None
    preempted: list[Sequence] = field(default_factory=list)


@dataclass
class StepOutput:
    """What a step's passes gave: each decode row's new tokens and their logprobs (one each,
    or a speculating step's kept run); the chunks that end their contexts (indices into
    plan.chunks), a token each; every chunk position's logits (C, T, V) when a prompt collects
    its logprobs, else None."""
    tokens: list[list[int]]
    logprobs: list[list]
    ended: list[int]
    ended_tokens: list[list[int]]
    ended_logprobs: list[list]
    every: Tensor | None = None


class CacheBooks(Protocol):
    """The engine's half of a cache (slot_cache.SlotCache): its slots and their memory."""
    n_slots: int
    max_len: int
    active: list[bool]
    lens: list[int]
    shares_prefixes: bool               # admitted contexts share blocks (08)

    def free_slots(self) -> list[int]: ...
    def live_slots(self) -> list[int]: ...
    def can_admit(self, lens: list[int], contexts: list | None = None) -> bool: ...
    def admit(self, slot: int, n_tokens: int, context: list[int] | None = None) -> None: ...
    def reserve(self, slot: int, n: int = 1) -> bool: ...
    def release(self, slot: int) -> None: ...
    def rollback(self, slot: int, n: int) -> None: ...
    def cache_blocks(self, slot: int, context: Callable[[], list[int]]) -> None: ...
    def never_fits(self, n_tokens: int) -> str | None: ...
    def capacity(self, slot: int) -> int: ...
    def used_tokens(self) -> int: ...
    def reserved_tokens(self) -> int: ...
    def allocated_tokens(self) -> int: ...
    def check_integrity(self, idle: bool = False) -> str | None: ...


class StepView(Protocol):
    """The model's half of a cache (slot_cache.RaggedStep): one planned ragged step, seen by
    the forward pass as kv_cache.Cache, packed where its rows differ in length."""
    packing: Any                        # a PackedStep (slot_cache.py), or None

    def plan_step(self, rows: list[int], q_lens: list[int]) -> None: ...
    def begin_step(self, T: int) -> Tensor: ...
    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        ...
    def end_step(self) -> None: ...


class EngineCache(CacheBooks, StepView, Protocol):
    """A cache the engine holds: both halves."""


class DecodeStep:
    """How a step's decode rows are computed: decoder(idx (B, 1), cache) -> (logits (B, 1,
    V), None), as the model computes them. The defaults are the model's own (ModelStep); a
    decoder that compiles says so (`compiles`, and compiles in `warm_up`); one that replays
    every slot (06's graphs) gets a pass of its own (`computes_every_slot`); one with a faster
    target pass for speculation (13's fused layers) offers `verify` for up to `verify_rows`; one
    that brings its own cache (06's bucketed decoders) holds it in `slots`; one that can compile
    while it serves (13's pieces: `compiles_later`) compiles a bucket at each `compile_next`,
    its steps eager meanwhile where `eager_until_compiled`."""
    compiles = False
    compiles_later = False
    eager_until_compiled = False
    computes_every_slot = False
    verify_rows: int | None = None
    slots: Any = None

    def __call__(self, idx: Tensor, cache: Any) -> tuple[Tensor, Any]:
        raise NotImplementedError

    def warm_up(self, *, progress: Callable[[int, float], None] | None = None) -> Any:
        """Compile ahead, every bucket (progress(bucket, seconds) hears each): nothing here."""

    def verify(self, idx: Tensor, q_lens: list[int], cache: Any) -> Tensor | None:
        """Speculation's target pass of idx (B, T) -> logits (B, T, V); None: the model's."""
        return None

    def compile_next(self) -> tuple[int, float] | None:
        """Compile the next bucket -> (bucket, seconds); None: none is left."""
        return None


class Planner(Protocol):
    """Which tokens a step computes: a token for each decoding sequence, then the contexts'
    chunks, within max_step_tokens (None: each context whole)."""
    max_step_tokens: int | None

    def plan(self, running: list[Sequence], admit: Callable[[], list[Sequence]]
             ) -> tuple[list[Sequence], list[tuple[Sequence, int]]]: ...
    def next_chunk(self, seq: Sequence, n: int) -> tuple[list[int], bool]: ...


class Runner(Protocol):
    """Computes a planned step: its forward passes and the tokens they sample; its decode step
    and the engine's Stats, which it keeps."""
    decode_step: DecodeStep
    stats: Any                          # stats.Stats

    def run(self, plan: StepPlan, generator: torch.Generator | None) -> StepOutput: ...
    def sync(self, running: dict[int, Sequence]) -> None:
        """The slots' holders changed (a step retired, a request left): follow them."""
        ...
    def check_integrity(self, idle: bool = False) -> str | None: ...


class Matcher(Protocol):
    """A constrained request's place in its grammar (12)."""

    def bitmask(self) -> Tensor: ...
    def consume(self, token: int) -> bool: ...
    def rollback(self, n: int) -> None: ...
    def is_error(self) -> bool: ...
    def error(self) -> str: ...


class Grammars(Protocol):
    """A grammar backend (12): a Matcher for each constrained request."""

    def matcher(self, constraint: Any) -> Matcher: ...
