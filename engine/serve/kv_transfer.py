"""Disaggregated prefill and decode, and prefix reuse across replicas: KV blocks fetched from a peer engine over HTTP.

One mechanism (decision 0043): a peer's cached blocks are fetched by their chained hashes with
`POST /v1/kv/blocks {"block_hashes": [hex, ...], "transfer_id": ..., "release": bool}`, which answers the longest
leading run it has as one safetensors body (tensors `hashes` [n, 32] u8, `tokens` [n, block_size] i64, `layout`
[6] i64 (layers, KV heads, head_dim, block size, KV groups, slots per page or 0) and `kv` [n, groups * slots,
page_elems]); the fetching engine checks each block against the hashes it computes for
its own request (engine/core/kv_transfer.py) and adopts what matches into its prefix cache, so the request then
starts from them as from any cache hit. A request asks for this with vLLM's field `kv_transfer_params`:

- `{"do_remote_decode": true}` (sent to a prefill engine, non-streamed, usually with max_tokens 1): after the answer
  the prompt's blocks are pinned under a new transfer id for `ttl_s`; the answer's `kv_transfer_params` carries
  `{"remote_url", "transfer_id", "num_blocks", "num_cached_tokens"}` for the decode engine.
- `{"do_remote_prefill": true, "remote_url": ..., "transfer_id": ...}` (sent to a decode engine with those): before
  the request is queued its blocks are fetched (the pin released) and adopted. A peer that is down, slow (past
  `fetch_timeout_s`) or sends blocks that are not the request's costs only the recompute. Without `transfer_id` it
  is a prefix pull: whatever the peer has cached of the prompt is fetched.

Tokens adopted from a remote prefill are not this engine's cache hits: usage counts the prefill engine's own hits
(`num_cached_tokens` passed along) instead, so billing sees what a single engine would have reported. A prefix pull's
blocks are cache hits, and are billed as such. Directing fetches needs an engine started with an API key (only the
router that holds it may name a peer to fetch from).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints
from safetensors.torch import save

from loraplex.engine.core.kv_transfer import (
    KVBlocks,
    KVLayout,
    TransferPins,
    TransferRefused,
    export_blocks,
    import_blocks,
    request_hashes,
)
from loraplex.engine.lora import AdapterFormatError, load_tensors, parse_safetensors

if TYPE_CHECKING:
    from loraplex.engine.serve.async_engine import AsyncEngine
    from loraplex.engine.serve.jobs import Job

logger = logging.getLogger(__name__)

HASH_BYTES = 32
MAX_BLOCK_HASHES = 65_536
_BODY_NAME = "kv blocks"


class KVTransferParams(BaseModel):
    """vLLM's `kv_transfer_params` of a completion request (the fields loraplex reads)."""

    model_config = ConfigDict(extra="forbid")

    do_remote_decode: StrictBool = False
    do_remote_prefill: StrictBool = False
    remote_url: Annotated[str, StringConstraints(pattern=r"^https?://", max_length=2048)] | None = None
    transfer_id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,128}$")] | None = None
    num_cached_tokens: Annotated[int, Field(ge=0)] | None = None  # the prefill engine's own cache hits
    num_blocks: Annotated[int, Field(ge=0)] | None = None  # blocks the prefill engine pinned (passed along as is)


class KVBlocksRequest(BaseModel):
    """The body of POST /v1/kv/blocks."""

    model_config = ConfigDict(extra="forbid")

    block_hashes: Annotated[
        list[Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]], Field(max_length=MAX_BLOCK_HASHES)
    ]
    transfer_id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,128}$")] | None = None
    release: StrictBool = False  # let go of the transfer's pin once its blocks are out


def encode_blocks(blocks: KVBlocks) -> bytes:
    layout = blocks.layout
    size = layout.block_size
    return save(
        {
            "hashes": torch.tensor([list(digest) for digest in blocks.hashes], dtype=torch.uint8).view(-1, HASH_BYTES),
            "tokens": torch.tensor([list(tokens) for tokens in blocks.tokens], dtype=torch.int64).view(-1, size),
            "layout": torch.tensor(
                [layout.num_layers, layout.num_kv_heads, layout.head_dim, size, layout.num_groups, layout.num_slots],
                dtype=torch.int64,
            ),
            "kv": blocks.data.contiguous(),
        }
    )


