"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks `top_k` of `num_experts` SwiGLU
experts per token, and the token's output is their outputs weighted by the router's probabilities; Qwen2-MoE adds a
shared expert every token runs, scaled by a sigmoid gate of its own and added after the routed experts' sum.

Routing as transformers computes it: the router's logits in the activations' dtype, softmax in float32, top-k, the
k probabilities renormalized to sum to one where the family does (Mixtral always, Qwen3-MoE with `norm_topk_prob`).
Mixtral multiplies the experts' outputs by the float32 weights and casts the product; Qwen3-MoE casts the weights to
the activations' dtype first. A token's expert outputs are summed in the order of the experts' indices, starting
from zero, in the activations' dtype: transformers' `index_add_` over the experts in turn adds them in that order.

The experts run as grouped GEMMs (`torch._grouped_mm`): the step's (token, expert) pairs sorted by expert, one
call per projection over every expert's rows, no loop over experts in Python. Each pair's row depends only on its
token and its expert, so the batch a token shares never changes its answer (no capacity limit drops a token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    normalize_top_k: bool  # the k probabilities renormalized to sum to one
    float32_weights: bool  # expert outputs times the float32 weights (Mixtral), not weights cast first (Qwen)
    sparse_layers: tuple[bool, ...]  # per layer: a sparse MoE block, or the dense MLP
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]


@dataclass(slots=True)
class SharedExpert:
    """Qwen2-MoE's shared expert, row-major as the checkpoint holds it."""

    gate: torch.Tensor  # [1, hidden]: the sigmoid gate's weight
    gate_up: torch.Tensor  # [2 * shared intermediate, hidden]: gate then up
    down: torch.Tensor  # [hidden, shared intermediate]


@dataclass(slots=True)
class MoeWeights:
    router: torch.Tensor  # [num_experts, hidden]
    gate_up: torch.Tensor  # [num_experts, hidden, 2 * intermediate]: gate then up, input-major for the grouped GEMM
    down: torch.Tensor  # [num_experts, intermediate, hidden]
    shared: SharedExpert | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        shared = () if self.shared is None else (self.shared.gate, self.shared.gate_up, self.shared.down)
        return (self.router, self.gate_up, self.down, *shared)


# More than any adapter slot id + 1: sort keys expert * _SLOT_SPAN + slot + 1 group by expert, then by slot.
_SLOT_SPAN = 1 << 24


class ExpertLora(Protocol):
    """A step's adapters on one sparse layer's experts (engine/lora/batch.py's `ExpertStep`)."""

    @property
    def token_slots(self) -> torch.Tensor: ...  # [num_tokens] int64: each token's adapter slot, -1 for none

    def add(self, group: str, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor) -> None:
        """y[i] += the delta of adapter slots[i] on expert experts[i] of projection group ("experts_gate_up",
        "experts_down") for input x[i]; rows sorted by expert, then by slot."""
        ...


def route(x: torch.Tensor, router: torch.Tensor, config: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [tokens, top_k], expert ids [tokens, top_k]) of each token's chosen experts."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, config.top_k, dim=-1)
    if config.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def moe_mlp(x: torch.Tensor, w: MoeWeights, config: MoeConfig, lora: ExpertLora | None = None) -> torch.Tensor:
    """x [tokens, hidden] -> the MoE block's output [tokens, hidden], in x's dtype; with `lora`, each token's
    adapter's LoRA on the experts it is routed to added to their gate_up and down projections."""
    num_tokens, k = x.shape[0], config.top_k
    weights, experts = route(x, w.router, config)
    flat = experts.reshape(-1)
    pair_slots = None
    if lora is None:
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    else:
        # Grouped by expert and, within an expert, by adapter: each (adapter, expert) is one run of rows.
        pair_slots = lora.token_slots.repeat_interleave(k)
        order = torch.argsort(flat * _SLOT_SPAN + pair_slots + 1, stable=True)
    counts = torch.bincount(flat, minlength=config.num_experts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x.index_select(0, order // k)
    gate_up = torch._grouped_mm(rows, w.gate_up, offs=offsets)
    if lora is not None and pair_slots is not None:
        sorted_slots, sorted_experts = pair_slots.index_select(0, order), flat.index_select(0, order)
        lora.add("experts_gate_up", rows, gate_up, sorted_slots, sorted_experts)
    inter = config.intermediate_size
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out_sorted = torch._grouped_mm(act, w.down, offs=offsets)  # [pairs, hidden], pairs in expert order
    if lora is not None and pair_slots is not None:
        lora.add("experts_down", act, out_sorted, sorted_slots, sorted_experts)
    pair_weights = weights.reshape(-1).index_select(0, order)
    if config.float32_weights:
        out_sorted = (out_sorted * pair_weights[:, None]).to(x.dtype)
    else:
        out_sorted = out_sorted * pair_weights.to(x.dtype)[:, None]
    # Back to [tokens, top_k] with each token's slots in the order of their experts' indices, then summed in it.
    by_expert = torch.empty_like(out_sorted)
    by_expert[order] = out_sorted
    by_expert = by_expert.view(num_tokens, k, -1)
    slot_order = torch.argsort(experts, dim=-1, stable=True)
    by_expert = torch.gather(by_expert, 1, slot_order[:, :, None].expand_as(by_expert))
    total = by_expert[:, 0].clone()
    for slot in range(1, k):  # top_k is a small constant of the model (2 or 8): a fixed loop, not one per expert
        total += by_expert[:, slot]
    shared = w.shared
    if shared is None:
        return total
    gate, up = F.linear(x, shared.gate_up).chunk(2, dim=-1)
    return total + torch.sigmoid(F.linear(x, shared.gate)) * F.linear(F.silu(gate) * up, shared.down)
