"""Prefix caching: full KV blocks found again by their content, shared between requests, evicted by the pool.

A full block (block_size tokens) is named by a chained SHA-256: block 0 hashes a namespace, the request's cache
salt and its adapter's content digest before its tokens; block i hashes block i-1's hash and its own tokens. So
the same tokens under another salt (another tenant) or another adapter (or another version of one) never name
the same block, and a block's hash covers every token before it. A hit is confirmed by comparing the stored
tokens, so even a hash collision cannot serve wrong KV.

The cache holds one reference to each page it knows. While requests use the page it is theirs as well; when the
last of them lets go, only the cache's reference is left and the page joins the pool's one eviction list (least
recently used first, beside idle adapters). An allocation that runs short evicts it: the cache forgets the hash
and drops its reference, which frees the page. A request that hits takes a reference, which takes the page off
the eviction list again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial

import numpy as np

from loraplex.engine.memory.page_pool import PageId, PagePool
from loraplex.engine.memory.sequence import KVSequence

_NAMESPACE = b"loraplex-prefix-v1"


def _field(value: str | None) -> bytes:
    """A length-prefixed field, so (salt, digest) pairs can never run into each other."""
    data = b"" if value is None else value.encode()
    return len(data).to_bytes(4, "little") + data + (b"\x01" if value is not None else b"\x00")


def first_block_seed(cache_salt: str | None, adapter_digest: str | None) -> bytes:
    """What block 0's hash starts from: the namespace, the salt and the adapter's digest."""
    return hashlib.sha256(_NAMESPACE + _field(cache_salt) + _field(adapter_digest)).digest()


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


def chain_hashes(
    token_ids: list[int], cache_salt: str | None, adapter_digest: str | None, block_size: int, num_blocks: int
) -> list[bytes]:
    """The hashes of the first `num_blocks` full blocks of `token_ids` (what `PrefixCache.hashes` keeps for a
    sequence of these tokens, salt and adapter)."""
    hashes: list[bytes] = []
    parent = first_block_seed(cache_salt, adapter_digest)
    for index in range(num_blocks):
        parent = block_hash(parent, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class _Entry:
    page: PageId
    tokens: tuple[int, ...]


@dataclass(slots=True)
class PrefixCacheStats:
    """Prompt tokens looked up and found, over the engine's life (first admissions only)."""

    queried_tokens: int = 0
    hit_tokens: int = 0


class PrefixCache:
    def __init__(self, pool: PagePool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._entries: dict[bytes, _Entry] = {}
        self._hash_of_page: dict[PageId, bytes] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    def hashes(self, seq: KVSequence, num_blocks: int) -> list[bytes]:
        """The hashes of the sequence's first `num_blocks` full blocks, computed once and kept in its blocks."""
        done = seq.blocks.block_hashes
        if len(done) < num_blocks:
            parent = done[-1] if done else first_block_seed(seq.cache_salt, seq.adapter_digest)
            size = self.block_size
            for index in range(len(done), num_blocks):
                parent = block_hash(parent, seq.tokens(index * size, (index + 1) * size))
                done.append(parent)
        return done  # at least num_blocks long; callers read only the first num_blocks

    def find(self, seq: KVSequence) -> list[PageId]:
        """The longest run of cached blocks that starts the sequence's tokens (nothing taken: see `take`).

        At least one token is always left to compute (its logits give the next token), so a prompt of exactly
        whole blocks reuses all but its last block.
        """
        num_blocks = (seq.num_tokens - 1) // self.block_size
        pages: list[PageId] = []
        size = self.block_size
        hashes = self.hashes(seq, num_blocks)
        for index in range(num_blocks):
            digest = hashes[index]
            entry = self._entries.get(digest)
            if entry is None or entry.tokens != tuple(seq.tokens(index * size, (index + 1) * size)):
                break
            pages.append(entry.page)
        return pages

    def lookup(self, hashes: list[bytes]) -> list[tuple[PageId, tuple[int, ...]]]:
        """The cached blocks of the longest leading run of `hashes`, with their tokens (nothing taken)."""
        found: list[tuple[PageId, tuple[int, ...]]] = []
        for digest in hashes:
            entry = self._entries.get(digest)
            if entry is None:
                break
            found.append((entry.page, entry.tokens))
        return found

    def adopt(self, digest: bytes, tokens: tuple[int, ...], page: PageId) -> bool:
        """Cache a block whose K/V were written into `page` from elsewhere (another engine computed them): the page's
        one reference becomes the cache's, and it is evictable at once. False (nothing kept: the caller frees the
        page) when a block of that hash is cached already."""
        if digest in self._entries or page in self._hash_of_page:
            return False
        self._entries[digest] = _Entry(page, tokens)
        self._hash_of_page[page] = digest
        self.released([page])
        return True

    def take(self, pages: list[PageId]) -> None:
        """A reference to each of `pages` (what `find` returned), which takes them off the eviction list."""
        for page in pages:
            if self.pool.ref_cnt(page) == 1:  # only the cache held it: it was waiting for eviction
                self.pool.unmark_evictable(("kv", page))
            self.pool.incref(page)

    def insert(self, seq: KVSequence) -> None:
        """Remember the sequence's full blocks whose K/V are computed, from the first one not offered yet (a step
        completes at most a few blocks; the ones before were offered in earlier steps)."""
        size = self.block_size
        blocks = seq.blocks
        num_full = min(seq.num_computed_tokens // size, len(blocks.block_ids))
        if num_full <= blocks.num_offered_blocks:
            return
        hashes = self.hashes(seq, num_full)
        for index in range(blocks.num_offered_blocks, num_full):
            digest = hashes[index]
            if digest in self._entries:
                continue  # already cached, from this sequence (a hit) or another one that computed it first
            page = blocks.block_ids[index]
            if page in self._hash_of_page:
                continue  # this page is cached under another hash: never reuse a page for two contents
            self._entries[digest] = _Entry(page, tuple(seq.tokens(index * size, (index + 1) * size)))
            self._hash_of_page[page] = digest
            self.pool.incref(page)
        blocks.num_offered_blocks = num_full

    def released(self, pages: list[PageId]) -> None:
        """After requests dropped `pages`: those only the cache still holds may be evicted from now on.

        Called with a request's blocks in reverse order, so a sequence's tail is evicted before its head (the head
        is what other requests share).
        """
        for page in pages:
            if page in self._hash_of_page and self.pool.ref_cnt(page) == 1:
                self.pool.mark_evictable(("kv", page), 1, partial(self._evict, page))

    def _evict(self, page: PageId) -> None:
        digest = self._hash_of_page.pop(page)
        del self._entries[digest]
        self.pool.release([page])

    def clear(self) -> int:
        """Forget every block no request uses; returns how many were dropped."""
        idle = [page for page in self._hash_of_page if self.pool.ref_cnt(page) == 1]
        for page in idle:
            self.pool.unmark_evictable(("kv", page))
            self._evict(page)
        return len(idle)
