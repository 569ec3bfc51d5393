"""Steps 04-05 - the scheduler: who waits, who runs, who enters a slot, who is preempted.

The scheduler holds every unfinished request as a `Sequence`, waiting (in arrival order) or
running (in a slot of the cache), and plans each step (`schedule`, a parts.StepPlan). It first
reserves room for every running sequence's next token, oldest first; when a paged pool (05)
runs dry it preempts the youngest, which waits again to be recomputed (`reserve_or_preempt`).
Then it moves waiting sequences into free slots, first come first served (`admit_waiting`); a
sequence that finishes or is aborted leaves its slot at once (`leave_slot`). Last its planner
plans the rows: a token for each decoding sequence, and the others' contexts whole
(`WholeContexts`) or in chunks within a budget (07). It asks the cache questions (`can_admit`,
`reserve`) and hands it each newcomer's context, so a prefix cache (08) starts the newcomer
with what it holds; it never asks which kind of cache it holds.
Seams: `admit_waiting` and `leave_slot` (exercise 04), `reserve_or_preempt` (exercise 05).
"""

from collections import deque
from collections.abc import Callable

from tinyllm.core.parts import CacheBooks, Planner, StepPlan
from tinyllm.core.requests import Sequence


def admit_waiting(waiting: deque, running: dict, cache: CacheBooks) -> list[Sequence]:
    """Waiting sequences enter the cache's free slots, first come first served; returns them
    in the order they entered.

    A sequence enters when there is a free slot and the cache has room for its whole context
    (seq.context_len() tokens: its prompt, and after a preemption the tokens it had made,
    which it computes again), less what a prefix cache (08) holds of it already: ask
    cache.can_admit([n], [key]) and admit with cache.admit(slot, n, key), passing
    key = seq.prefix_key() both times (its context, seq.context(); None where a prefix cache
    must not serve it). The first that cannot enter stops admission: nobody overtakes it.
    Afterwards each admitted sequence has left `waiting`, holds a slot (seq.slot, and
    running[seq.slot] is seq), and the cache has admitted it there, with memory for its
    context. Any free slot will do.
    Example: three free slots, 3 free blocks of 4, waiting r0 (5 tokens, 2 blocks with its next
    token), r1 (9 tokens, 3 blocks), r2 (2 tokens): r0 enters; r1 does not fit, so r1 and r2
    wait, in that order. Were r1's first 8 tokens cached in 2 blocks a running request holds,
    r1 would need 1 fresh block: it enters too (cache.lens[r1.slot] is 8), and r2 waits."""
    admitted = []
    for slot in cache.free_slots():
        if not waiting:
            break
        seq = waiting[0]
        n, key = seq.context_len(), seq.prefix_key()
        if not cache.can_admit([n], [key]):
            break
        cache.admit(slot, n, key)
        waiting.popleft()
        seq.slot, running[slot] = slot, seq
        admitted.append(seq)
    return admitted


def leave_slot(seq: Sequence, running: dict, cache: CacheBooks) -> None:
    """seq gives its slot back (it finished, was aborted or is preempted). Afterwards the cache
    has released the slot and its memory, running no longer holds it, and seq.slot is None, so
    the next step may admit a waiting sequence there.
    Example: r1 leaves slot 1 of a cache whose slots 0 and 1 were busy: cache.free_slots() is
    then [1], running has no slot 1, and r1.slot is None."""
    cache.release(seq.slot)
    del running[seq.slot]
    seq.slot = None


def reserve_or_preempt(running: dict, waiting: deque, cache: CacheBooks) -> list[Sequence]:
    """Room for every running sequence's next token, oldest first (lowest rid). While the cache
    has none for a sequence (cache.reserve(seq.slot, 1) is False), the youngest running
    sequence (highest rid; it may be this very one) is preempted: it leaves its slot
    (leave_slot) and waits again. The waiting queue stays in arrival order (by rid), so a
    preempted sequence goes back ahead of those that arrived after it. Returns the preempted,
    in the order they were preempted.
    Example: running r0, r3, r5, waiting r6, and a pool with room for one more token: r0 gets
    it; for r3 there is none, so r5 is preempted (its blocks come back), and r3 gets one of
    them. Returns [r5]; waiting is then r5, r6."""
    preempted = []
    for seq in sorted(running.values(), key=lambda s: s.rid):
        while seq.slot is not None and not cache.reserve(seq.slot, 1):
            victim = max(running.values(), key=lambda s: s.rid)
            leave_slot(victim, running, cache)
            preempted.append(victim)
    if preempted:
        queue = sorted([*preempted, *waiting], key=lambda s: s.rid)
        waiting.clear()
        waiting.extend(queue)
    return preempted


