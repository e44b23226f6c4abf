"""What the engine reports of itself between steps: `EngineState`, the snapshot the platform's router and the
server's metrics read, and `snapshot`, which takes it from an engine core."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.engine.core.scheduler import KeyService, QueueStats
from loraplex.engine.core.speculator import SpeculationCounts
from loraplex.engine.memory.page_pool import PoolUsage

if TYPE_CHECKING:
    from loraplex.engine.core.engine_core import EngineCore


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the platform's router reads: load and free capacity."""

    num_waiting: int
    num_running: int
    pool: PoolUsage
    num_preemptions: int
    num_steps: int
    num_interleaved_steps: int = 0  # of those, steps run inside another, for a newcomer (EngineCore.step)
    prefix_cache_blocks: int = 0  # full blocks the prefix cache knows (in use or evictable)
    prefix_cache_queried_tokens: int = 0  # prompt tokens of admitted requests, since start
    prefix_cache_hit_tokens: int = 0  # of those, served from the cache
    weight_bytes: int = 0  # the model's weights as kept (quantized ones with their scales)
    quantization: str | None = None  # None, "int8", "int4" or "fp8" (at load), "gptq", "awq" or "fp8" (as stored)
    num_waiting_tokens: int = 0  # tokens the waiting requests have to compute
    num_batched_tokens: int = 0  # tokens computed by every step since start (the rate of work)
    queues: tuple[QueueStats, ...] = ()  # waiting and running per (fairness key, priority)
    keys: tuple[KeyService, ...] = ()  # each fairness key's VTC counter, tokens served, preemptions
    # Speculation's totals per adapter name ("" the base model): (adapter, counts); empty when it is off.
    speculation: tuple[tuple[str, SpeculationCounts], ...] = ()
    # Names of the adapters of the running and of the waiting requests, each once, in queue order.
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    # Which implementation each hot operator runs (kernels/paths.py): (operator, path).
    operators: tuple[tuple[str, str], ...] = ()


def snapshot(core: EngineCore) -> EngineState:
    """The engine's load and free capacity now (read on the engine thread)."""
    cache = core.kv.prefix_cache
    return EngineState(
        num_waiting=len(core.scheduler.waiting),
        num_running=len(core.scheduler.running),
        pool=core.pool.usage(),
        num_preemptions=core.num_preemptions,
        num_steps=core.num_steps,
        num_interleaved_steps=core.num_interleaved_steps,
        prefix_cache_blocks=cache.num_blocks if cache is not None else 0,
        prefix_cache_queried_tokens=cache.stats.queried_tokens if cache is not None else 0,
        prefix_cache_hit_tokens=cache.stats.hit_tokens if cache is not None else 0,
        weight_bytes=core.weight_bytes,
        quantization=core.model.quantization_label,
        num_waiting_tokens=core.scheduler.num_waiting_tokens,
        num_batched_tokens=core.num_batched_tokens,
        queues=tuple(core.scheduler.queue_stats()),
        keys=tuple(core.scheduler.key_service()),
        speculation=tuple((name, dataclasses.replace(counts)) for name, counts in speculator.stats.by_adapter.items())
        if (speculator := core.scheduler.speculator) is not None
        else (),
        running_adapters=tuple(
            dict.fromkeys(r.adapter.ref.name for r in core.scheduler.running if r.adapter is not None)
        ),
        waiting_adapters=tuple(
            dict.fromkeys(r.adapter.ref.name for r in core.scheduler.waiting if r.adapter is not None)
        ),
        operators=tuple(core.operator_paths.items()),
    )
