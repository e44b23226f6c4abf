"""Where an adapter's matrices sit inside its pool pages.

An adapter owns the same page ids in every layer. Inside one layer's share of them it is a flat region of
elements: first the A matrices (row-major [rank, in_features]) of every projection group, then each module's B
transposed ([rank, out_features], scaling already applied). A group is the projections that read the same input
and are computed by one fused matmul of the base model: q/k/v, o, gate/up, down. Their A rows sit back to back,
so one shrink over the group's total rank serves all of them; each module then expands into its own column
range of the fused output. Sizes follow each module's own rank: nothing is padded to a maximum rank.

A mixture-of-experts base has two more groups, its experts' gate_up and down (peft's target_parameters): their A is
every expert's A in turn ([experts * rank, in]), their B^T every expert's in turn, so expert e's pair is one block of
rows in each, at a fixed stride (GroupPlacement.experts); the compute addresses each (adapter, expert) pair as a slot
of its own (engine/lora/batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.lora.adapter import LoraAdapter
from loraplex.engine.lora.base_modules import module_shape
from loraplex.engine.model.config import ModelConfig

GROUP_NAMES: tuple[str, ...] = ("qkv", "o", "gate_up", "down", "experts_gate_up", "experts_down")
EXPERT_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("experts_gate_up", ("experts.gate_up_proj",)),
    ("experts_down", ("experts.down_proj",)),
)


@dataclass(frozen=True, slots=True)
class ModulePlacement:
    module: str
    rank: int
    h_offset: int  # first column of this module's rows in the group's shrink output
    b_offset: int  # element offset of B^T [rank, out] in the layer region
    out_start: int  # column range this module adds into, in the group's fused output
    out_end: int


@dataclass(frozen=True, slots=True)
class GroupPlacement:
    group: str
    a_offset: int  # element offset of the group's A rows [rank, in_features]
    rank: int  # total rank of the group's modules (an expert group's: one expert's)
    in_features: int
    modules: tuple[ModulePlacement, ...]
    experts: int = 1  # an expert group's experts, each `rank` rows of A and of B^T after the one before


@dataclass(frozen=True, slots=True)
class LayerLayout:
    groups: dict[str, GroupPlacement]  # only groups the adapter touches in this layer
    num_elems: int


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    layers: tuple[LayerLayout, ...]
    num_pages: int  # pages the adapter takes from the pool
    # A page has `num_slots` layer slots (the pool's storage tensors; kv_groups.py). Layer i's region lies in slot
    # i % num_slots of the adapter's pages [c * region_pages, (c + 1) * region_pages), c = i // num_slots: one chunk
    # of pages when the pool has a slot per layer (no sliding windows), as before.
    region_pages: int = 0  # pages one layer's region spans (0: num_pages)
    num_slots: int = 0  # 0: one slot per layer

    @property
    def max_elems(self) -> int:
        return max((layer.num_elems for layer in self.layers), default=0)

    def slot(self, layer: int) -> int:
        """The pool storage slot layer `layer`'s region is in."""
        return layer % self.num_slots if self.num_slots else layer

    def base(self, layer: int, page_elems: int) -> int:
        """Element offset of layer `layer`'s region within the adapter's pages (as the page table orders them)."""
        if not self.num_slots:
            return 0
        return (layer // self.num_slots) * (self.region_pages or self.num_pages) * page_elems


def groups(config: ModelConfig) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(group name, its modules in the order of the base model's fused output columns), for this base: Phi-3's fused
    qkv_proj and gate_up_proj each fill their whole group."""
    if config.fused_projections:
        return (("qkv", ("qkv_proj",)), ("o", ("o_proj",)), ("gate_up", ("gate_up_proj",)), ("down", ("down_proj",)))
    dense = (
        ("qkv", ("q_proj", "k_proj", "v_proj")),
        ("o", ("o_proj",)),
        ("gate_up", ("gate_proj", "up_proj")),
        ("down", ("down_proj",)),
    )
    return dense + EXPERT_GROUPS if config.moe is not None else dense


def group_shapes(config: ModelConfig) -> dict[str, tuple[int, tuple[tuple[str, int], ...]]]:
    """group -> (in_features, ((module, out_features), ...)) for this base model."""
    inputs = {
        "qkv": config.hidden_size,
        "o": config.q_size,
        "gate_up": config.hidden_size,
        "down": config.intermediate_size,
        "experts_gate_up": config.hidden_size,
        "experts_down": config.moe.intermediate_size if config.moe is not None else 0,
    }
    return {
        group: (inputs[group], tuple((module, module_shape(config, module)[1]) for module in modules))
        for group, modules in groups(config)
    }


def group_columns(config: ModelConfig, group: str) -> list[tuple[int, int]]:
    """Each module's column range in the base model's fused output of `group`, in the group's order."""
    _, outs = group_shapes(config)[group]
    columns, start = [], 0
    for _, width in outs:
        columns.append((start, start + width))
        start += width
    return columns


def layout_adapter(
    adapter: LoraAdapter, config: ModelConfig, page_elems: int, num_slots: int | None = None
) -> AdapterLayout:
    """Where each of the adapter's matrices goes, in a pool of `page_elems` per page and `num_slots` layer slots per
    page (default: one per layer)."""
    shapes = group_shapes(config)
    layers: list[LayerLayout] = []
    for layer in range(config.num_layers):
        offset = 0
        touched: dict[str, GroupPlacement] = {}
        pending_b: list[tuple[str, str, int, int, int, int]] = []  # group, module, rank, h_offset, start, end
        for group in shapes:
            in_features, outs = shapes[group]
            a_offset, h_offset, out_start, experts = offset, 0, 0, 1
            for module, out_features in outs:
                found = adapter.modules.get((layer, module))
                if found is not None:
                    pending_b.append((group, module, found.rank, h_offset, out_start, out_start + out_features))
                    h_offset += found.rank
                    experts = found.experts  # an expert group has one module
                out_start += out_features
            if h_offset:
                touched[group] = GroupPlacement(group, a_offset, h_offset, in_features, (), experts)
                offset += experts * h_offset * in_features
        placed: dict[str, list[ModulePlacement]] = {g: [] for g in touched}
        for group, module, rank, h_offset, start, end in pending_b:
            placed[group].append(ModulePlacement(module, rank, h_offset, offset, start, end))
            offset += touched[group].experts * rank * (end - start)
        layers.append(
            LayerLayout(
                groups={
                    g: GroupPlacement(p.group, p.a_offset, p.rank, p.in_features, tuple(placed[g]), p.experts)
                    for g, p in touched.items()
                },
                num_elems=offset,
            )
        )
    max_elems = max((layer.num_elems for layer in layers), default=0)
    region = max(1, -(-max_elems // page_elems))
    if num_slots is None or num_slots >= config.num_layers:
        return AdapterLayout(layers=tuple(layers), num_pages=region)
    chunks = -(-config.num_layers // num_slots)
    return AdapterLayout(layers=tuple(layers), num_pages=region * chunks, region_pages=region, num_slots=num_slots)


def pack_layer(adapter: LoraAdapter, layout: AdapterLayout, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """The layer's region as one flat host tensor, in the layout above."""
    placement = layout.layers[layer]
    flat = torch.empty(placement.num_elems, dtype=dtype)
    for group in placement.groups.values():
        rows = torch.cat([adapter.modules[(layer, m.module)].a for m in group.modules]).reshape(-1)
        flat[group.a_offset : group.a_offset + rows.numel()] = rows
        for m in group.modules:
            b_t = adapter.modules[(layer, m.module)].b.t()
            flat[m.b_offset : m.b_offset + b_t.numel()] = b_t.reshape(-1)
    return flat
