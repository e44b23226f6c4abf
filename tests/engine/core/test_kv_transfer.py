"""KV blocks between two engines (engine/core/kv_transfer.py), on the engines' own pools: blocks one engine computed
and another adopts give the second the same tokens while it computes only the rest; a block that is not the
request's (another hash, other tokens, another tenant's salt or adapter) is refused from there on; pinned blocks
are held until released or their time to live runs out."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _support.checkpoints import VOCAB

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.kv_transfer import (
    KVBlocks,
    TransferPins,
    TransferRefused,
    export_blocks,
    import_blocks,
    request_hashes,
)
from loraplex.engine.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BLOCK = 16


def _core(path: Path, **options: object) -> EngineCore:
    return EngineCore(
        EngineConfig(model=path, dtype="float32", device="cpu", kv_budget=2**20, block_size=BLOCK, **options)  # type: ignore[arg-type]
    )


def _run(core: EngineCore, prompt: list[int], *, salt: str | None = None, max_tokens: int = 8) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens served from the cache."""
    request_id = f"r{len(core.requests)}-{random.random()}"
    core.add_request(
        request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), cache_salt=salt
    )
    while True:
        for output in core.step():
            if output.request_id == request_id and output.finished:
                return output.outputs[0].token_ids, output.num_cached_tokens


@pytest.fixture
def prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(2, VOCAB) for _ in range(70)]  # 4 full blocks before the last token's


def test_adopted_blocks_give_the_same_tokens_and_are_not_computed_again(
    checkpoint: Callable[..., Path], prompt: list[int]
) -> None:
    path = checkpoint("llama-gqa")
    source, target, alone = _core(path), _core(path), _core(path)
    expected, _ = _run(alone, prompt, salt="t1")
    _run(source, prompt, salt="t1")
    blocks = export_blocks(source, request_hashes(source, prompt, "t1", None))
    assert blocks.num_blocks == 4 and blocks.data.shape[:2] == (4, 2)

    assert import_blocks(target, prompt, "t1", None, blocks) == 4 * BLOCK
    tokens, cached = _run(target, prompt, salt="t1")
    assert tokens == expected
    assert cached == 4 * BLOCK, "the adopted blocks were computed again"
    # Adopting what is cached already writes nothing and still counts.
    free = target.pool.num_free
    assert import_blocks(target, prompt, "t1", None, blocks) == 4 * BLOCK
    assert target.pool.num_free == free


@pytest.mark.parametrize(
    "tamper",
    ["hash", "tokens", "salt", "adapter"],
)
def test_blocks_that_are_not_the_requests_are_refused_from_the_first_on(
    tamper: str, checkpoint: Callable[..., Path], prompt: list[int]
) -> None:
    path = checkpoint("llama-gqa")
    source, target = _core(path), _core(path)
    _run(source, prompt, salt="t1")
    blocks = export_blocks(source, request_hashes(source, prompt, "t1", None))
    salt, digest = "t1", None
    if tamper == "hash":  # the third block's hash is not the one the target computes: it and the fourth are refused
        blocks.hashes[2] = bytes(32)
    elif tamper == "tokens":  # the right hash over other tokens: a peer that lies about what it holds
        blocks.tokens[2] = tuple(reversed(blocks.tokens[2]))
    elif tamper == "salt":  # another tenant asking for the same tokens computes other hashes: nothing fits
        salt = "t2"
    else:
        digest = "sha256:" + "0" * 64
    before = target.pool.num_free
    adopted = import_blocks(target, prompt, salt, digest, blocks)
    assert adopted == (2 * BLOCK if tamper in ("hash", "tokens") else 0)
    assert target.pool.num_free == before - adopted // BLOCK
    tokens, cached = _run(target, prompt, salt=salt)
    assert cached == adopted
    assert tokens == _run(_core(path), prompt, salt=salt)[0]


def test_blocks_of_another_layout_are_refused(checkpoint: Callable[..., Path], prompt: list[int]) -> None:
    source = _core(checkpoint("llama-gqa"))
    _run(source, prompt)
    blocks = export_blocks(source, request_hashes(source, prompt, None, None))
    other = _core(checkpoint("llama-tied"))  # 4 KV heads, not 2
    with pytest.raises(TransferRefused, match="another model or layout"):
        import_blocks(other, prompt, None, None, blocks)
    wider = dataclasses.replace(blocks, layout=dataclasses.replace(blocks.layout, block_size=32))
    with pytest.raises(TransferRefused):
        import_blocks(_core(checkpoint("llama-gqa")), prompt, None, None, wider)


def test_only_the_cached_leading_run_is_exported(checkpoint: Callable[..., Path], prompt: list[int]) -> None:
    source = _core(checkpoint("llama-gqa"))
    _run(source, prompt[:40])  # 2 full blocks of this prompt's 4
    blocks: KVBlocks = export_blocks(source, request_hashes(source, prompt, None, None))
    assert blocks.num_blocks == 2
    nothing = export_blocks(source, [bytes(32), *request_hashes(source, prompt, None, None)])
    assert nothing.num_blocks == 0


def test_pins_hold_blocks_until_released_or_expired(checkpoint: Callable[..., Path], prompt: list[int]) -> None:
    core = _core(checkpoint("llama-gqa"))
    _run(core, prompt, salt="t1")
    evictable = core.pool.num_evictable
    pins = TransferPins()
    hashes = pins.pin(core, "x1", prompt, "t1", None, ttl_s=30)
    assert len(hashes) == 4 and core.pool.num_evictable == evictable - 4
    assert core.kv.prefix_cache is not None and core.kv.prefix_cache.clear() == evictable - 4  # pinned: kept
    assert pins.release(core, "x1") and not pins.release(core, "x1")

    _run(core, prompt, salt="t1")
    pins.pin(core, "x2", prompt, "t1", None, ttl_s=30)
    assert pins.num_pinned_pages == 4
    assert pins.sweep(core) == 0
    assert pins.sweep(core, now=torch.inf) == 1  # past its time to live
    assert pins.num_pinned_pages == 0 and core.pool.num_evictable >= 4
