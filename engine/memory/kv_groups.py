"""How a model's layers share pool pages when some of them attend through a sliding window.

A page has `num_slots` layer slots (the pool's storage tensors). A KV group is up to num_slots layers of one kind
(the same window, or none), layer `layers[j]` in slot j: one page of the group holds one block of tokens for each of
its layers, and each group has its own block table per sequence. A model whose layers are all of one kind is one group
of all its layers (num_slots = num_layers): one page per block, as before windows existed. A hybrid model (Gemma 2/3:
sliding layers beside global ones) gets groups of `num_slots` = the smaller kind's count of layers, so every page is
the same size and any page serves any group; a sliding group's pages behind every query's window go back to the pool
while the global groups keep theirs. This is vLLM's hybrid allocator on one pool of pages, shared with the adapters.

Groups are ordered full-attention first, so group 0 is always one that keeps every block (the block count of a
sequence is group 0's table length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

# A block-table entry of a sliding group whose page went back to the pool (wholly behind the window).
NO_PAGE = -1

GroupId = NewType("GroupId", int)


@dataclass(frozen=True, slots=True)
class KVGroup:
    layers: tuple[int, ...]  # model layers, layers[j] in slot j of the group's pages
    window: int | None  # keys a query of these layers sees, itself included; None: the whole context


@dataclass(frozen=True, slots=True)
class KVGroups:
    num_slots: int  # layer slots per page (the pool's storage tensors)
    groups: tuple[KVGroup, ...]

    @classmethod
    def of(cls, windows: Sequence[int | None]) -> KVGroups:
        """The grouping of layers whose windows are `windows` (one per layer; None: full attention)."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1:
            ((window, layers),) = kinds.items()
            return cls(len(layers), (KVGroup(tuple(layers), window),))
        num_slots = min(len(layers) for layers in kinds.values())
        groups: list[KVGroup] = []
        # Full attention first, then windows from the widest.
        for window in sorted(kinds, key=lambda w: (w is not None, -(w or 0))):
            layers = kinds[window]
            for start in range(0, len(layers), num_slots):
                groups.append(KVGroup(tuple(layers[start : start + num_slots]), window))
        return cls(num_slots, tuple(groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def has_windows(self) -> bool:
        return any(group.window is not None for group in self.groups)

    def place(self, layer: int) -> tuple[GroupId, int]:
        """(group, slot) of a model layer."""
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return GroupId(index), group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")

    def first_needed_block(self, group: int, next_position: int, block_size: int) -> int:
        """The first block a query at `next_position` or later still reads in `group`: 0 without a window, else the
        block of position next_position - window + 1."""
        window = self.groups[group].window
        if window is None:
            return 0
        return max(0, next_position - window + 1) // block_size

    def pages_for_tokens(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Pages one sequence of `num_tokens` tokens may hold at once, prefilled in chunks of at most `chunk` tokens:
        every block in a full-attention group; a window group holds its window's blocks and one chunk's."""
        blocks = -(-num_tokens // block_size)
        total = 0
        for group in self.groups:
            if group.window is None:
                total += blocks
            else:
                total += min(blocks, -(-(group.window + chunk) // block_size) + 1)
        return total
