"""Step 08 - prefix caching: requests that share a prefix share its blocks.

Chat requests repeat long prefixes: a system prompt, few-shot examples, the earlier turns of a
conversation. The keys and values of a prefix depend on its tokens alone, so a paged cache (05)
can keep the blocks that hold one and hand them to the next request that starts the same way,
which then prefills only the rest of its prompt.

A full block is named by a hash of its tokens *and of the block before it* (`block_hashes`):
block 3 of two prompts holds the same keys only if blocks 0-2 match too, since attention mixed
them in. A new request looks its blocks up in order and takes the longest run found
(`match_prefix`), always leaving at least one token to compute, so that the step has logits
to sample its first token from.

`PrefixCache` keeps the pool's books once blocks are shared: a reference count per block (how
many block tables hold it), the hash of each full block, and the blocks nobody holds but that
still hold a prefix. Those stay cached until the pool needs them, and then the least recently
used goes first. Only full blocks, whose every position has been written, are ever named, so a
block is never shared while it is still being written, and no shared block is written again:
copy-on-write is not needed.

Seams: `block_hashes` and `match_prefix` (exercise 08).
"""

import hashlib
from array import array
from collections import OrderedDict


def block_hashes(tokens: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """One hash per *full* block of tokens (a last partial block gets none): block i's is the
    sha256 digest of the previous block's hash (parent for block 0) followed by its own
    block_size tokens, so equal hashes mean equal prefixes, not only equal blocks.
    (The bytes of a block's tokens: array("q", block).tobytes(); the digest:
    hashlib.sha256(previous + those bytes).digest().)"""
    hashes = []
    for i in range(len(tokens) // block_size):
        block = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


def match_prefix(context: list[int], block_size: int, cached: dict[bytes, int]) -> list[int]:
    """The cached blocks that hold context's longest cached prefix, in order: the blocks of
    its leading full blocks whose hashes (prefix_cache.block_hashes) are all in cached
    (hash -> block), stopping at the first miss. The last token of the context is never
    covered: a request must compute at least one token to have logits to sample from."""
    blocks = []
    for h in block_hashes(context[:-1], block_size):
        if h not in cached:
            break
        blocks.append(cached[h])
    return blocks


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
        """n blocks for one table (refs 1): free ones first, then the least recently used
        cached ones. None, and nothing taken, when fewer than n are free."""
        if n > self.n_free():
            return None
        blocks = self.allocator.allocate(min(n, self.allocator.n_free()))
        while len(blocks) < n:
            b, _ = self.evictable.popitem(last=False)   # least recently used
            del self.cached[self.hash_of.pop(b)]
            blocks.append(b)
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more table holds these cached blocks."""
        for b in blocks:
            self.refs[b] += 1
            self.evictable.pop(b, None)

    def free(self, blocks: list[int]) -> None:
        """A table lets go of blocks: a block nobody holds goes back to the allocator, or,
        if it holds a prefix, waits among the evictable as the most recently used. The last
        block goes first, so a prefix is evicted from its end: its first blocks, which more
        requests share, stay longest (a block is only found after its parents)."""
        for b in blocks:
            if self.refs[b] < 1:
                raise ValueError(f"block {b} is not held by any table")
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                else:
                    self.allocator.free([b])

    def register(self, block: int, h: bytes) -> None:
        """block is full and holds the prefix named h. If another block already holds it,
        this one stays unnamed (both hold the same keys; the first keeps serving)."""
        if h not in self.cached:
            self.cached[h], self.hash_of[block] = block, h
