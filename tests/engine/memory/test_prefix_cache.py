"""Prefix caching: full blocks found again by chained hashes, isolated by salt and adapter, shared through the
pool's one eviction policy, exact with chunked prefill and preemption, and invisible in the output."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _support.adapters import make_peft_adapter

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.core.request import Request
from loraplex.engine.memory.kv_cache import KVCacheManager
from loraplex.engine.memory.page_pool import PageKind, PagePool
from loraplex.engine.memory.prefix_cache import block_hash, first_block_seed
from loraplex.engine.model.config import ModelConfig

pytestmark = pytest.mark.unit

BLOCK = 16
VOCAB = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def _tokens(prompt: list[int], salt: str | None = None) -> dict[str, object]:
    return {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}


@pytest.fixture(scope="module")
def base(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama-gqa")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix-adapters")
    spec = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
    return {
        "a": make_peft_adapter(base, root / "a", seed=1, **spec),
        "b": make_peft_adapter(base, root / "b", seed=2, **spec),
        "a-v2": make_peft_adapter(base, root / "a-v2", seed=3, **spec),
    }


@pytest.fixture
def llm(base: Path) -> LLM:
    return LLM(base, device="cpu", kv_budget=8 * 2**20, block_size=BLOCK)


def _pool_of(base: Path, num_pages: int) -> int:
    """The KV budget (bytes) of a float32 pool of `num_pages` pages for the model in `base`."""
    c = ModelConfig.from_dir(base)
    return num_pages * c.num_layers * 2 * c.num_kv_heads * BLOCK * c.head_dim * 4


def _run(llm: LLM, prompt: list[int], *, salt: str | None = None, lora: LoRARequest | None = None) -> RequestOutput:
    return llm.generate(_tokens(prompt, salt), GREEDY, lora_request=lora)[0]  # type: ignore[arg-type]


class TestHashes:
    def test_chain_covers_salt_adapter_and_every_earlier_token(self) -> None:
        tokens = list(range(BLOCK))
        seeds = {
            first_block_seed(None, None),
            first_block_seed("tenant-a", None),
            first_block_seed("tenant-b", None),
            first_block_seed("tenant-a", "digest-1"),
            first_block_seed("tenant-a", "digest-2"),
            first_block_seed(None, "tenant-a"),  # a salt is never confused with a digest
            first_block_seed("", None),  # nor an empty salt with none
        }
        assert len(seeds) == 7
        seed = first_block_seed("t", None)
        assert block_hash(seed, tokens) == block_hash(seed, list(tokens))
        assert block_hash(seed, tokens) != block_hash(seed, [*tokens[:-1], 99])
        parent_a, parent_b = block_hash(seed, tokens), block_hash(seed, tokens[::-1])
        assert block_hash(parent_a, tokens) != block_hash(parent_b, tokens)


class TestHits:
    def test_a_repeated_prompt_reuses_its_full_blocks_and_answers_the_same(self, llm: LLM, base: Path) -> None:
        prompt = _prompt(1, 5 * BLOCK + 3)
        first = _run(llm, prompt)
        second = _run(llm, prompt)
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == 5 * BLOCK  # every full block; the partial one is computed
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        uncached = LLM(base, device="cpu", kv_budget=8 * 2**20, block_size=BLOCK, enable_prefix_caching=False)
        reference = _run(uncached, prompt)
        assert reference.num_cached_tokens == 0
        assert reference.outputs[0].token_ids == first.outputs[0].token_ids

    def test_a_prompt_of_whole_blocks_still_computes_its_last_token(self, llm: LLM) -> None:
        prompt = _prompt(2, 4 * BLOCK)
        first = _run(llm, prompt)
        second = _run(llm, prompt)
        assert second.num_cached_tokens == 3 * BLOCK
        assert second.outputs[0].token_ids == first.outputs[0].token_ids

    def test_a_shared_prefix_hits_up_to_where_the_prompts_differ(self, llm: LLM) -> None:
        prefix = _prompt(3, 3 * BLOCK + 5)
        _run(llm, [*prefix, *_prompt(4, 40)])
        other = _run(llm, [*prefix, *_prompt(5, 40)])
        assert other.num_cached_tokens == 3 * BLOCK

    def test_generated_tokens_are_cached_too(self, llm: LLM) -> None:
        """A follow-up turn resends the previous answer: its blocks, computed while decoding, are found again."""
        prompt = _prompt(6, 2 * BLOCK)
        params = SamplingParams(temperature=0.0, max_tokens=2 * BLOCK, ignore_eos=True)
        answer = llm.generate(_tokens(prompt), params)[0].outputs[0].token_ids  # type: ignore[arg-type]
        follow_up = _run(llm, [*prompt, *answer, *_prompt(7, 5)])
        # 32 prompt + 31 fed-back answer tokens have K/V (the last answer token never goes in): 3 full blocks.
        assert follow_up.num_cached_tokens == 3 * BLOCK

    def test_cached_never_exceeds_the_prompt_in_a_mixed_batch(self, llm: LLM) -> None:
        rng = random.Random(8)
        shared = _prompt(9, 2 * BLOCK)
        prompts = [[*shared, *_prompt(100 + i, rng.randrange(1, 50))] for i in range(12)]
        prompts += [shared[: rng.randrange(1, 2 * BLOCK)] for _ in range(4)]
        _run(llm, [*shared, 1])
        outputs = llm.generate([_tokens(p) for p in prompts], GREEDY)  # type: ignore[misc]
        for prompt, output in zip(prompts, outputs, strict=True):
            assert 0 <= output.num_cached_tokens <= len(prompt) - 1
            assert output.num_cached_tokens % BLOCK == 0
        assert sum(o.num_cached_tokens for o in outputs) >= 12 * 2 * BLOCK - 2 * BLOCK


class TestIsolation:
    def test_tenants_salts_keep_their_blocks_apart(self, llm: LLM) -> None:
        prompt = _prompt(10, 4 * BLOCK + 1)
        warm = _run(llm, prompt, salt="tenant-a")
        stranger = _run(llm, prompt, salt="tenant-b")
        again = _run(llm, prompt, salt="tenant-a")
        unsalted = _run(llm, prompt)
        assert (warm.num_cached_tokens, stranger.num_cached_tokens) == (0, 0)
        assert again.num_cached_tokens == 4 * BLOCK
        assert unsalted.num_cached_tokens == 0
        assert again.outputs[0].token_ids == warm.outputs[0].token_ids == stranger.outputs[0].token_ids

    def test_two_adapters_of_one_tenant_never_share(self, llm: LLM, adapters: dict[str, Path]) -> None:
        prompt = _prompt(11, 3 * BLOCK + 2)
        a, b = LoRARequest("a", adapters["a"]), LoRARequest("b", adapters["b"])
        warm = _run(llm, prompt, salt="t", lora=a)
        other = _run(llm, prompt, salt="t", lora=b)
        base_row = _run(llm, prompt, salt="t")
        again = _run(llm, prompt, salt="t", lora=a)
        assert (warm.num_cached_tokens, other.num_cached_tokens, base_row.num_cached_tokens) == (0, 0, 0)
        assert again.num_cached_tokens == 3 * BLOCK
        assert again.outputs[0].token_ids == warm.outputs[0].token_ids

    def test_a_new_version_of_an_adapter_never_reuses_the_old_ones_blocks(
        self, llm: LLM, adapters: dict[str, Path]
    ) -> None:
        prompt = _prompt(12, 3 * BLOCK + 2)
        old = _run(llm, prompt, salt="t", lora=LoRARequest("bot", adapters["a"]))
        new = _run(llm, prompt, salt="t", lora=LoRARequest("bot", adapters["a-v2"]))  # same name, new content
        assert (old.num_cached_tokens, new.num_cached_tokens) == (0, 0)
        assert _run(llm, prompt, salt="t", lora=LoRARequest("bot", adapters["a-v2"])).num_cached_tokens == 3 * BLOCK


class TestPool:
    def test_idle_cached_blocks_are_evicted_by_the_pools_policy(self, base: Path) -> None:
        """A pool of 24 pages and prompts of 10 full blocks: the third prompt needs 7 of the first one's idle
        blocks, which go tail first (its head is what another request would share). The evicted part is computed
        again, with the same answer."""
        llm = LLM(base, device="cpu", kv_budget=_pool_of(base, 24), block_size=BLOCK, max_model_len=256)
        pool = llm.engine.pool
        assert pool.num_pages == 24
        length = 10 * BLOCK - 3  # 10 blocks each, with the answer
        prompts = [_prompt(20 + i, length) for i in range(3)]
        first = _run(llm, prompts[0])
        assert _run(llm, prompts[0]).num_cached_tokens > 0
        for prompt in prompts[1:]:
            _run(llm, prompt)
        usage = pool.usage()
        assert usage.by_kind[PageKind.KV.value] == usage.num_evictable == llm.engine.state().prefix_cache_blocks
        again = _run(llm, prompts[0])
        assert again.num_cached_tokens == 3 * BLOCK  # blocks 3-9 made room for the third prompt
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert _run(llm, prompts[0]).num_cached_tokens == (length - 1) // BLOCK * BLOCK

    def test_a_hit_takes_the_blocks_off_the_eviction_list(self) -> None:
        pool = PagePool(num_pages=6, num_layers=1, page_elems=4, dtype=torch.float32, device=torch.device("cpu"))
        kv = KVCacheManager(pool, 4, prefix_caching=True)

        def request(name: str, tokens: list[int]) -> Request:
            return Request(name, tokens, SamplingParams(), max_tokens=4)

        first = request("first", list(range(9)))
        kv.grow(first, 9)
        first.num_computed_tokens = 9
        kv.cache_computed(first)
        kv.release(first)
        assert pool.num_evictable == 2 and pool.num_free == 4  # two full blocks kept, the partial one freed
        second = request("second", list(range(9)))
        hit = kv.find_prefix(second)
        assert (hit.num_tokens, hit.num_idle) == (8, 2)
        assert pool.num_evictable == 2  # finding takes nothing
        kv.take_prefix(second, hit)
        assert pool.num_evictable == 0 and all(pool.ref_cnt(p) == 2 for p in second.blocks.block_ids)
        kv.release(second)
        assert pool.num_evictable == 2
        taken = pool.allocate(6, PageKind.KV)  # a full pool evicts both cached blocks
        assert len(taken) == 6 and kv.prefix_cache is not None and kv.prefix_cache.num_blocks == 0


class TestSchedulerInterplay:
    def test_chunked_prefill_and_preemption_keep_outputs_and_cached_counts(self, base: Path) -> None:
        """Small chunks and a pool too small for the batch: requests are preempted and recomputed (finding their
        own blocks again); their reported hits are those of their first start, and every answer is what a cold
        engine gives."""
        shared = _prompt(30, 3 * BLOCK)
        prompts = [[*shared, *_prompt(40 + i, 20 + 7 * i)] for i in range(8)]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        cold = LLM(base, device="cpu", kv_budget=8 * 2**20, block_size=BLOCK, enable_prefix_caching=False)
        expected = [o.outputs[0].token_ids for o in cold.generate([_tokens(p) for p in prompts], params)]  # type: ignore[misc]

        llm = LLM(
            base,
            device="cpu",
            block_size=BLOCK,
            kv_budget=_pool_of(base, 24),
            max_model_len=256,
            max_num_batched_tokens=32,
        )
        _run(llm, [*shared, 1])  # warm the shared prefix
        outputs = llm.generate([_tokens(p) for p in prompts], params)  # type: ignore[misc]
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.engine.num_preemptions > 0
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.num_cached_tokens in (0, 3 * BLOCK)
            assert output.num_cached_tokens <= len(prompt)
        assert any(o.num_cached_tokens for o in outputs)
        state = llm.engine.state()
        assert state.prefix_cache_hit_tokens == sum(o.num_cached_tokens for o in outputs)
        assert state.prefix_cache_queried_tokens == sum(len(p) for p in prompts) + len(shared) + 1
