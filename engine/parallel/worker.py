"""A tensor-parallel worker: ranks 1..N-1, each in its own process (started by group.TensorParallelGroup).

It loads its shard of the model, then runs one forward per message from rank 0 over its own page pool, meeting the
other ranks in the forward's collectives. It keeps no books of its own: which pages a sequence's K/V use and which
adapter sits in which slot are rank 0's decisions, carried by the messages (the step's HostBatch, the slot-table
changes), so its pool holds its heads' K/V and its shard of each adapter at the same page ids as rank 0's.

Conversation with rank 0 over one pipe (step.py's encodings; nothing is unpickled):
    worker -> ["loaded", weight_bytes] | ["error", message]        after loading its shard
    rank 0 -> ["connect", num_pages]                                 every rank loaded: join the group
    worker -> ["ready", null] | ["error", message]
    rank 0 -> an encoded StepMessage, one per forward; b"" to stop
A worker exits when rank 0 says stop, when the pipe closes, when its parent process is gone, or on any error (rank 0
then sees its collectives fail and its process end).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from loraplex.engine.lora.batch import LoraCompute, PlacedAdapter
from loraplex.engine.lora.layout import AdapterLayout, group_columns
from loraplex.engine.lora.manager import run_base, write_pages
from loraplex.engine.memory.kv_groups import KVGroups
from loraplex.engine.memory.page_pool import KVLayer, PageId, PagePool, kv_page_elems
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.decoder import DecoderModel
from loraplex.engine.model.quantization import QuantizationName
from loraplex.engine.model.tensor_parallel import ShardPlan
from loraplex.engine.model.weights import CheckpointTensors
from loraplex.engine.parallel.comm import ProcessGroupCommunicator, connect
from loraplex.engine.parallel.step import (
    AdapterEvent,
    AdapterPlaced,
    StepMessage,
    decode_step,
    receive_control,
    send_control,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerInit:
    """Everything a worker needs to load its shard and join the group (picklable)."""

    rank: int
    size: int
    model: str  # the checkpoint folder
    dtype: str  # torch dtype name, e.g. "float32"
    device: str  # this rank's device, e.g. "cpu" or "cuda:1"
    quantization: QuantizationName | None
    max_positions: int
    block_size: int
    num_threads: int | None
    max_loras: int
    store_host: str
    store_port: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float
    parent_pid: int


@dataclass(slots=True)
class _Placed:
    pages: list[PageId]
    base: int | None
    layout: AdapterLayout | None


class AdapterReplica:
    """A worker's copy of rank 0's slot table (LoraCompute reads it as it reads the AdapterManager)."""

    def __init__(self, pool: PagePool, model_config: ModelConfig, num_slots: int) -> None:
        self.pool = pool
        self.model_config = model_config
        self._slots: list[_Placed | None] = [None] * num_slots
        self.version = 0

    @property
    def slots(self) -> Sequence[PlacedAdapter | None]:
        return self._slots

    def apply(self, events: list[AdapterEvent]) -> None:
        for event in events:
            if isinstance(event, AdapterPlaced):
                for layer, packed in enumerate(event.layers):
                    write_pages(self.pool, layer, event.pages, packed.to(self.pool.device), event.layout)
                self._slots[event.slot] = _Placed(
                    event.pages, run_base(event.pages, self.pool.page_elems), event.layout
                )
            else:
                self._slots[event.slot] = None
        if events:
            self.version += 1

    def group_columns(self, group: str) -> list[tuple[int, int]]:
        return group_columns(self.model_config, group)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker outlives no engine: once its parent is gone (killed, say, mid-collective), it exits."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="loraplex-tp-parent", daemon=True).start()


def run_worker(settings: str, conn: Connection) -> None:
    """The worker process's entry point; `settings` is a WorkerInit as JSON."""
    init = WorkerInit(**json.loads(settings))
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp-rank-{init.rank} %(name)s: %(message)s"
    )
    _exit_with_parent(init.parent_pid)
    try:
        shard = _Shard.start(init, conn)
    except Exception as exc:
        logger.exception("rank %d failed to start", init.rank)
        send_control(conn, "error", f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:  # rank 0 is gone
            return
        if not payload:
            return
        try:
            shard.run(decode_step(payload))
        except Exception:
            logger.exception("rank %d failed in a forward", init.rank)
            sys.exit(1)


@dataclass(slots=True)
class _Shard:
    """One rank's model, pool and adapters, ready to run forwards."""

    model: DecoderModel
    kv_caches: list[KVLayer]
    adapters: AdapterReplica
    lora: LoraCompute
    block_size: int
    device: torch.device

    @classmethod
    def start(cls, init: WorkerInit, conn: Connection) -> _Shard:
        if init.num_threads is not None:
            torch.set_num_threads(init.num_threads)
        device = torch.device(init.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        path = Path(init.model)
        config = ModelConfig.from_dir(path)
        comm = ProcessGroupCommunicator(init.rank, init.size, init.backend)
        model = DecoderModel(
            config,
            dtype=getattr(torch, init.dtype),
            device=device,
            max_positions=init.max_positions,
            quantization=init.quantization,
            shard=ShardPlan.make(config, init.rank, init.size),
            comm=comm,
        )
        model.load(CheckpointTensors(path))
        send_control(conn, "loaded", model.weight_bytes())
        kind, num_pages = receive_control(conn)
        if kind != "connect":
            raise RuntimeError(f"rank 0 sent {kind!r} where it should have sent the pool's size")
        comm.bind(
            connect(
                host=init.store_host,
                port=init.store_port,
                rank=init.rank,
                size=init.size,
                backend=init.backend,
                timeout_s=init.timeout_s,
            )
        )
        local = model.config
        groups = KVGroups.of([local.window(i) for i in range(local.num_layers)])  # rank 0's, from the same config
        pool = PagePool(
            num_pages=num_pages,
            num_layers=groups.num_slots,
            page_elems=kv_page_elems(local.num_kv_heads, init.block_size, local.head_dim),
            dtype=model.dtype,
            device=device,
        )
        kv_caches = pool.kv_layers(local.num_layers, local.num_kv_heads, init.block_size, local.head_dim, groups)
        adapters = AdapterReplica(pool, local, init.max_loras)
        send_control(conn, "ready")
        return cls(model, kv_caches, adapters, LoraCompute(adapters, device), init.block_size, device)

    def run(self, message: StepMessage) -> None:
        """One forward, as rank 0 runs it; the logits go to rank 0 inside compute_logits."""
        self.adapters.apply(message.adapter_events)
        batch = message.batch.forward_batch(
            num_kv_heads=self.model.config.num_kv_heads,
            block_size=self.block_size,
            device=self.device,
            lora=self.lora,
            max_positions=self.model.max_positions,
        )
        hidden = self.model.forward(batch, self.kv_caches)
        self.model.compute_logits(hidden[batch.logits_indices])
