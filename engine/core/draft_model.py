"""Draft-model proposals: a small checkpoint that shares the target's tokenizer proposes each row's next tokens.

Semantics, for one row whose real tokens (prompt then output) are t[0..L) and that may propose at most k tokens:
    p[1] = argmax draft(t[0..L))                   # the draft's greedy next token
    p[j] = argmax draft(t[0..L) + p[1..j))         # for j = 2..k
    return p[1..k]
Greedy argmaxes: a deterministic proposer, like the n-gram one, so the target verifies them as it does those.

The draft's K/V live in the target's page pool. One pool page (the target's layers x page_elems) holds one draft
block of block_size tokens for every draft layer: draft layer j sits in pool layer j // per_layer, at slot
j % per_layer of that layer's page, where per_layer = page_elems // (2 * draft kv_heads * block_size * head_dim).
A draft whose layers do not fit that way is refused at start.

Per request the proposer keeps the tokens its draft K/V hold. At each proposal it keeps the longest common prefix of
those with the request's real tokens (so rejected proposals, and anything else that changed, drop out without any
hook), computes the missing ones for every row in one draft forward (the catch-up: a row's whole prompt the first
time), then runs up to k - 1 single-token forwards for all rows together. A row's catch-up beyond the step's token
budget is done over several steps, proposing nothing until it is complete.

Draft pages never starve the target: a row takes them only where the pool has them now (free or evictable), else it
proposes nothing this step; and between proposals they are evictable, so any allocation of the target takes them
back (dropping that request's draft K/V, recomputed by a later catch-up) before the scheduler would preempt anyone.

A row of a request whose adapter has a draft counterpart (draft_adapters.py: a `draft/` adapter beside its files)
proposes with the draft under that LoRA once it is resident, and with the bare draft until then. A request's draft
K/V are computed under one adapter: when the one its row runs with changes (the counterpart became resident, or was
evicted and could not be placed again), its draft K/V are dropped and caught up again under the new one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from loraplex.engine.core.draft_adapters import DraftAdapters
from loraplex.engine.core.request import Request
from loraplex.engine.core.speculative_config import SpeculativeConfig
from loraplex.engine.lora.batch import LoraBatch, LoraStep
from loraplex.engine.lora.manager import AdapterEntry, AdapterManager, kernel_slot
from loraplex.engine.memory.page_pool import KVLayer, PageId, PageKind, PagePool
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.decoder import DecoderModel
from loraplex.engine.model.forward_batch import build_forward_batch
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.model.weights import CheckpointTensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DraftModel:
    """A draft checkpoint, checked against its target and loaded in the target's dtype, on its device."""

    path: Path
    config: ModelConfig
    model: DecoderModel
    max_positions: int  # positions it computes: its own limit, capped at the target's max_model_len

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        target: ModelConfig,
        tokenizer: Tokenizer,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> DraftModel:
        """Read and check the draft folder, then load its weights. Raises ValueError (CheckpointError for a bad
        folder) when its vocabulary is not the target's: its token ids would mean other tokens.

        A draft with fewer positions than the target's max_model_len is served: rows past its limit propose less,
        then nothing (see `DraftModelProposer`)."""
        config = ModelConfig.from_dir(path)
        if config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model {path} has vocab_size {config.vocab_size}, the target {target.vocab_size}: "
                "a draft must share the target's tokenizer"
            )
        draft_vocab = Tokenizer.from_dir(path).backend.get_vocab(with_added_tokens=True)
        target_vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        if draft_vocab != target_vocab:
            differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda item: item[1])
            token, token_id = differing[0]
            raise ValueError(
                f"the draft model {path} has another tokenizer than the target (token {token!r} is id {token_id} in "
                "one and not in the other): a draft must share the target's tokenizer"
            )
        max_positions = min(config.max_position_embeddings, max_model_len)
        model = DecoderModel(config, dtype=dtype, device=device, max_positions=max_positions)
        model.load(CheckpointTensors(path))
        logger.info(
            "loaded draft model %s (%d layers, %.1f M parameters, %d positions)",
            path,
            config.num_layers,
            config.num_parameters() / 1e6,
            max_positions,
        )
        return cls(path=path, config=config, model=model, max_positions=max_positions)


