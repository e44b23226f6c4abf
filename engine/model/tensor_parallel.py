"""Tensor parallelism's arithmetic: which part of every weight a rank keeps, and the collectives a forward needs.

Megatron's split, with rank r of N:
    q/k/v, gate/up   column-parallel: the rank keeps output rows (its attention heads, its slice of the MLP), so its
                     attention and its SwiGLU run on local data
    o, down          row-parallel: the rank keeps the matching input columns; its partial product is summed over the
                     ranks by one all-reduce (rank 0 adds the residual first, so the sum is the layer's output)
    embedding        vocabulary-parallel: each rank looks up its rows of the table (zeros elsewhere), one all-reduce
    lm_head          vocabulary-parallel: each rank computes its slice of the logits, gathered on rank 0
KV heads: with at least N of them each rank keeps num_kv_heads / N; with fewer, each is replicated over
N / num_kv_heads ranks, so every rank keeps one (grouped-query attention). Each rank's KV pages hold only its heads.

Quantized weights are split after the same quantization TP=1 does, so a rank's codes, scales and zero points are
exactly TP=1's for its part: int8 scales are per output row (a column split keeps whole ones, a row split keeps the
rows' full-width scales), and int4 groups must not straddle ranks (the load refuses a split that would).

The plan is made from the checkpoint's config alone; every rank makes the same one, so no shapes travel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.engine.model.config import ModelConfig
from loraplex.kernels.quant import Int4Weight, Int8Weight


class Communicator(Protocol):
    """The collectives of one tensor-parallel group, as a forward uses them (engine/parallel's implementation runs
    them over torch.distributed: gloo on a CPU, NCCL on CUDA)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place on every rank."""
        ...

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape on all) on rank 0, in rank order; None on the other ranks."""
        ...


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise ValueError with what does not divide when `config` cannot be split over `size` ranks."""
    if size < 1:
        raise ValueError("tensor_parallel_size must be at least 1")
    if size == 1:
        return
    problems: list[str] = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads (a number of ranks must divide them, or be a multiple of them)")
    if config.intermediate_size % size:
        problems.append(f"an intermediate size of {config.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide this model: it has " + " and ".join(problems))


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Rank `rank` of `size`: what it keeps of a model of config `full`. `local` is the config its forward sees
    (its heads, its KV heads, its slice of the MLP; everything else as the checkpoint's)."""

    full: ModelConfig
    rank: int
    size: int

    @classmethod
    def make(cls, full: ModelConfig, rank: int, size: int) -> ShardPlan:
        check_tensor_parallel(full, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        return cls(full, rank, size)

    @property
    def local(self) -> ModelConfig:
        return dataclasses.replace(
            self.full,
            num_heads=self.full.num_heads // self.size,
            num_kv_heads=max(1, self.full.num_kv_heads // self.size),
            intermediate_size=self.full.intermediate_size // self.size,
        )

    # --- what this rank keeps, as index ranges of the full matrices --------------------------------------------

    @property
    def heads(self) -> range:
        per = self.full.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def kv_heads(self) -> range:
        kv = self.full.num_kv_heads
        if kv >= self.size:
            per = kv // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        first = self.rank // (self.size // kv)  # replicated over size / kv consecutive ranks
        return range(first, first + 1)

    @property
    def q_columns(self) -> range:
        """The o projection's input columns (the attention outputs of this rank's heads)."""
        d = self.full.head_dim
        return range(self.heads.start * d, self.heads.stop * d)

    @property
    def mlp_columns(self) -> range:
        per = self.full.intermediate_size // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.full.vocab_size // self.size)

    @property
    def vocab(self) -> range:
        per = self.vocab_per_rank
        return range(min(self.rank * per, self.full.vocab_size), min((self.rank + 1) * per, self.full.vocab_size))

    def qkv_rows(self) -> torch.Tensor:
        """Rows of the fused [q; k; v] projection (q and k already in rotary-pair order, per head) this rank keeps."""
        c, d = self.full, self.full.head_dim
        kv = self.kv_heads
        parts = [
            torch.arange(self.heads.start * d, self.heads.stop * d),
            c.q_size + torch.arange(kv.start * d, kv.stop * d),
            c.q_size + c.kv_size + torch.arange(kv.start * d, kv.stop * d),
        ]
        return torch.cat(parts)

    def gate_up_rows(self) -> torch.Tensor:
        """Rows of the fused [gate; up] projection this rank keeps."""
        cols = self.mlp_columns
        rows = torch.arange(cols.start, cols.stop)
        return torch.cat([rows, self.full.intermediate_size + rows])

    def module_rows(self, module: str) -> torch.Tensor | None:
        """Output rows of one module (a LoRA B) this rank keeps; None for the row-parallel ones (o, down), whose
        outputs every rank keeps whole. A fused module (Phi-3's qkv_proj, gate_up_proj) keeps its fused rows'."""
        d = self.full.head_dim
        if module == "q_proj":
            return torch.arange(self.heads.start * d, self.heads.stop * d)
        if module in ("k_proj", "v_proj"):
            return torch.arange(self.kv_heads.start * d, self.kv_heads.stop * d)
        if module in ("gate_proj", "up_proj"):
            return torch.arange(self.mlp_columns.start, self.mlp_columns.stop)
        if module == "qkv_proj":
            return self.qkv_rows()
        if module == "gate_up_proj":
            return self.gate_up_rows()
        return None

    def module_columns(self, module: str) -> range | None:
        """Input columns of one unfused module (a LoRA A) this rank keeps; None for column-parallel ones, whose
        input every rank has whole."""
        if module == "o_proj":
            return self.q_columns
        if module == "down_proj":
            return self.mlp_columns
        return None


def take_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return weight.index_select(0, rows.to(weight.device)).contiguous()


def take_int8_columns(weight: Int8Weight, columns: range) -> Int8Weight:
    """The int8 weight's input columns `columns`, with its whole rows' scales."""
    return Int8Weight(weight.qweight[:, columns.start : columns.stop].contiguous(), weight.scales)


def take_int4_columns(weight: Int4Weight, columns: range) -> Int4Weight:
    """The int4 weight's input columns `columns`: whole groups only (ValueError otherwise)."""
    start, stop, g = columns.start, columns.stop, weight.group_size
    if start % g or stop % g:
        raise ValueError(f"columns [{start}, {stop}) split int4 groups of {g}")
    return Int4Weight(
        weight.packed[:, start // 2 : stop // 2].contiguous(),
        weight.scales[:, start // g : stop // g].contiguous(),
        weight.zeros[:, start // g : stop // g].contiguous(),
        g,
    )
