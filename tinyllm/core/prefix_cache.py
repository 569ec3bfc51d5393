"""Step 08 - prefix caching: requests that share a prefix share its blocks.

Chat requests repeat long prefixes (a system prompt, the earlier turns). A prefix's keys and
values depend on its tokens alone, so a paged cache (05) keeps the blocks that hold one and
hands them to the next request that starts the same way, which prefills only the rest. A full
block is named by a hash of its tokens *and of the block before it* (`block_hashes`); a new
request takes the longest run of named blocks (`match_prefix`), leaving at least one token to
compute for its first token's logits.

`PrefixCache` keeps the pool's books once blocks are shared: a reference count per block, the
name of each full block, and the blocks nobody holds that still hold a prefix, evicted least
recently used first. A block is named only once written (or as its newcomer is admitted, when
the step's one pass writes it before any row reads), so no shared block is written again.
Seams (exercise 08): `block_hashes`, `match_prefix`, `take_blocks`, `share_blocks`,
`release_blocks`.
"""

import hashlib
from array import array
from collections import OrderedDict


def block_hashes(tokens: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The names of the full blocks of tokens, in order: a last partial block gets none.

    Block i's name stands for everything up to its end, parent's prefix and tokens[:(i + 1) *
    block_size]: two blocks get the same name exactly when they hold the same tokens after the
    same prefix. A name is the digest (bytes) of a cryptographic hash (hashlib), made from the
    name before it and the block's own tokens, so that different prefixes never share one.
    parent is the name of the block before tokens[0] (b"": tokens start a context), so that
    naming a context a few blocks at a time gives the names of naming it at once.
    Example, blocks of 2: [1, 2, 3, 4, 5] -> [n0, n1] (5 is in no full block); [9, 9, 3, 4] ->
    [m0, m1] with m0 != n0 and m1 != n1 ([3, 4] after [9, 9] is another prefix); and
    block_hashes([3, 4], 2, parent=n0) -> [n1]."""
    hashes = []
    for i in range(len(tokens) // block_size):
        block = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


def match_prefix(context: list[int], block_size: int, cached: dict[bytes, int]) -> list[int]:
    """The cached blocks that a new request's context can share, in order: the blocks of its
    longest prefix of full blocks whose names (prefix_cache.block_hashes) are all in cached
    (name -> block). A block counts only after all the blocks before it: its keys belong after
    theirs. The context's last token is never covered: the request must compute at least one
    token, whose logits give its next token.
    Example, blocks of 4, a context of 13 tokens whose blocks 0, 1, 2 are cached as 7, 3, 5:
    [7, 3, 5]; with block 1 not cached: [7]; the first 12 tokens alone: [7, 3] (block 2
    holds the last token)."""
    blocks = []
    for h in block_hashes(context[:-1], block_size):
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks


def take_blocks(pc: "PrefixCache", n: int) -> list[int] | None:
    """n blocks for one block table, each now held once (pc.refs[b] == 1): the allocator's
    free blocks first, then cached blocks that nobody holds (pc.evictable), the least recently
    released first; such a block's name leaves the cache (pc.cached and pc.hash_of), since its
    keys are about to be overwritten. With fewer than n to be had (pc.n_free()), None, and
    nothing changes.
    Example: 1 free block (4) and evictable blocks 2, then 6 (2 released first): take_blocks(pc,
    2) -> [4, 2]; block 2's name is gone, block 6 stays cached."""
    if n > pc.n_free():
        return None
    blocks = pc.allocator.allocate(min(n, pc.allocator.n_free()))
    while len(blocks) < n:
        b, _ = pc.evictable.popitem(last=False)         # the least recently released
        del pc.cached[pc.hash_of.pop(b)]
        blocks.append(b)
    for b in blocks:
        pc.refs[b] = 1
    return blocks


def share_blocks(pc: "PrefixCache", blocks: list[int]) -> None:
    """One more block table holds these cached blocks (a newcomer's matched prefix): each one's
    count grows by one, and a block that nobody held is no longer evictable (it is in use).
    Example: block 6, evictable with refs 0 -> refs 1, not evictable; block 3 with refs 2 ->
    refs 3."""
    for b in blocks:
        pc.refs[b] += 1
        pc.evictable.pop(b, None)


def release_blocks(pc: "PrefixCache", blocks: list[int]) -> None:
    """A block table lets go of its blocks (its request finished, was aborted or preempted):
    each one's count falls by one. A block nobody holds any more goes back: if it has a name
    (pc.hash_of), it stays cached and becomes evictable as the most recently released;
    otherwise the allocator takes it (pc.allocator.free). A table's blocks are released from
    its last to its first, so that a prefix is evicted from its end: its first blocks, which
    more requests share, stay longest. A block nobody holds raises ValueError naming it, and
    nothing changes.
    Example: a table [2, 6, 9] held once, 2 and 6 named, 9 not: 9 goes to the allocator, and
    pc.evictable ends [..., 6, 2] (6 is evicted before 2)."""
    for b in blocks:
        if pc.refs[b] < 1:
            raise ValueError(f"block {b} is not held by any table")
    for b in reversed(blocks):
        pc.refs[b] -= 1
        if pc.refs[b] == 0:
            if b in pc.hash_of:
                pc.evictable[b] = None
            else:
                pc.allocator.free([b])


class PrefixCache:
    """The pool's blocks with reference counts and the prefixes they hold.

    refs[b]: the block tables holding block b. cached: hash -> block of every full block with a
    known prefix; hash_of: the reverse. evictable: the blocks nobody holds that still hold a
    prefix, least recently used first; they count as free, and allocate() takes them only when
    the allocator's free list is empty, dropping their hashes.
    """

    def __init__(self, allocator, block_size: int):
        """allocator: the pool's BlockAllocator (paged_kv.py), which keeps the free list."""
        self.allocator, self.block_size = allocator, block_size
        self.refs = [0] * allocator.n_blocks
        self.cached: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def n_free(self) -> int:
        return self.allocator.n_free() + len(self.evictable)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks for one table (take_blocks)."""
        return take_blocks(self, n)

    def share(self, blocks: list[int]) -> None:
        """One more table holds these cached blocks (share_blocks)."""
        share_blocks(self, blocks)

    def free(self, blocks: list[int]) -> None:
        """A table lets go of these blocks (release_blocks)."""
        release_blocks(self, blocks)

    def register(self, block: int, h: bytes) -> None:
        """block is full and holds the prefix named h. If another block already holds it,
        this one stays unnamed (both hold the same keys; the first keeps serving)."""
        if h not in self.cached:
            self.cached[h], self.hash_of[block] = block, h

    def forget(self, blocks: list[int]) -> None:
        """These blocks no longer hold the prefixes they are named for: their names go (a
        block named at admission whose step raised before writing it, engine_core.step_alone)."""
        for b in blocks:
            if (h := self.hash_of.pop(b, None)) is not None:
                del self.cached[h]

    def match(self, context: list[int]) -> list[int]:
        """The cached blocks a newcomer's context shares (match_prefix), checked: ValueError
        names blocks that cover its last token or hold no cached prefix."""
        blocks = match_prefix(context, self.block_size, self.cached)
        m, n = len(blocks), len(context)
        if m * self.block_size >= n:
            raise ValueError(f"match_prefix gave {m} blocks ({m * self.block_size} tokens) for a "
                             f"context of {n} tokens: the last token must be left to compute, "
                             f"for the logits of the request's next token")
        unknown = [b for b in blocks if b not in self.hash_of]
        if unknown:
            raise ValueError(f"match_prefix gave blocks {unknown}, which hold no cached prefix: "
                             f"it returns blocks of `cached`, the values of its names")
        return blocks

    def name_blocks(self, table: list[int], names: list[bytes], context: list[int],
                    n_tokens: int) -> None:
        """The full blocks among a table's first n_tokens positions, which hold context's
        first n_tokens, are named: names (the table's, in order) grows by those not named yet
        (block_hashes, chained from the last name), and each is registered."""
        bs, done = self.block_size, len(names)
        full = n_tokens // bs
        if full > done:
            new = block_hashes(context[done * bs:full * bs], bs, names[-1] if names else b"")
            for b, h in zip(table[done:full], new):
                self.register(b, h)
            names += new

    def check_integrity(self, counts: list[int]) -> str | None:
        """None when the books of shared blocks agree with counts (counts[b]: the block tables
        holding block b), else what is wrong, in one sentence: refs[b] is counts[b]; an
        evictable block is held by nobody; the allocator's books hold (every block is exactly
        one of free, held, or evictable); an evictable block is named, a free one is not; and
        cached and hash_of hold the same pairs."""
        off = [b for b, n in enumerate(counts) if self.refs[b] != n]
        if off:
            b = off[0]
            return (f"block {b} has refs {self.refs[b]}, but {counts[b]} block tables hold it: "
                    f"a block's count is the number of tables holding it")
        held = [b for b in self.evictable if counts[b]]
        if held:
            return (f"blocks {held} are evictable, yet block tables hold them: a shared block "
                    f"leaves the eviction order (share_blocks)")
        why = self.allocator.check_integrity(counts, self.evictable)
        if why is not None:
            return why
        unnamed = [b for b in self.evictable if b not in self.hash_of]
        if unnamed:
            return (f"blocks {unnamed} are evictable but hold no named prefix: a block nobody "
                    f"holds without a name goes back to the allocator")
        named = [b for b in self.allocator.free_list if b in self.hash_of]
        if named:
            return (f"blocks {named} are free but still named: a block handed out again would "
                    f"serve its old prefix (a named block nobody holds stays evictable)")
        if len(self.cached) != len(self.hash_of) or \
                any(self.hash_of.get(b) != h for h, b in self.cached.items()):
            return ("cached (name -> block) and hash_of (block -> name) disagree: they hold "
                    "the same pairs, one each way")
        return None