@dataclass(slots=True, eq=False)
class _DraftSequence:
    """One request's draft K/V: block i of `block_ids` holds the draft K/V of token_ids[i * bs : (i + 1) * bs]."""

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[PageId] = field(default_factory=list)
    # Leading token_ids that were the request's real tokens when last compared: a request's tokens only grow
    # (outputs are appended; a preempted request keeps its output), so only the ones after them are compared again.
    num_real: int = 0
    adapter: AdapterEntry | None = None  # the draft adapter (counterpart) its K/V were computed with; None: bare


@dataclass(slots=True)
class _Row:
    """A row of one proposal: what its draft forwards compute."""

    index: int  # in the proposal's rows
    seq: _DraftSequence  # its `adapter` is resident and pinned for the proposal
    num_proposals: int  # k: proposals it makes (0 while its catch-up is not complete)
    catch_up: list[int]  # real tokens this proposal computes first (tokens[len(seq.token_ids) : ...])


class DraftModelProposer:
    """The draft_model method of a SpeculativeConfig, over the target's page pool. Not thread-safe: the engine's
    one thread calls it (from the scheduler's step)."""

    pays_per_token = True  # every proposed token is a draft forward: ask for no more than will be verified

    def __init__(
        self,
        config: SpeculativeConfig,
        draft: DraftModel,
        *,
        pool: PagePool,
        block_size: int,
        max_num_batched_tokens: int,
        adapters: AdapterManager | None = None,
    ) -> None:
        """`adapters` is the target's adapter manager: with it, requests' adapters may have draft counterparts."""
        if config.method != "draft_model":
            raise ValueError(f"DraftModelProposer needs a draft_model speculative config, not {config.method!r}")
        c = draft.config
        block_elems = 2 * c.num_kv_heads * block_size * c.head_dim  # one draft layer's block
        per_layer = pool.page_elems // block_elems
        pool_layers = len(pool.storage)
        if per_layer * pool_layers < c.num_layers or pool.page_elems % c.head_dim:
            raise ValueError(
                f"the draft model {draft.path}'s K/V of one block ({c.num_layers} layers x {block_elems} values) does "
                f"not fit one page of the pool ({pool_layers} layers x {pool.page_elems} values, each layer's page "
                f"holding whole draft layers): a draft needs fewer layers, KV heads or a smaller head_dim"
            )
        self._max_k = config.num_speculative_tokens
        self.draft = draft
        self.pool = pool
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self._rows_per_page = pool.page_elems // c.head_dim  # head_dim rows of a page, in a layer's `rows` view
        self.kv_caches = [self._kv_layer(j, per_layer, block_elems) for j in range(c.num_layers)]
        self.adapters = DraftAdapters(adapters, c, draft.model.device) if adapters is not None else None
        self._seqs: dict[Request, _DraftSequence] = {}
        self.num_evictions = 0  # requests' draft K/V the pool took back for other allocations, since start

    def _kv_layer(self, layer: int, per_layer: int, block_elems: int) -> KVLayer:
        """Draft layer `layer`'s views into the pool: its slot of each page of one pool layer."""
        c = self.draft.config
        storage = self.pool.storage[layer // per_layer]  # [num_pages, page_elems]
        offset = (layer % per_layer) * block_elems
        num_pages = storage.shape[0]
        kv = storage[:, offset : offset + block_elems].view(num_pages, 2, c.num_kv_heads, self.block_size, c.head_dim)
        # Row r of `rows` is head_dim values at page_elems * page + offset + r * head_dim: the same row numbers
        # (_kv_rows) address every draft layer, whatever its slot.
        num_rows = ((num_pages - 1) * self.pool.page_elems + block_elems) // c.head_dim
        rows = torch.as_strided(
            storage, (num_rows, c.head_dim), (c.head_dim, 1), storage_offset=storage.storage_offset() + offset
        )
        return KVLayer(k=kv[:, 0], v=kv[:, 1], rows=rows)

    @property
    def num_pages(self) -> int:
        """Pool pages the draft's K/V hold now (every one of them evictable between proposals)."""
        return sum(len(seq.block_ids) for seq in self._seqs.values())

    def num_pages_of(self, request: Request) -> int:
        """Pool pages the request's draft K/V hold now."""
        seq = self._seqs.get(request)
        return 0 if seq is None else len(seq.block_ids)

    # --- the proposer interface ------------------------------------------------------------------------------------

    def propose(self, rows: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        """Up to min(limits[i], num_speculative_tokens) proposed tokens for each row (see the module's semantics);
        [] for a row whose draft pages cannot be had now, whose catch-up is not complete, or that is past the draft's
        positions."""
        proposals: list[list[int]] = [[] for _ in rows]
        planned: list[tuple[int, Request, list[int], int]] = []
        for i, (request, limit) in enumerate(zip(rows, limits, strict=True)):
            tokens = request.prompt_token_ids + request.output_token_ids
            # Proposal j (1-based) is computed at position len(tokens) - 1 + j - 1, which the draft must have.
            k = min(limit, self._max_k, self.draft.max_positions - len(tokens) + 1)
            if k >= 1:
                planned.append((i, request, tokens, k))
                seq = self._seqs.get(request)
                if seq is not None:
                    self.pool.unmark_evictable(("draft", seq))  # none of this step's rows evicts another's
        if self.adapters is not None:
            self.adapters.poll()
        budget = self.max_num_batched_tokens
        active: list[_Row] = []
        for i, request, tokens, k in planned:
            seq = self._seqs.setdefault(request, _DraftSequence())
            if budget > 0:
                adapter = self.adapters.pin(request) if self.adapters is not None else None
                if adapter is not seq.adapter:  # K/V under one adapter only: all of it is computed again
                    self._truncate(seq, 0)
                    seq.adapter = adapter
            # At least the last real token is computed again: its draft logits propose the first token.
            self._truncate(seq, _common_prefix(seq.token_ids, tokens, len(tokens) - 1, known=seq.num_real))
            seq.num_real = len(seq.token_ids)
            missing = len(tokens) - len(seq.token_ids)
            if budget <= 0:
                continue
            if missing > budget:  # a long catch-up: this step computes a part of it and proposes nothing
                k, missing = 0, budget
            held = len(seq.token_ids) + missing + max(0, k - 1)
            if not self._grow(seq, held):
                continue
            budget -= missing
            active.append(_Row(i, seq, k, tokens[len(seq.token_ids) : len(seq.token_ids) + missing]))
        try:
            if active:
                self._run(active, proposals)
        finally:
            if self.adapters is not None:
                self.adapters.unpin_all()
        for _, request, _, _ in planned:
            self._park(request)
        return proposals

    def release(self, request: Request) -> None:
        """A request left the engine (finished, aborted, failed): its draft pages go back to the pool."""
        seq = self._seqs.pop(request, None)
        if seq is not None:
            self.pool.unmark_evictable(("draft", seq))
            self.pool.release(seq.block_ids)
            seq.block_ids, seq.token_ids, seq.num_real = [], [], 0
        if self.adapters is not None:
            self.adapters.release(request)

    # --- draft K/V -------------------------------------------------------------------------------------------------

    def _truncate(self, seq: _DraftSequence, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens' draft K/V (the block holding the boundary stays)."""
        del seq.token_ids[num_tokens:]
        seq.num_real = min(seq.num_real, num_tokens)
        keep = -(-num_tokens // self.block_size)
        if len(seq.block_ids) > keep:
            self.pool.release(seq.block_ids[keep:])
            del seq.block_ids[keep:]

    def _grow(self, seq: _DraftSequence, num_tokens: int) -> bool:
        """Give the sequence blocks for `num_tokens` tokens if the pool has them now; False (nothing taken) if not."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            return False
        seq.block_ids.extend(self.pool.allocate(needed, PageKind.KV))
        return True

    def _park(self, request: Request) -> None:
        """Between proposals a request's draft pages are the pool's to take back (or, holding none, forgotten)."""
        seq = self._seqs.get(request)
        if seq is None:
            return
        if not seq.block_ids:
            del self._seqs[request]
            return
        self.pool.mark_evictable(("draft", seq), len(seq.block_ids), lambda: self._evicted(request, seq))

    def _evicted(self, request: Request, seq: _DraftSequence) -> None:
        """The pool took the request's draft pages back (it already took them off the eviction list)."""
        self.pool.release(seq.block_ids)
        seq.block_ids, seq.token_ids, seq.num_real = [], [], 0
        if self._seqs.get(request) is seq:
            del self._seqs[request]
        self.num_evictions += 1

    # --- draft forwards --------------------------------------------------------------------------------------------

    def _run(self, rows: list[_Row], proposals: list[list[int]]) -> None:
        """The catch-up forward for every row, then one single-token forward per further proposal."""
        # Rows of one counterpart next to each other: each adapter's tokens become one LoRA segment.
        rows = sorted(rows, key=_slot_order)
        proposing = [row for row in rows if row.num_proposals > 0]
        firsts = self._forward(
            [(row.seq, row.catch_up) for row in rows], logits_of=[row.num_proposals > 0 for row in rows]
        )
        for row in rows:
            row.seq.token_ids.extend(row.catch_up)
            row.seq.num_real = len(row.seq.token_ids)
        for row, token in zip(proposing, firsts, strict=True):
            proposals[row.index].append(token)
        for j in range(1, max((row.num_proposals for row in proposing), default=0)):
            step = [row for row in proposing if row.num_proposals > j]
            fed = [proposals[row.index][-1] for row in step]
            nexts = self._forward([(row.seq, [token]) for row, token in zip(step, fed, strict=True)])
            for row, token, proposed in zip(step, fed, nexts, strict=True):
                row.seq.token_ids.append(token)
                proposals[row.index].append(proposed)

    def _forward(
        self, entries: list[tuple[_DraftSequence, list[int]]], logits_of: list[bool] | None = None
    ) -> list[int]:
        """One draft forward: each entry's new tokens after the tokens its K/V hold (written into its blocks), under
        its adapter; the argmax after the last token of every entry whose `logits_of` is true (default: all), in
        order."""
        num_seqs = len(entries)
        query_lens = np.fromiter((len(tokens) for _, tokens in entries), dtype=np.int64, count=num_seqs)
        widths = np.ones(num_seqs, dtype=np.int64) if logits_of is None else np.asarray(logits_of, dtype=np.int64)
        lora: LoraStep | None = None
        if self.adapters is not None:
            slots = [kernel_slot(seq.adapter) for seq, _ in entries]
            segments = LoraBatch.tile(slots, query_lens.tolist(), self.draft.model.device)
            lora = LoraStep(self.adapters.compute, segments) if segments else None
        batch = build_forward_batch(
            [token for _, tokens in entries for token in tokens],
            np.fromiter((len(seq.token_ids) for seq, _ in entries), dtype=np.int64, count=num_seqs),
            query_lens,
            [seq.block_ids for seq, _ in entries],
            widths,
            block_size=self.block_size,
            kv_rows=self._kv_rows,
            device=self.draft.model.device,
            lora=lora,
        )
        hidden = self.draft.model.forward(batch, self.kv_caches)
        if batch.logits_indices.numel() == 0:
            return []
        logits = self.draft.model.compute_logits(hidden[batch.logits_indices])
        return [int(token) for token in logits.argmax(dim=-1).tolist()]

    def _kv_rows(self, block_ids: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the draft layers' `rows` views where token i's K (and V) of head h go, token-major."""
        c = self.draft.config
        heads = torch.arange(c.num_kv_heads, dtype=torch.int64, device=block_ids.device) * self.block_size
        k_rows = (block_ids * self._rows_per_page + offsets)[:, None] + heads[None, :]
        return k_rows.reshape(-1), (k_rows + c.num_kv_heads * self.block_size).reshape(-1)


def _slot_order(row: _Row) -> int:
    adapter = row.seq.adapter
    return -1 if adapter is None or adapter.slot is None else adapter.slot


def _common_prefix(held: list[int], tokens: list[int], limit: int, *, known: int = 0) -> int:
    """The length of the longest common prefix of `held` and `tokens`, at most `limit`, given that their first
    `known` tokens are the same."""
    n = min(len(held), len(tokens), limit)
    start = min(known, n)
    if start == n:
        return n
    a = np.asarray(held[start:n], dtype=np.int64)
    b = np.asarray(tokens[start:n], dtype=np.int64)
    differ = np.flatnonzero(a != b)
    return start + int(differ[0]) if differ.size else n