def check_plan(decoding: list[Sequence], decodes: list[Sequence],
               chunks: list[tuple[Sequence, int]], max_step_tokens: int | None,
               running: dict) -> None:
    """Raise ValueError naming what a step's plan gets wrong: a decode left out or added, a
    sequence twice, a chunk of no token or of more than is left, a plan over the budget; with
    no budget, a sequence that does not compute all it has left (a prefix cache names a
    newcomer's blocks as it is admitted, for the step's one forward pass to write)."""
    if sorted(s.rid for s in decodes) != sorted(s.rid for s in decoding):
        raise ValueError(f"plan_step's decodes are requests {[s.rid for s in decodes]}; the "
                         f"decoding sequences (one token left) are {[s.rid for s in decoding]}, "
                         f"and none is ever left out")
    seen = [s.rid for s in decodes] + [s.rid for s, _ in chunks]
    if len(set(seen)) != len(seen) or any(running.get(s.slot) is not s for s, _ in chunks):
        raise ValueError(f"plan_step planned requests {seen}: each running request at most "
                         f"once, and only requests in a slot")
    for seq, n in chunks:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= seq.left():
            raise ValueError(f"plan_step gave request {seq.rid} a chunk of {n!r} tokens; it has "
                             f"{seq.left()} left, and a chunk holds 1 to that many")
        if max_step_tokens is None and n != seq.left():
            raise ValueError(f"plan_step gave request {seq.rid} a chunk of {n} tokens with no "
                             f"budget; it has {seq.left()} left, and with no budget each "
                             f"sequence computes all it has left")
    unplanned = [s.rid for s in running.values() if s.rid not in seen]
    if max_step_tokens is None and unplanned:
        raise ValueError(f"plan_step left requests {unplanned} out with no budget: then every "
                         f"request in a slot computes all it has left, newcomers too")
    total = len(decodes) + sum(n for _, n in chunks)
    if max_step_tokens is not None and total > max_step_tokens:
        raise ValueError(f"plan_step planned {total} tokens ({len(decodes)} decodes and chunks "
                         f"{[n for _, n in chunks]}), over the step's budget of {max_step_tokens}")


class WholeContexts:
    """The step's plan without a budget: every decoding sequence's token, then the contexts of
    the others, newcomers admitted, each computed whole (its chunk: all it has left)."""

    max_step_tokens: int | None = None                  # no budget: every context at once

    def plan(self, running: list[Sequence], admit: Callable[[], list[Sequence]]
             ) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """(decodes, chunks) of the sequences in slots (slot order) and those admit() brings."""
        prefilling = [s for s in running if s.left() > 1] + admit()
        chunks = [(s, s.left()) for s in sorted(prefilling, key=lambda s: s.rid)]
        return [s for s in running if s.left() == 1], chunks

    def next_chunk(self, seq: Sequence, n: int) -> tuple[list[int], bool]:
        """The n tokens seq computes next (from seq.num_computed_tokens on), and whether they
        end its context (only then do their last logits give its next token)."""
        start, context = seq.num_computed_tokens, seq.context()
        return context[start:start + n], start + n == len(context)


def chunk_tokens(planner: Planner, chunks: list[tuple[Sequence, int]]
                 ) -> list[tuple[Sequence, list[int], bool]]:
    """Each chunk as (sequence, the tokens it computes, whether they end its context), as the
    planner says (next_chunk); a chunk of the wrong length is named."""
    out = []
    for seq, n in chunks:
        tokens, ends = planner.next_chunk(seq, n)
        if len(tokens) != n:
            raise ValueError(f"next_chunk gave {len(tokens)} token{'s' * (len(tokens) != 1)} "
                             f"for request {seq.rid}'s chunk of {n}")
        out.append((seq, tokens, ends))
    return out


