"""What users of the offline and async APIs see: stops, lengths, seeds, logprobs, chat, abort, streaming."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _support.waiting import wait_for_async

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.errors import ContextLengthExceeded, RequestError
from loraplex.engine.serve.async_engine import AsyncEngine

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraplex.engine.tools.demo import DEMO_SPEC, write_random_model

    return write_random_model(tmp_path_factory.mktemp("demo") / "model", DEMO_SPEC)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, device="cpu", kv_budget=32 * 2**20, max_model_len=512)


def _greedy(llm: LLM, prompt: str, **kwargs: object) -> tuple[str, list[int]]:
    params = SamplingParams(temperature=0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]
    completion = llm.generate(prompt, params)[0].outputs[0]
    return completion.text, completion.token_ids


class TestStops:
    def test_max_tokens_and_length(self, llm: LLM) -> None:
        output = llm.generate("The river", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
        assert output.finished
        assert output.outputs[0].finish_reason == "length"
        assert len(output.outputs[0].token_ids) == 7
        assert output.prompt == "The river"
        assert output.prompt_token_ids == llm.get_tokenizer().encode("The river")

    def test_stop_token_is_never_emitted(self, llm: LLM) -> None:
        _, tokens = _greedy(llm, "The old mill", max_tokens=12)
        stop_at = tokens[5]
        first = tokens.index(stop_at)
        output = llm.generate(
            "The old mill", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
        )[0].outputs[0]
        assert output.token_ids == tokens[:first]
        assert output.finish_reason == "stop"
        assert output.stop_reason == stop_at

    def test_stop_string_is_cut_and_never_emitted(self, llm: LLM) -> None:
        text, _ = _greedy(llm, "Once upon a time", max_tokens=40)
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop and stop in text
        output = llm.generate(
            "Once upon a time", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        )[0].outputs[0]
        assert output.text == text[: text.index(stop)]
        assert stop not in output.text
        assert output.stop_reason == stop
        kept = llm.generate(
            "Once upon a time",
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        )[0].outputs[0]
        assert kept.text == text[: text.index(stop) + len(stop)]

    def test_eos_ends_a_request_unless_ignored(self, llm: LLM) -> None:
        eos = sorted(llm.engine.eos_token_ids)[0]
        forced = SamplingParams(temperature=0, max_tokens=5, logits_processors=[_force(eos)])
        output = llm.generate("Hello", forced)[0].outputs[0]
        assert output.finish_reason == "stop"
        assert output.token_ids == []
        assert output.stop_reason is None
        ignoring = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logits_processors=[_force(eos)])
        assert llm.generate("Hello", ignoring)[0].outputs[0].token_ids == [eos] * 5
        late = SamplingParams(temperature=0, max_tokens=5, min_tokens=3, logits_processors=[_force(eos)])
        assert len(llm.generate("Hello", late)[0].outputs[0].token_ids) == 3


def _force(token: int) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
    def processor(_: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[token] = logits.max() + 10
        return logits

    return processor


def test_seeded_output_does_not_depend_on_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate("A seeded request", params)[0].outputs[0].token_ids
    rng = random.Random(0)
    others = [
        SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 30), ignore_eos=True, seed=rng.choice([None, 5]))
        for _ in range(6)
    ]
    batch = llm.generate(
        ["x y z", "A seeded request", "lorem", "ipsum", "dolor", "sit", "amet"], [others[0], params, *others[1:]]
    )
    assert batch[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    assert len({tuple(llm.generate("A seeded request", unseeded)[0].outputs[0].token_ids) for _ in range(3)}) > 1


def test_logprobs_top_n(llm: LLM) -> None:
    output = llm.generate("Logprobs", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3))[0]
    completion = output.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    total = 0.0
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token in position
        assert position[token].rank == 1  # greedy picks the most likely token
        ranked = sorted((lp.rank or 0, lp.logprob) for lp in position.values())
        assert [r for r, _ in ranked] == [1, 2, 3]
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(ranked))
        assert all(lp.logprob <= 0 for lp in position.values())
        total += position[token].logprob
    assert completion.cumulative_logprob is not None and math.isclose(completion.cumulative_logprob, total)


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert output.prompt == rendered
    assert output.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    batch = llm.chat([messages, messages[1:]], SamplingParams(max_tokens=2))
    assert len(batch) == 2


def _request_pages(core: EngineCore) -> int:
    """KV pages requests hold: all but the prefix cache's idle blocks (on the eviction list; no adapters here)."""
    usage = core.pool.usage()
    return usage.by_kind["kv"] - usage.num_evictable


