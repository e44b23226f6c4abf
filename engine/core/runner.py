"""The model runner: turns a scheduled step into one ForwardBatch, runs the model, returns the logits to sample.

Host-side metadata is built with numpy over whole requests (never token by token) and moved to the device once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.core.request import Request
from loraplex.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from loraplex.engine.lora.batch import LoraBatch, LoraCompute, LoraSegment, LoraStep
from loraplex.engine.memory.page_pool import KVLayer, kv_rows
from loraplex.engine.model.forward_batch import ForwardBatch
from loraplex.engine.model.llama import LlamaModel


@dataclass(slots=True)
class PreparedStep:
    batch: ForwardBatch
    # The requests that sample this step. Request i owns logits rows [logits_offsets[i], logits_offsets[i + 1]): one
    # row, or 1 + len(spec_token_ids[i]) when it verifies proposals (the distributions after 0, 1, ... of them).
    sample_requests: list[Request]
    spec_token_ids: list[list[int]]
    logits_offsets: list[int]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVLayer],
        *,
        block_size: int,
        device: torch.device,
        lora: LoraCompute | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.lora = lora

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """Build the step's ForwardBatch. Call before the scheduler's requests advance num_computed_tokens."""
        # Requests of one adapter next to each other: each adapter's tokens become one segment.
        scheduled = sorted(sched.scheduled, key=_adapter_order)
        num_seqs = len(scheduled)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        max_blocks = max(len(s.request.blocks.block_ids) for s in scheduled)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        input_ids: list[int] = []
        for i, s in enumerate(scheduled):
            request = s.request
            block_ids = request.blocks.block_ids
            block_tables[i, : len(block_ids)] = block_ids
            input_ids.extend(request.tokens(int(starts[i]), int(seq_lens[i]) - len(s.spec_token_ids)))
            input_ids.extend(s.spec_token_ids)

        # positions[t] = starts[seq] + (t - query_start_loc[seq]) for every token t, without a Python loop.
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - query_start_loc[seq_of_token] + starts[seq_of_token]
        slot_block_ids = block_tables[seq_of_token, positions // self.block_size]
        slot_offsets = positions % self.block_size

        sampling = [(i, s) for i, s in enumerate(scheduled) if s.completes_prompt]
        sample_requests = [s.request for _, s in sampling]
        spec_token_ids = [s.spec_token_ids for _, s in sampling]
        # A row's last token, and before it one per proposal it verifies.
        widths = [1 + len(spec) for spec in spec_token_ids]
        logits_offsets = [0, *np.cumsum(widths, dtype=np.int64).tolist()]
        logits_indices = np.fromiter(
            (
                int(query_start_loc[i + 1]) - width + j
                for (i, _), width in zip(sampling, widths, strict=True)
                for j in range(width)
            ),
            dtype=np.int64,
            count=logits_offsets[-1],
        )

        def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)

        k_rows, v_rows = kv_rows(
            to_device(slot_block_ids, torch.int64),
            to_device(slot_offsets, torch.int64),
            num_kv_heads=self.model.config.num_kv_heads,
            block_size=self.block_size,
        )
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=to_device(positions, torch.int64),
            k_rows=k_rows,
            v_rows=v_rows,
            block_tables=to_device(block_tables, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            query_start_loc=to_device(query_start_loc, torch.int32),
            logits_indices=to_device(logits_indices, torch.int64),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        segments = _lora_segments(scheduled, query_start_loc, self.device)
        batch.lora = LoraStep(self.lora, segments) if self.lora is not None and segments else None
        return PreparedStep(
            batch=batch, sample_requests=sample_requests, spec_token_ids=spec_token_ids, logits_offsets=logits_offsets
        )

    def execute(self, step: PreparedStep) -> torch.Tensor:
        """float32 logits [step.logits_offsets[-1], vocab]: the sampling requests' rows, in order."""
        hidden = self.model.forward(step.batch, self.kv_caches)
        return self.model.compute_logits(hidden[step.batch.logits_indices])


def _adapter_order(scheduled: ScheduledRequest) -> int:
    adapter = scheduled.request.adapter
    return -1 if adapter is None or adapter.slot is None else adapter.slot


def _lora_segments(scheduled: list[ScheduledRequest], query_start_loc: np.ndarray, device: torch.device) -> LoraBatch:
    """Segments tiling the step's token rows: one per run of requests with the same adapter (or none)."""
    if all(s.request.adapter is None for s in scheduled):
        return LoraBatch()
    segments: list[LoraSegment] = []
    for i, s in enumerate(scheduled):
        adapter = s.request.adapter
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if segments and segments[-1].adapter is adapter:
            segments[-1].end = end
        else:
            segments.append(LoraSegment(start, end, adapter))
    return LoraBatch.of(segments, device)
