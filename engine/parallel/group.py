"""Rank 0's side of tensor parallelism: it starts ranks 1..N-1 (torch.multiprocessing, spawn), joins them in one
process group, sends each forward's host batch to all of them, and notices when one dies.

Lifecycle: `start` spawns the workers (they load their shards while rank 0 loads its own), `wait_loaded` collects
their weight sizes, `connect` gives them the pool's size and joins the group, `send` precedes every forward,
`close` stops them. From `connect` on a watchdog thread waits on the workers' process sentinels: when one exits
unasked, `failure` says which, the others are killed (no rank is left waiting in a collective), and the
`on_failure` callbacks run, so an idle engine learns of it too (its server then fails /healthz and leaves the fleet).

The group is also the adapter manager's `AdapterMirror`: slot-table changes wait here and go with the next forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

from loraplex.engine.errors import WorkerFailed
from loraplex.engine.lora.layout import AdapterLayout
from loraplex.engine.memory.page_pool import PageId
from loraplex.engine.model.quantization import QuantizationName
from loraplex.engine.parallel.comm import ProcessGroupCommunicator, TCPStore, connect
from loraplex.engine.parallel.step import (
    AdapterEvent,
    AdapterEvicted,
    AdapterPlaced,
    HostBatch,
    StepMessage,
    encode_step,
    receive_control,
    send_control,
)
from loraplex.engine.parallel.worker import WorkerInit, run_worker

logger = logging.getLogger(__name__)

# How long a collective waits for every rank before it fails (a hung rank, or NCCL's view of a dead one).
COLLECTIVE_TIMEOUT_S = 120.0
_POLL_S = 0.1


def rank_devices(device: torch.device, size: int) -> list[str]:
    """Each rank's device: `size` CUDA devices from `device`'s index on, or the CPU for all. Raises ValueError
    when the machine has too few."""
    if device.type == "cpu":
        return ["cpu"] * size
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on CUDA or the CPU, not {device.type}")
    first = device.index or 0
    found = torch.cuda.device_count()
    if first + size > found:
        raise ValueError(
            f"tensor_parallel_size {size} needs {size} CUDA devices from cuda:{first} on, but this machine has {found}"
        )
    return [f"cuda:{first + rank}" for rank in range(size)]


class TensorParallelGroup:
    def __init__(self, inits: list[WorkerInit], store: TCPStore, backend: str) -> None:
        self.size = len(inits) + 1
        self.comm = ProcessGroupCommunicator(0, self.size, backend)
        self.worker_weight_bytes = 0
        self.failure: str | None = None
        self._store = store
        self._backend = backend
        self._callbacks: list[Callable[[], None]] = []
        self._pending: list[list[AdapterEvent]] = [[] for _ in inits]  # per worker, in order
        self._closing = False
        self._lock = threading.Lock()
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._processes: list[BaseProcess] = []
        for init in inits:
            ours, theirs = context.Pipe()
            # The settings go as JSON text: nothing a worker reads from rank 0 is unpickled (the pipe end itself is
            # handed over by multiprocessing's own reduction, as any spawned process's is).
            process = context.Process(
                target=run_worker,
                args=(json.dumps(dataclasses.asdict(init)), theirs),
                name=f"loraplex-tp-{init.rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._conns.append(ours)
            self._processes.append(process)

    @classmethod
    def start(
        cls,
        *,
        size: int,
        model: str,
        dtype: torch.dtype,
        device: torch.device,
        quantization: QuantizationName | None,
        max_positions: int,
        block_size: int,
        num_threads: int | None,
        max_loras: int,
    ) -> TensorParallelGroup:
        """Spawn ranks 1..size-1; they start loading their shards at once."""
        devices = rank_devices(device, size)
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=timeout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        inits = [
            WorkerInit(
                rank=rank,
                size=size,
                model=model,
                dtype=str(dtype).removeprefix("torch."),
                device=devices[rank],
                quantization=quantization,
                max_positions=max_positions,
                block_size=block_size,
                num_threads=num_threads,
                max_loras=max_loras,
                store_host="127.0.0.1",
                store_port=store.port,
                backend=backend,
                timeout_s=COLLECTIVE_TIMEOUT_S,
                parent_pid=os.getpid(),
            )
            for rank in range(1, size)
        ]
        return cls(inits, store, backend)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]

    # --- start-up ------------------------------------------------------------------------------------------------

    def wait_loaded(self) -> None:
        """Wait until every worker has loaded its shard; raises WorkerFailed with its error if one could not."""
        self.worker_weight_bytes = sum(int(self._receive(rank, "loaded")) for rank in range(1, self.size))

    def connect(self, num_pages: int) -> None:
        """Give the workers the pool's size, join the group with them, and wait until they are ready."""
        for conn in self._conns:
            send_control(conn, "connect", num_pages)
        self.comm.bind(
            connect(
                host="127.0.0.1",
                port=self._store.port,
                rank=0,
                size=self.size,
                backend=self._backend,
                timeout_s=COLLECTIVE_TIMEOUT_S,
                store=self._store,
            )
        )
        for rank in range(1, self.size):
            self._receive(rank, "ready")
        threading.Thread(target=self._watch, name="loraplex-tp-watchdog", daemon=True).start()

    def _receive(self, rank: int, expected: str) -> Any:
        conn, process = self._conns[rank - 1], self._processes[rank - 1]
        while not conn.poll(_POLL_S):
            if not process.is_alive():
                raise WorkerFailed(f"tensor-parallel rank {rank} exited (code {process.exitcode}) while starting")
        try:
            kind, value = receive_control(conn)
        except EOFError:
            raise WorkerFailed(f"tensor-parallel rank {rank} exited while starting") from None
        if kind == "error":
            raise WorkerFailed(f"tensor-parallel rank {rank} failed to start: {value}")
        if kind != expected:
            raise WorkerFailed(f"tensor-parallel rank {rank} said {kind!r} where {expected!r} was due")
        return value

    # --- steps ---------------------------------------------------------------------------------------------------

    def send(self, batch: HostBatch) -> None:
        """Send a forward to every worker, with the slot-table changes since the last; rank 0 then runs its own."""
        self.check()
        pending, self._pending = self._pending, [[] for _ in self._conns]
        try:
            if not any(pending):
                payload = encode_step(StepMessage(batch))
                for conn in self._conns:
                    conn.send_bytes(payload)
                return
            for conn, events in zip(self._conns, pending, strict=True):
                conn.send_bytes(encode_step(StepMessage(batch, events)))
        except OSError as exc:  # a worker's end of the pipe is gone
            raise WorkerFailed(f"a tensor-parallel rank is gone: {exc}") from exc

    def placed(self, slot: int, pages: list[PageId], layout: AdapterLayout, others: list[list[torch.Tensor]]) -> None:
        for events, layers in zip(self._pending, others, strict=True):
            events.append(AdapterPlaced(slot, list(pages), layout, layers))

    def evicted(self, slot: int) -> None:
        for events in self._pending:
            events.append(AdapterEvicted(slot))

    # --- failure and shutdown ------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise WorkerFailed once a worker has died."""
        if self.failure is not None:
            raise WorkerFailed(self.failure)

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the watchdog's thread) when a worker dies."""
        self._callbacks.append(callback)

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._processes, start=1)}
        ended = wait(list(sentinels))
        with self._lock:
            if self._closing:
                return
            rank = sentinels[ended[0]]  # type: ignore[index]
            code = self._processes[rank - 1].exitcode
            self.failure = f"tensor-parallel rank {rank} exited (code {code}): the engine cannot run without it"
        logger.error("%s; stopping the other ranks", self.failure)
        self._stop(graceful=False)
        for callback in self._callbacks:
            callback()

    def close(self) -> None:
        """Stop every worker (asked first, then killed) and wait for them; idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop(graceful=self.failure is None)

    def _stop(self, *, graceful: bool) -> None:
        if graceful:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # that worker is gone already
                    conn.send_bytes(b"")
        for process in self._processes:
            process.join(timeout=5.0 if graceful else 0.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
