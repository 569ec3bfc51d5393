"""Steps 04-05 - the scheduler: who waits, who runs, who enters a slot, who is preempted.

The continuous engine's scheduler holds every unfinished request as a `Sequence`, waiting (in
arrival order) or running (in a slot of the cache). Each step it first reserves room for every
running sequence's next token, oldest first; when the cache has none (a paged pool, 05, runs
dry), it preempts the youngest running sequence: its slot and memory go back, and it waits again
in arrival order, to be recomputed from its prompt and the tokens it has made. Then it admits
waiting sequences into free slots, first come first served (04). It asks the cache questions
(`can_admit`, `reserve`) and never asks which kind of cache it holds.

Seams: `choose_admissions` (exercise 04) and `choose_victim` (exercise 05).
"""

from collections import deque

from tinyllm.requests import Sequence
from tinyllm.slot_cache import SlotCache


def choose_admissions(queue: list, n_free: int, fits) -> list:
    """Which queued requests enter now: the longest prefix of the queue (first come, first
    served) with at most n_free requests for which fits(prefix) holds. fits(requests) says
    whether the cache has room for all of these requests together."""
    chosen = []
    for req in queue:
        if len(chosen) == n_free or not fits(chosen + [req]):
            break
        chosen.append(req)
    return chosen


def choose_victim(running: dict[int, int]) -> int:
    """Which slot gives up its memory when the pool is dry. running maps each running slot to
    its request's arrival number (lower = arrived earlier). The youngest request is preempted:
    it has made the least progress, and the oldest ones keep going, so the run always ends."""
    return max(running, key=running.get)


class Scheduler:
    """The waiting queue and the running sequences (by slot) of one SlotCache."""

    def __init__(self, cache: SlotCache):
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}          # slot -> the sequence it holds

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def in_slot_order(self) -> list[Sequence]:
        """The running sequences by slot: the rows of a decode step."""
        return [self.running[s] for s in sorted(self.running)]

    # ---- 1) reserve -------------------------------------------------------------------------
    def reserve(self) -> list[Sequence]:
        """Room for every running sequence's next token, oldest first, preempting the youngest
        while the cache has none. Returns the preempted sequences, now waiting again."""
        preempted = []
        for seq in sorted(self.running.values(), key=lambda s: s.rid):
            while seq.slot is not None and not self.cache.reserve(seq.slot, 1):
                slot = choose_victim({s: q.rid for s, q in self.running.items()})
                victim = self.running[slot]
                self._leave_slot(victim)
                preempted.append(victim)
        if preempted:                                   # the queue stays in arrival order
            self.waiting = deque(sorted([*preempted, *self.waiting], key=lambda s: s.rid))
        return preempted

    # ---- 2) admit ---------------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Waiting sequences that enter free slots now, each given a slot and memory for its
        context: the engine prefills them next."""
        free = self.cache.free_slots()
        if not (free and self.waiting):
            return []
        fits = lambda seqs: self.cache.can_admit([s.context_len() for s in seqs])
        chosen = choose_admissions(list(self.waiting), len(free), fits)
        for seq, slot in zip(chosen, free):
            self.waiting.remove(seq)
            self.cache.admit(slot, seq.context_len())
            seq.slot = slot
            self.running[slot] = seq
        return chosen

    # ---- 4) retire --------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """seq is done, or aborted: its slot and memory are free at once."""
        if seq.slot is not None:
            self._leave_slot(seq)
        else:
            self.waiting.remove(seq)

    def _leave_slot(self, seq: Sequence) -> None:
        self.cache.release(seq.slot)
        del self.running[seq.slot]
        seq.slot = None
