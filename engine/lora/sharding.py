"""An adapter split over tensor-parallel ranks as S-LoRA splits it (Sheng et al. 2023, section 6).

Column-parallel projections (q/k/v, gate/up): A is replicated and B keeps the rank's output rows, so each rank
shrinks the whole input it has anyway and expands into its own columns. Row-parallel projections (o, down): A keeps
the rank's input columns and B is replicated; each rank's shrink is a partial sum, its expand a partial delta added
to the base layer's partial product, and the base layer's all-reduce sums both. So LoRA adds no collective.

Every rank's shard has the same shapes (the ranks split evenly), so one layout (engine/lora/layout.py, with the
rank's local model config) places every rank's shard at the same offsets of the same page ids.
"""

from __future__ import annotations

import dataclasses

from loraplex.engine.lora.adapter import LoraAdapter, LoraModule
from loraplex.engine.model.tensor_parallel import ShardPlan


def shard_module(module: LoraModule, plan: ShardPlan) -> LoraModule:
    """The rank's part of one adapted module."""
    rows = plan.module_rows(module.module)
    columns = plan.module_columns(module.module)
    a, b = module.a, module.b
    if rows is not None:
        b = b.index_select(0, rows.to(b.device)).contiguous()
    if columns is not None:
        a = a[:, columns.start : columns.stop].contiguous()
    return dataclasses.replace(module, a=a, b=b)


def shard_adapter(adapter: LoraAdapter, plan: ShardPlan) -> LoraAdapter:
    """The rank's part of a validated adapter (`num_bytes` counts what it keeps)."""
    modules = {key: shard_module(module, plan) for key, module in adapter.modules.items()}
    num_bytes = sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in modules.values())
    return dataclasses.replace(adapter, modules=modules, num_bytes=num_bytes)
