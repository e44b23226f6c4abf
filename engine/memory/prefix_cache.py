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

With sliding-window KV groups (kv_groups.py) a block has a page in every group. Each page is evicted on its own: a
full-attention group's page takes the whole entry with it (no hit can start past a block it lacks), a window group's
page only itself. A hit of m blocks then needs every full-attention page of blocks 0..m-1, and in each window group
only the pages of the blocks the next token's window still reads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial

import numpy as np

from loraplex.engine.memory.kv_groups import NO_PAGE, KVGroup, KVGroups
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
    pages: list[PageId | None]  # one per KV group; None: that window group's page was evicted
    tokens: tuple[int, ...]


@dataclass(slots=True)
class PrefixCacheStats:
    """Prompt tokens looked up and found, over the engine's life (first admissions only)."""

    queried_tokens: int = 0
    hit_tokens: int = 0


class PrefixCache:
    def __init__(self, pool: PagePool, block_size: int, *, groups: KVGroups | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.groups = (
            groups if groups is not None and groups.groups else KVGroups(len(pool.storage), (KVGroup((), None),))
        )
        self._windowed = [group.window is not None for group in self.groups.groups]
        self._entries: dict[bytes, _Entry] = {}
        self._hash_of_page: dict[PageId, tuple[bytes, int]] = {}  # page -> (its block's hash, its group)
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

    def _complete(self, entry: _Entry) -> bool:
        """Whether every full-attention page of the entry is there (window pages may be gone)."""
        return all(page is not None for page, windowed in zip(entry.pages, self._windowed, strict=True) if not windowed)

    def find(self, seq: KVSequence) -> list[list[PageId]]:
        """Per KV group, the pages of the longest run of cached blocks that starts the sequence's tokens and leaves
        each window group the blocks its next token reads (NO_PAGE for those it does not); nothing taken (`take`).

        At least one token is always left to compute (its logits give the next token), so a prompt of exactly
        whole blocks reuses all but its last block.
        """
        num_blocks = (seq.num_tokens - 1) // self.block_size
        entries: list[_Entry] = []
        size = self.block_size
        hashes = self.hashes(seq, num_blocks)
        for index in range(num_blocks):
            entry = self._entries.get(hashes[index])
            if entry is None or not self._complete(entry):
                break
            if entry.tokens != tuple(seq.tokens(index * size, (index + 1) * size)):
                break
            entries.append(entry)
        length = len(entries)
        while length and not self._windows_present(entries, length):
            length -= 1
        return self._tables(entries[:length])

    def _windows_present(self, entries: list[_Entry], length: int) -> bool:
        for g, windowed in enumerate(self._windowed):
            if windowed:
                first = self.groups.first_needed_block(g, length * self.block_size, self.block_size)
                if any(entries[index].pages[g] is None for index in range(first, length)):
                    return False
        return True

    def _tables(self, entries: list[_Entry]) -> list[list[PageId]]:
        length = len(entries)
        tables: list[list[PageId]] = []
        for g, windowed in enumerate(self._windowed):
            first = self.groups.first_needed_block(g, length * self.block_size, self.block_size) if windowed else 0
            table: list[PageId] = []
            for index, entry in enumerate(entries):
                page = entry.pages[g]
                table.append(page if index >= first and page is not None else PageId(NO_PAGE))
            tables.append(table)
        return tables

    def lookup(self, hashes: list[bytes]) -> list[tuple[list[PageId], tuple[int, ...]]]:
        """The cached blocks of the longest leading run of `hashes` whose pages are all there (every group), with
        their tokens (nothing taken)."""
        found: list[tuple[list[PageId], tuple[int, ...]]] = []
        for digest in hashes:
            entry = self._entries.get(digest)
            if entry is None or any(page is None for page in entry.pages):
                break
            found.append(([page for page in entry.pages if page is not None], entry.tokens))
        return found

    def adopt(self, digest: bytes, tokens: tuple[int, ...], pages: list[PageId]) -> bool:
        """Cache a block whose K/V were written into `pages` (one per group) from elsewhere (another engine computed
        them): the pages' one reference each becomes the cache's, and they are evictable at once. False (nothing
        kept: the caller frees the pages) when a block of that hash is cached already."""
        if digest in self._entries or any(page in self._hash_of_page for page in pages):
            return False
        self._entries[digest] = _Entry(list(pages), tokens)
        for g, page in enumerate(pages):
            self._hash_of_page[page] = (digest, g)
        self.released(pages)
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
        num_full = min(seq.num_computed_tokens // size, blocks.num_blocks)
        if num_full <= blocks.num_offered_blocks:
            return
        hashes = self.hashes(seq, num_full)
        for index in range(blocks.num_offered_blocks, num_full):
            digest = hashes[index]
            pages = [table[index] for table in blocks.tables]
            cached = self._entries.get(digest)
            if cached is not None:
                # Already cached, from this sequence (a hit) or another one that computed it first; a window page the
                # entry lost to eviction is taken from this sequence, which computed it again.
                for g, page in enumerate(pages):
                    if cached.pages[g] is None and page >= 0 and page not in self._hash_of_page:
                        cached.pages[g] = page
                        self._hash_of_page[page] = (digest, g)
                        self.pool.incref(page)
                continue
            if any(page < 0 or page in self._hash_of_page for page in pages):
                # A page cached under another hash (never reuse a page for two contents), or one already given back.
                continue
            self._entries[digest] = _Entry(list(pages), tuple(seq.tokens(index * size, (index + 1) * size)))
            for g, page in enumerate(pages):
                self._hash_of_page[page] = (digest, g)
                self.pool.incref(page)
        blocks.num_offered_blocks = num_full

    def cached_pages(self, seq: KVSequence, num_blocks: int) -> list[list[PageId | None]]:
        """Per block of the sequence's first `num_blocks` (those it offered), the pages the cache holds for it, one
        per group (None: evicted); the list stops at the first block the cache no longer knows."""
        found: list[list[PageId | None]] = []
        for digest in self.hashes(seq, num_blocks)[:num_blocks]:
            entry = self._entries.get(digest)
            if entry is None:
                break
            found.append(list(entry.pages))
        return found

    def released(self, pages: list[PageId]) -> None:
        """After requests dropped `pages`: those only the cache still holds may be evicted from now on.

        Called with a request's blocks in reverse order, so a sequence's tail is evicted before its head (the head
        is what other requests share). A page already on the eviction list moves to its most recently used end.
        """
        for page in pages:
            if page in self._hash_of_page and self.pool.ref_cnt(page) == 1:
                self.pool.mark_evictable(("kv", page), 1, partial(self._evict, page))

    def _evict(self, page: PageId) -> None:
        digest, group = self._hash_of_page.pop(page)
        entry = self._entries[digest]
        released = [page]
        if self._windowed[group]:
            entry.pages[group] = None
        else:  # the entry can start no hit past this block any more: its other pages go too
            del self._entries[digest]
            for other in entry.pages:
                if other is not None and other != page:
                    del self._hash_of_page[other]
                    self.pool.unmark_evictable(("kv", other))
                    released.append(other)
        self.pool.release(released)

    def clear(self) -> int:
        """Forget every block no request uses; returns how many pages were dropped."""
        dropped = 0
        for page in list(self._hash_of_page):
            if page in self._hash_of_page and self.pool.ref_cnt(page) == 1:
                self.pool.unmark_evictable(("kv", page))
                self._evict(page)
                dropped += 1
        return dropped