def test_bad_requests_leave_nothing_queued(llm: LLM) -> None:
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 512"):
        llm.generate({"prompt_token_ids": [5] * 600})
    with pytest.raises(ContextLengthExceeded):
        llm.generate(["fine", {"prompt_token_ids": [5] * 500}], SamplingParams(max_tokens=50))
    with pytest.raises(RequestError, match=r"token ids must be in \[0, "):
        llm.generate({"prompt_token_ids": [10**6]})
    assert not llm.engine.has_unfinished_requests()
    assert _request_pages(llm.engine) == 0


def test_abort_frees_everything_at_once(llm: LLM) -> None:
    core = llm.engine
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    core.add_request("keep", llm.get_tokenizer().encode("keep going"), params)
    core.add_request("drop", [7] * 100, params)
    for _ in range(3):
        core.step()
    held = _request_pages(core)
    output = core.abort_request("drop")
    assert output is not None and output.finished
    assert output.outputs[0].finish_reason == "abort"
    assert _request_pages(core) == held - 7  # 100 prompt + 3 tokens in blocks of 16
    assert core.abort_request("drop") is None
    core.abort_request("keep")
    assert _request_pages(core) == 0


async def test_async_engine_streams_and_aborts(model_dir: Path) -> None:
    engine = await AsyncEngine.create(EngineConfig(model=model_dir, device="cpu", kv_budget=16 * 2**20))
    try:
        outputs = [
            o
            async for o in engine.generate(
                "Stream me", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "s1"
            )
        ]
        assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4, 5, 6]
        assert outputs[-1].finished and not outputs[0].finished
        assert outputs[-1].outputs[0].text.startswith(outputs[2].outputs[0].text)

        with pytest.raises(ContextLengthExceeded):
            async for _ in engine.generate([3] * 5000, SamplingParams()):
                pass

        stream = engine.generate("Long one", SamplingParams(max_tokens=400, ignore_eos=True), "s2")
        async for first in stream:
            assert not first.finished
            break
        await stream.aclose()  # a consumer that goes away aborts its request

        async def released() -> bool:
            state = engine.state()
            return state.num_running == 0 and state.pool.by_kind["kv"] == state.pool.num_evictable

        await wait_for_async(released, 2, what="the aborted request's pages")
        state = engine.state()
        assert state.pool.by_kind["kv"] == state.pool.num_evictable == state.prefix_cache_blocks
        assert engine.is_healthy
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("abort_first", [False, True])
async def test_a_step_takes_only_arrivals_between_its_layers_and_keeps_the_commands_order(
    model_dir: Path, abort_first: bool
) -> None:
    """Issue 37, point 4: between two layers of a long step the engine thread takes newly submitted requests (and
    runs them in a step of their own: EngineCore.step's interleaved steps); an abort must wait for the step's end,
    since the step is computing for the request it would free, and so does every command queued behind it."""
    import threading

    engine = await AsyncEngine.create(
        EngineConfig(model=model_dir, device="cpu", kv_budget=16 * 2**20, max_num_batched_tokens=512)
    )
    gate = threading.Event()
    take_arrivals = engine._take_arrivals

    def gated() -> bool:  # the first layer boundary of the flood's step waits until the commands are queued
        gate.wait(10)
        return take_arrivals()

    engine._take_arrivals = gated  # type: ignore[method-assign]
    try:
        flood = engine.submit(
            list(range(4, 1004)), SamplingParams(max_tokens=2, ignore_eos=True), "a", fairness_key="a"
        )
        await wait_for_async(lambda: _running(engine), 5, what="the flood's step")
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        if abort_first:
            await engine.abort("a")
        light = engine.submit([7, 8, 9], params, "b", fairness_key="b")
        if not abort_first:
            await engine.abort("a")
        gate.set()
        outputs = [o async for o in light]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2
        flood_outputs = [o async for o in flood]
        assert flood_outputs[-1].outputs[0].finish_reason == "abort"
        # Taken mid-step only when nothing waited before it; either way the flood's step ran to its end first.
        assert engine.state().num_interleaved_steps == (0 if abort_first else 1)
        assert engine.is_healthy
    finally:
        gate.set()
        await engine.shutdown()


async def _running(engine: AsyncEngine) -> bool:
    return bool(engine.core.scheduler.running)
