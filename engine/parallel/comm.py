"""The forward's collectives over one torch.distributed process group, made for this engine alone.

The group is a standalone ProcessGroupGloo (a CPU) or ProcessGroupNCCL (CUDA) over its own TCPStore, never the
process-wide default group, so a process may hold several engines (tests do) and the platform's process is not
changed. Every collective waits for its result; a rank that died fails it (gloo: at once, as its socket closes;
NCCL or a hung rank: after the group's timeout).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist

# The classes themselves (torch.distributed re-exports them only when it is available, which type checkers cannot see).
from torch._C._distributed_c10d import GatherOptions, PrefixStore, ProcessGroupGloo, Store, TCPStore, Work

__all__ = ["CollectiveStats", "Collectives", "ProcessGroupCommunicator", "TCPStore", "connect"]


# gloo all-reduces up to this many bytes as an all-gather and a sum in rank order (decision 0040).
SMALL_ALL_REDUCE_BYTES = 256 * 1024


class Collectives(Protocol):
    """What the engine calls on a gloo or NCCL backend (torch's stubs declare these on ProcessGroup only)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> Work: ...

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]) -> Work: ...

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: GatherOptions
    ) -> Work: ...


@dataclass(slots=True)
class CollectiveStats:
    """What the collectives moved since start (or the last reset): calls and payload bytes per rank."""

    num_all_reduces: int = 0
    all_reduce_bytes: int = 0
    num_gathers: int = 0
    gather_bytes: int = 0  # what each rank sends


def connect(
    *, host: str, port: int, rank: int, size: int, backend: str, timeout_s: float, store: Store | None = None
) -> Collectives:
    """Join the group whose TCPStore rank 0 serves at host:port (rank 0 passes its store). Blocks until all ranks
    have joined or `timeout_s` passed."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(host, port, size, is_master=False, timeout=timeout)
    prefixed = PrefixStore(f"loraplex-tp/{backend}", store)
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from CPU builds of torch
        if nccl is None:
            raise RuntimeError("this build of torch has no NCCL: tensor parallelism on CUDA needs a CUDA build")
        options = nccl.Options()
        options._timeout = timeout
        return cast(Collectives, nccl(prefixed, rank, size, options))
    return cast(Collectives, ProcessGroupGloo(prefixed, rank, size, timeout))


class ProcessGroupCommunicator:
    """engine.model's Communicator over a process group (set by `bind` once the ranks have joined)."""

    def __init__(self, rank: int, size: int, backend: str) -> None:
        self._rank = rank
        self._size = size
        self._backend = backend
        self._group: Collectives | None = None
        self.stats = CollectiveStats()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def bind(self, group: Collectives) -> None:
        self._group = group

    def _joined(self) -> Collectives:
        if self._group is None:
            raise RuntimeError("the tensor-parallel group has not been joined yet")
        return self._group

    def all_reduce(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.num_all_reduces += 1
        self.stats.all_reduce_bytes += nbytes
        if self._backend != "gloo" or nbytes > SMALL_ALL_REDUCE_BYTES:
            self._joined().allreduce([tensor]).wait()
            return
        # A decode step's all-reduces are small and bound by gloo's per-collective latency, which its all-gather has
        # less of than its all-reduce. Every rank sums the same parts in the same order: the same bits everywhere.
        parts = [torch.empty_like(tensor) for _ in range(self._size)]
        self._joined().allgather([parts], [tensor]).wait()
        torch.add(parts[0], parts[1], out=tensor)
        for part in parts[2:]:
            tensor.add_(part)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        options = GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self._size)]] if self._rank == 0 else []
        self._joined().gather(outputs, [tensor], options).wait()
        self.stats.num_gathers += 1
        self.stats.gather_bytes += tensor.numel() * tensor.element_size()
        return outputs[0] if self._rank == 0 else None
