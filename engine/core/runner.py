"""The model runner: turns a scheduled step into one ForwardBatch, runs the model, returns the logits to sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.engine.core.request import Request
from loraplex.engine.core.scheduler import ScheduledRequest, SchedulerOutput
from loraplex.engine.lora.batch import LoraCompute
from loraplex.engine.lora.manager import kernel_slot
from loraplex.engine.memory.page_pool import KVLayer
from loraplex.engine.model.decoder import DecoderModel
from loraplex.engine.model.forward_batch import ForwardBatch
from loraplex.engine.parallel.group import TensorParallelGroup
from loraplex.engine.parallel.step import HostBatch


@dataclass(slots=True)
class PreparedStep:
    host: HostBatch  # what the other tensor-parallel ranks build their batch from
    batch: ForwardBatch
    # The requests that sample this step. Request i owns logits rows [logits_offsets[i], logits_offsets[i + 1]): one
    # row, or 1 + len(spec_token_ids[i]) when it verifies proposals (the distributions after 0, 1, ... of them).
    sample_requests: list[Request]
    spec_token_ids: list[list[int]]
    logits_offsets: list[int]
    # Embedding requests (core/pooling.py): (request, first row, end row, position of the first row) of this step's
    # tokens, whose hidden states `execute` pools.
    pooled_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[KVLayer],
        *,
        block_size: int,
        device: torch.device,
        lora: LoraCompute | None = None,
        workers: TensorParallelGroup | None = None,
        num_groups: int = 1,
    ) -> None:
        """`workers`: the other tensor-parallel ranks, which run every forward with this one."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.lora = lora
        self.workers = workers
        self.num_groups = num_groups  # KV groups (engine/memory/kv_groups.py): one block table each per sequence

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """Build the step's ForwardBatch. Call before the scheduler's requests advance num_computed_tokens."""
        # Requests of one adapter next to each other: each adapter's tokens become one segment.
        scheduled = sorted(sched.scheduled, key=_adapter_order)
        num_seqs = len(scheduled)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        input_ids: list[int] = []
        for s, start, num_new in zip(scheduled, starts.tolist(), query_lens.tolist(), strict=True):
            input_ids.extend(s.request.tokens(start, start + num_new - len(s.spec_token_ids)))
            input_ids.extend(s.spec_token_ids)

        # A sampling row's last token, and before it one per proposal it verifies. An embedding request samples none.
        widths = np.fromiter(
            (1 + len(s.spec_token_ids) if s.completes_prompt and s.request.pooling is None else 0 for s in scheduled),
            dtype=np.int64,
            count=num_seqs,
        )
        sampling = [s for s in scheduled if s.completes_prompt and s.request.pooling is None]
        pooled_rows: list[tuple[Request, int, int, int]] = []
        row = 0
        for s, start, num_new in zip(scheduled, starts.tolist(), query_lens.tolist(), strict=True):
            if s.request.pooling is not None:
                pooled_rows.append((s.request, row, row + num_new, start))
            row += num_new
        host = HostBatch(
            input_ids,
            starts,
            query_lens,
            [s.request.blocks.block_ids for s in scheduled],
            widths,
            [kernel_slot(s.request.adapter) for s in scheduled],
            [s.request.long_rope for s in scheduled] if self.model.uses_long_rope else [],
            [[s.request.blocks.tables[g] for s in scheduled] for g in range(1, self.num_groups)],
        )
        batch = host.forward_batch(
            num_kv_heads=self.model.config.num_kv_heads,
            block_size=self.block_size,
            device=self.device,
            lora=self.lora,
            max_positions=self.model.max_positions,
        )
        return PreparedStep(
            host=host,
            batch=batch,
            sample_requests=[s.request for s in sampling],
            spec_token_ids=[s.spec_token_ids for s in sampling],
            logits_offsets=[0, *np.cumsum(widths[widths > 0]).tolist()],
            pooled_rows=pooled_rows,
        )

    def execute(self, step: PreparedStep, between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """float32 logits [step.logits_offsets[-1], vocab]: the sampling requests' rows, in order. `between_layers`
        (DecoderModel.forward) only without tensor-parallel workers, whose forwards run in step with this one's."""
        if self.workers is not None:
            assert between_layers is None, "the other ranks cannot run a step inside this one"
            self.workers.send(step.host)
        hidden = self.model.forward(step.batch, self.kv_caches, between_layers)
        for request, first, end, position in step.pooled_rows:
            assert request.pooling is not None
            request.pooling.add(hidden[first:end], position)
        return self.model.compute_logits(hidden[step.batch.logits_indices])


def _adapter_order(scheduled: ScheduledRequest) -> int:
    return kernel_slot(scheduled.request.adapter)
