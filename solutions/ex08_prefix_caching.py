"""Exercise 08 - prefix caching: naming blocks by their prefix, matching a prompt's blocks, and
the reference counts and eviction that let requests share blocks.

Five seams of the reference package, all in `tinyllm.core.prefix_cache`:
- `block_hashes` names each full block of a token list by its prefix (its own tokens and all
  before them), so that equal names mean equal prefixes;
- `match_prefix` finds the cached blocks a new request can share: those of its context's
  longest cached prefix, leaving at least its last token to compute;
- `take_blocks`, `share_blocks` and `release_blocks` keep the pool's books once blocks are
  shared: how many block tables hold each block, and which blocks nobody holds but still hold
  a prefix (evictable, the least recently released first).

The paged cache calls them: it names every block that fills up (`cache_blocks`), looks a
newcomer's context up as it admits it (`admit(slot, n_tokens, context)`: the matched blocks
first, fresh blocks only for the rest), and takes and gives back blocks through its
`PrefixCache`, whose fields your functions read and write: `refs` (a count per block),
`cached` (name -> block), `hash_of` (block -> name), `evictable` (an OrderedDict of blocks,
the least recently released first), `allocator` (the pool's free list: `allocate(n)`,
`free(blocks)`, `n_free()`) and `n_free()` (free and evictable blocks).

Check your work with `make check EX=08` (or `check_exercise("08")` in notebook 08). The tests
plug your functions into the engine of `tinyllm.build.make_engine(kv="paged",
prefix_cache=True)`, under pools small enough to evict and preempt, and compare every request's
tokens with solo generate().
"""

import hashlib
from array import array

from tinyllm.core.prefix_cache import PrefixCache


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