class Scheduler:
    """The waiting queue and the running sequences (by slot) of one cache, and the planner of
    its steps (WholeContexts, or step 07's token budget). `schedule` plans the next step."""

    def __init__(self, cache: CacheBooks, planner: Planner | None = None):
        self.cache = cache
        self.planner: Planner = planner or WholeContexts()
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}          # slot -> the sequence it holds
        self.held: dict[int, list[Sequence]] = {}       # a first choice's rid -> the others (n > 1)

    def add(self, seq: Sequence, after: Sequence | None = None) -> None:
        """Queue seq in arrival order (by rid). With `after` (the first choice of seq's
        request), hold it until after's prompt is computed (release): a prefix cache then
        serves seq the prompt's blocks, so the prompt is computed once for all n choices."""
        if after is not None:
            self.held.setdefault(after.rid, []).append(seq)
        elif not self.waiting or self.waiting[-1].rid < seq.rid:
            self.waiting.append(seq)
        else:
            queue = sorted([*self.waiting, seq], key=lambda s: s.rid)
            self.waiting.clear()
            self.waiting.extend(queue)

    def release(self, first: Sequence) -> None:
        """The choices held for first (its prompt is computed, or it left) queue now."""
        for seq in self.held.pop(first.rid, []):
            self.add(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def in_slot_order(self) -> list[Sequence]:
        """The running sequences by slot: the rows of a decode step."""
        return [self.running[s] for s in sorted(self.running)]

    def schedule(self) -> StepPlan:
        """The next step: room for every running sequence's next token (reserve, preempting
        while there is none), the newcomers admitted and the step's rows planned (plan), each
        chunk's tokens (next_chunk)."""
        preempted = self.reserve()
        decodes, chunks = self.plan()
        budget, left = self.planner.max_step_tokens, None
        if budget is not None:
            left = budget - len(decodes) - sum(n for _, n in chunks)
        return StepPlan(decodes, chunk_tokens(self.planner, chunks), left, preempted)

    # ---- reserve ----------------------------------------------------------------------------
    def reserve(self) -> list[Sequence]:
        """Room for every running sequence's next token, preempting while there is none.
        Returns the preempted sequences, now waiting again."""
        return reserve_or_preempt(self.running, self.waiting, self.cache)

    # ---- admit, and plan the step -----------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Waiting sequences that enter free slots now, each given a slot and memory for its
        context, and what the cache already holds of it (seq.num_computed_tokens, the slot's
        length after admission: a prefix cache's blocks, 08): the engine computes the rest."""
        admitted = admit_waiting(self.waiting, self.running, self.cache)
        for seq in admitted:                            # an admission that is not one is named
            if seq.slot is None or self.running.get(seq.slot) is not seq \
                    or not self.cache.active[seq.slot]:
                raise ValueError(f"admit_waiting returned request {seq.rid} with slot "
                                 f"{seq.slot!r}: an admitted request holds the slot the cache "
                                 f"admitted it to (seq.slot), and running[seq.slot] is it")
            if any(w is seq for w in self.waiting):
                raise ValueError(f"admit_waiting returned request {seq.rid}, which still waits: "
                                 f"an admitted request leaves the queue")
            if self.cache.capacity(seq.slot) <= seq.context_len():
                raise ValueError(f"admit_waiting admitted request {seq.rid} with room for "
                                 f"{self.cache.capacity(seq.slot)} tokens; its context holds "
                                 f"{seq.context_len()} (seq.context_len(): the prompt, and after "
                                 f"a preemption the tokens it had made) and its next token needs "
                                 f"one more")
        for seq in admitted:
            seq.num_computed_tokens = self.cache.lens[seq.slot]
            seq.num_cached_tokens += seq.num_computed_tokens
            seq.num_prefilled_tokens += seq.left()
        return admitted

    def plan(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """This step's work, as the planner plans it: a token for every decoding sequence, then
        the contexts being computed, newcomers admitted (within the planner's budget, if it
        has one). Returns the decodes and the chunks (sequence, tokens it computes); a plan
        that breaks the rules, or computes nothing while requests wait, is named."""
        running = self.in_slot_order()
        decoding = [s for s in running if s.left() == 1]
        decodes, chunks = self.planner.plan(running, self.admit)
        check_plan(decoding, decodes, chunks, self.planner.max_step_tokens, self.running)
        if not decodes and not chunks:                  # unreachable with the reference seams
            raise RuntimeError(
                f"a step with nothing to compute: {len(self.waiting)} requests wait, the running "
                f"ones have {[s.left() for s in running]} tokens left, and the cache's free "
                f"slots are {self.cache.free_slots()} of {self.cache.n_slots} (a finished "
                f"request that never released its slot, or a plan that gave no tokens?)")
        return decodes, chunks

    # ---- retire ----------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """seq is done, or aborted: its slot and memory are free at once, and the choices held
        for it queue."""
        if seq.slot is not None:
            leave_slot(seq, self.running, self.cache)
        elif any(w is seq for w in self.waiting):
            self.waiting.remove(seq)
        else:                                           # a choice still held
            for held in self.held.values():
                if seq in held:
                    held.remove(seq)
        self.release(seq)
