"""Exercise 08 - prefix caching: naming blocks by their prefix, and matching a prompt's blocks.

Two seams of the reference package, both in `tinyllm.prefix_cache`:
- `block_hashes` names each full block of a token list by a hash of its tokens and of the
  name of the block before it, so that equal names mean equal prefixes;
- `match_prefix` finds the cached blocks a new request can share: those of its context's
  longest cached prefix, leaving at least its last token to compute.

The paged cache calls them: it names every block that fills up (`cache_blocks`) and matches a
newcomer's context right after admission (`reuse_prefix`); `PrefixCache` counts the tables
holding each block and evicts the least recently used cached block when the pool runs dry.

Check your work with `make check EX=08` (or `check_exercise("08")` in notebook 08). The tests
plug your functions into `ContinuousEngine(kv="paged", prefix_cache=True)` and compare every
request's tokens with solo generate().
"""

import hashlib
from array import array

from tinyllm import prefix_cache


def block_hashes(tokens: list[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """One hash per *full* block of tokens (a last partial block gets none): block i's is the
    sha256 digest of the previous block's hash (parent for block 0) followed by its own
    block_size tokens, so equal hashes mean equal prefixes, not only equal blocks.
    (The bytes of a block's tokens: array("q", block).tobytes(); the digest:
    hashlib.sha256(previous + those bytes).digest().)"""
    raise NotImplementedError("exercise 08: a chained hash per full block")


def match_prefix(context: list[int], block_size: int, cached: dict[bytes, int]) -> list[int]:
    """The cached blocks that hold context's longest cached prefix, in order: the blocks of
    its leading full blocks whose hashes (prefix_cache.block_hashes) are all in cached
    (hash -> block), stopping at the first miss. The last token of the context is never
    covered: a request must compute at least one token to have logits to sample from."""
    raise NotImplementedError("exercise 08: the longest run of cached leading blocks, "
                              "never covering the last token")