def decode_blocks(data: bytes) -> KVBlocks:
    """Blocks from a peer's body, checked for shape (safetensors' strict reader); TransferRefused otherwise."""
    try:
        infos = parse_safetensors(data, file_name=_BODY_NAME)
    except AdapterFormatError as exc:
        raise TransferRefused(str(exc)) from None
    if set(infos) != {"hashes", "tokens", "layout", "kv"}:
        raise TransferRefused(f"a {_BODY_NAME} body holds hashes, tokens, layout and kv, not {sorted(infos)}")
    tensors = load_tensors(data, infos)
    hashes, tokens, layout_values, kv = tensors["hashes"], tensors["tokens"], tensors["layout"], tensors["kv"]
    if layout_values.dtype != torch.int64 or layout_values.shape != (6,) or hashes.dtype != torch.uint8:
        raise TransferRefused("the blocks' layout or hashes are malformed")
    num_layers, num_kv_heads, head_dim, block_size, num_groups, num_slots = (int(v) for v in layout_values)
    if num_groups < 1 or num_slots < 0:
        raise TransferRefused("the blocks' layout is malformed")
    num_blocks = hashes.shape[0]
    page_elems = 2 * num_kv_heads * block_size * head_dim
    if (
        hashes.shape != (num_blocks, HASH_BYTES)
        or tokens.dtype != torch.int64
        or tokens.shape != (num_blocks, block_size)
        or kv.shape != (num_blocks, num_groups * (num_slots or num_layers), page_elems)
    ):
        raise TransferRefused("the blocks' tensors do not agree in shape")
    dtype = str(kv.dtype).removeprefix("torch.")
    layout = KVLayout(num_layers, num_kv_heads, head_dim, block_size, dtype, num_groups, num_slots)
    return KVBlocks(
        layout,
        [bytes(row.tolist()) for row in hashes],
        [tuple(int(t) for t in row) for row in tokens.tolist()],
        kv,
    )


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    public_url: str | None = None  # where peers reach this engine (a prefill engine's answer names it)
    api_key: str | None = None  # this engine's, sent to peers too (one key for the fleet's engines)
    ttl_s: float = 30.0  # how long a prefill's blocks stay pinned for the decode engine
    fetch_timeout_s: float = 5.0  # a fetch slower than this is dropped: the request recomputes


class KVTransfers:
    """One server's side of KV transfer: its pins, the export route's work and fetches from peers."""

    def __init__(self, engine: AsyncEngine, config: KVTransferConfig) -> None:
        self.engine = engine
        self.config = config
        self.pins = TransferPins()
        self.num_fetches = 0
        self.num_fetch_failures = 0
        self.num_imported_tokens = 0
        self._client: httpx.AsyncClient | None = None  # made by the first fetch, on the server's loop

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def enabled(self) -> bool:
        return self.config.api_key is not None

    def stats(self) -> dict[str, int]:
        """Counters for operators and tests (GET /v1/state's `kv_transfer`)."""
        return {
            "pinned_transfers": len(self.pins.pins),
            "pinned_pages": self.pins.num_pinned_pages,
            "fetches": self.num_fetches,
            "fetch_failures": self.num_fetch_failures,
            "imported_tokens": self.num_imported_tokens,
        }

    async def export(self, request: KVBlocksRequest) -> bytes:
        core = self.engine.core
        hashes = [bytes.fromhex(h) for h in request.block_hashes]

        def run() -> KVBlocks:
            blocks = export_blocks(core, hashes)
            if request.release and request.transfer_id is not None:
                self.pins.release(core, request.transfer_id)
            return blocks

        return encode_blocks(await self.engine.call(run))

    async def pin(self, job: Job) -> dict[str, Any]:
        """Pin the job's prompt's blocks for a decode engine; the answer's kv_transfer_params."""
        core = self.engine.core
        prompt = job.prompts[0].checked.token_ids
        digest = job.lora.digest if job.lora is not None else None
        transfer_id = secrets.token_hex(16)
        hashes = await self.engine.call(
            lambda: self.pins.pin(core, transfer_id, prompt, job.cache_salt, digest, self.config.ttl_s)
        )
        return {"remote_url": self.config.public_url, "transfer_id": transfer_id, "num_blocks": len(hashes)}

    async def sweep(self) -> int:
        return await self.engine.call(lambda: self.pins.sweep(self.engine.core))

    async def fetch(self, job: Job, params: KVTransferParams) -> int:
        """Fetch and adopt the job's prompt's blocks from `params.remote_url`; the prompt tokens they hold (0 when
        the fetch failed or nothing matched: the request computes them)."""
        core = self.engine.core
        prompt = job.prompts[0].checked.token_ids
        digest = job.lora.digest if job.lora is not None else None
        hashes = request_hashes(core, prompt, job.cache_salt, digest)
        if not hashes or params.remote_url is None:
            return 0
        self.num_fetches += 1
        started = time.perf_counter()
        body = {"block_hashes": [h.hex() for h in hashes], "transfer_id": params.transfer_id, "release": True}
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        try:
            async with httpx.AsyncClient(timeout=self.config.fetch_timeout_s) as client:
                response = await client.post(
                    f"{params.remote_url.rstrip('/')}/v1/kv/blocks", json=body, headers=headers
                )
                response.raise_for_status()
            blocks = decode_blocks(response.content)
            imported = await self.engine.call(lambda: import_blocks(core, prompt, job.cache_salt, digest, blocks))
        except (httpx.HTTPError, TransferRefused) as exc:
            self.num_fetch_failures += 1
            logger.warning("%s: KV fetch from %s failed, recomputing: %r", job.response_id, params.remote_url, exc)
            return 0
        self.num_imported_tokens += imported
        logger.info(
            "%s: %d prompt tokens' KV from %s (%d blocks offered) in %.3f s",
            job.response_id,
            imported,
            params.remote_url,
            len(blocks.hashes),
            time.perf_counter() - started,
        )
        return imported
