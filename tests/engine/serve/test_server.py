"""The engine's OpenAI-compatible server, on a real uvicorn socket, driven by the `openai` SDK and httpx.

One tiny random model and one server serve the whole module. The model's text is gibberish, so tests compare the
server with itself (streamed vs not, token ids vs text) and with the engine's tokenizer, using greedy sampling
and ignore_eos so the outputs are deterministic and as long as asked.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
from _support.checkpoints import tiny_spec
from _support.engine_server import running_engine_server
from _support.waiting import poll
from litestar import Litestar

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_state import EngineState
from loraplex.engine.memory.page_pool import PoolUsage
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.metrics import EngineMetrics
from loraplex.engine.serve.server import create_engine_app
from loraplex.engine.tools.demo import write_random_model
from loraplex.kernels import native
from loraplex.kernels.paths import cpu_matmul

pytestmark = pytest.mark.unit

TINY = tiny_spec(max_position_embeddings=1024)
MODEL = "tiny"
# Long enough that a generation to the end of the context takes seconds, for the disconnect tests.
MAX_MODEL_LEN = 1024
GREEDY: dict[str, Any] = {"temperature": 0}
NO_EOS: dict[str, Any] = {"ignore_eos": True}  # vLLM's extra: outputs run to max_tokens


@dataclass(frozen=True)
class Server:
    url: str
    tokenizer: Tokenizer

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=30)

    def state(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/state")
        assert response.status_code == 200
        body: dict[str, Any] = response.json()
        return body

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics").text
        match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


def _running_server(config: EngineConfig) -> contextlib.AbstractContextManager[tuple[str, AsyncEngine]]:
    """An engine and its app on a uvicorn server, in a thread with its own event loop, as in production."""

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine)

    return running_engine_server(config, app)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("server-model"), TINY)


def _config(model_path: Path) -> EngineConfig:
    # Two threads: this model is so small that more only add synchronization (5x slower steps with 16).
    return EngineConfig(
        model=model_path,
        device="cpu",
        kv_budget=2**20,
        max_model_len=MAX_MODEL_LEN,
        served_model_name=MODEL,
        num_threads=2,
    )


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[Server]:
    with _running_server(_config(model_path)) as (url, _):
        yield Server(url, Tokenizer.from_dir(model_path))


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _sse_events(body: str) -> list[str]:
    """The `data:` payloads of an event stream, checking OpenAI's exact framing on the way."""
    assert "\r" not in body
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")
    assert events[-1] == ""
    assert all(event.startswith("data: ") and "\n" not in event for event in events[:-1])
    return [event.removeprefix("data: ") for event in events[:-1]]


# --- completions -------------------------------------------------------------------------------------------------


def test_completion_of_text_and_of_its_token_ids_agree(server: Server) -> None:
    client = server.client()
    prompt = "The quick brown fox"
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY, extra_body=NO_EOS)
    ids = server.tokenizer.encode(prompt)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY, extra_body=NO_EOS)

    assert by_text.id.startswith("cmpl-")
    assert by_text.object == "text_completion"
    assert by_text.model == MODEL
    assert abs(by_text.created - time.time()) < 60
    [choice] = by_text.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.text == by_ids.choices[0].text
    assert by_text.usage is not None
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == 8
    assert by_text.usage.total_tokens == len(ids) + 8
    assert by_text.usage.prompt_tokens_details is not None
    assert by_text.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_default_to_16_tokens(server: Server) -> None:
    response = server.client().completions.create(model=MODEL, prompt="Once upon", **GREEDY, extra_body=NO_EOS)
    assert response.usage is not None
    assert response.usage.completion_tokens == 16
    assert response.choices[0].finish_reason == "length"


def test_batch_prompt_gives_one_choice_per_prompt_in_order(server: Server) -> None:
    client = server.client()
    prompts = ["It was a dark", "and stormy night; the rain"]
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, **GREEDY, extra_body=NO_EOS) for p in prompts
    ]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, **GREEDY, extra_body=NO_EOS)

    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    assert batch.usage.completion_tokens == 12

    ids = [server.tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY, extra_body=NO_EOS)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]


def test_streamed_batch_tags_chunks_with_the_prompt_index(server: Server) -> None:
    client = server.client()
    prompts = ["Alpha beta", "gamma delta epsilon"]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, **GREEDY, extra_body=NO_EOS)
    stream = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, stream=True, **GREEDY, extra_body=NO_EOS
    )
    texts = ["", ""]
    finished: list[int] = []
    for chunk in stream:
        [choice] = chunk.choices
        assert choice.index not in finished, "a choice's finish_reason chunk must be its last"
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished.append(choice.index)
    assert sorted(finished) == [0, 1]
    assert texts == [c.text for c in whole.choices]


def test_max_tokens_ends_with_length(server: Server) -> None:
    response = server.client().completions.create(
        model=MODEL, prompt="Count:", max_tokens=3, **GREEDY, extra_body=NO_EOS
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None
    assert response.usage.completion_tokens == 3


def _stop_candidate(text: str) -> str:
    """A short piece of `text`, past its start, that is plain text (no partial characters)."""
    for start in range(len(text) // 3, len(text) - 2):
        piece = text[start : start + 2]
        if "\ufffd" not in piece and piece.strip():
            return piece
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_strings_end_the_text_and_never_appear_in_it(server: Server) -> None:
    client = server.client()
    prompt = "Stop right there"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY, extra_body=NO_EOS)
    text = free.choices[0].text
    stop = _stop_candidate(text)
    expected = text[: text.index(stop)]

    stopped = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, stop=[stop, "never-generated"], **GREEDY, extra_body=NO_EOS
    )
    [choice] = stopped.choices
    assert choice.text == expected
    assert stop not in choice.text
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra.get("stop_reason") == stop

    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, stop=stop, stream=True, **GREEDY, extra_body=NO_EOS
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_completion_logprobs_shape(server: Server) -> None:
    response = server.client().completions.create(
        model=MODEL, prompt="Probabilities", max_tokens=5, logprobs=3, **GREEDY, extra_body=NO_EOS
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 5
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == 5
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) == 5
    for token, sampled, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        # The top 3 and the sampled token, keyed by text (so fewer when two ids decode alike, as byte tokens do).
        assert top is not None and 1 <= len(top) <= 4
        assert sampled == pytest.approx(max(top.values()))  # greedy takes the most likely token
        assert top[token] == pytest.approx(sampled)
    assert max(len(top or {}) for top in logprobs.top_logprobs) >= 3
    assert logprobs.text_offset == sorted(logprobs.text_offset or [])


def test_echo_prepends_the_prompt(server: Server) -> None:
    client = server.client()
    plain = client.completions.create(model=MODEL, prompt="Echo, echo", max_tokens=4, **GREEDY, extra_body=NO_EOS)
    echoed = client.completions.create(
        model=MODEL, prompt="Echo, echo", max_tokens=4, echo=True, **GREEDY, extra_body=NO_EOS
    )
    assert echoed.choices[0].text == "Echo, echo" + plain.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt="Echo, echo", max_tokens=4, echo=True, stream=True, **GREEDY, extra_body=NO_EOS
    )
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_logprobs_over_five_are_refused_for_completions(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=6)
    assert _error(info.value)["param"] == "logprobs"


# --- chat --------------------------------------------------------------------------------------------------------

MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "something."}]},
]


def test_chat_completion(server: Server) -> None:
    response = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=10, **GREEDY, extra_body=NO_EOS
    )
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    flat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    prompt_ids = server.tokenizer.encode_chat(flat)
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 10
    assert response.usage.total_tokens == len(prompt_ids) + 10


def test_chat_stream_matches_the_non_streamed_answer(server: Server) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, **GREEDY, "extra_body": NO_EOS}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))

    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    assert chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and whole.usage is not None
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()
    finish = [c.choices[0].finish_reason for c in content_chunks]
    assert finish[-1] == "length"
    assert all(reason is None for reason in finish[:-1])
    assert all(c.usage is None for c in content_chunks)
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content


def test_chat_stream_framing_is_exactly_openais(server: Server) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True, **GREEDY, **NO_EOS}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1] or chunks[-1]["usage"] is None  # no usage chunk unless asked


def test_chat_logprobs_shape(server: Server) -> None:
    response = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY, extra_body=NO_EOS
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 4
    for entry in logprobs.content:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_developer_role_and_unknown_fields_are_accepted(server: Server) -> None:
    response = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=2,
        user="someone",
        extra_body={"some_future_field": {"x": 1}},
    )
    assert response.choices[0].finish_reason in ("stop", "length")


# --- errors ------------------------------------------------------------------------------------------------------


def test_n_choices_streamed_or_not_count_the_prompt_once(server: Server) -> None:
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=6, seed=4, extra_body=NO_EOS)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) > 1  # each choice its own seed stream
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, seed=4, extra_body=NO_EOS)
    assert chat.usage is not None and single.usage is not None
    assert chat.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
    assert chat.usage.completion_tokens == 3 * 6  # every choice's tokens
    assert chat.choices[0].message.content == single.choices[0].message.content  # choice 0 is seed 4 itself
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, max_tokens=6, seed=4, stream=True, stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )  # fmt: skip
    texts = ["", "", ""]
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in chat.choices]
    assert usage is not None and usage.completion_tokens == 18 and usage.prompt_tokens == chat.usage.prompt_tokens
    completions = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=3, extra_body=NO_EOS)
    assert [c.index for c in completions.choices] == [0, 1, 2, 3]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=0, max_tokens=2)
    assert _error(info.value)["param"] == "n"


def test_unknown_model_is_404_model_not_found(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        server.client().chat.completions.create(model="gpt-7", messages=MESSAGES, max_tokens=2)
    assert _error(info.value)["code"] == "model_not_found"


def test_prompt_longer_than_the_context_is_refused(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * (MAX_MODEL_LEN + 1), max_tokens=1)
    error = _error(info.value)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    long_message: list[Any] = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long_message)
    assert _error(info.value)["code"] == "context_length_exceeded"


def test_invalid_temperature_names_the_field(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1, max_tokens=2)
    assert _error(info.value)["param"] == "temperature"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"100000": 10}}, "logit_bias"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"fairness_weight": 0}, "fairness_weight"),
        ({"priority": "high"}, "priority"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),  # a tool turn needs its tool_call_id
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
        ({"messages": []}, "messages"),
        ({"max_tokens": "many"}, "max_tokens"),
    ],
)
def test_unsupported_or_malformed_chat_fields_are_400(server: Server, extra: dict[str, Any], param: str | None) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    else:
        assert error["param"].startswith("messages[0].content")


def test_routing_and_body_errors_use_the_openai_envelope(server: Server) -> None:
    bad_json = httpx.post(
        f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400
    assert set(bad_json.json()["error"]) == {"message", "type", "param", "code"}
    missing = httpx.post(f"{server.url}/v1/audio/speech", json={})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "unknown_url"
    wrong_method = httpx.get(f"{server.url}/v1/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"


# --- operations --------------------------------------------------------------------------------------------------


def test_models_lists_the_served_model(server: Server) -> None:
    models = server.client().models.list()
    [card] = models.data
    assert card.id == MODEL
    assert card.object == "model"
    assert card.owned_by == "loraplex"
    assert card.model_extra is not None and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    # A dense base runs every parameter for every token (tests/engine/model/test_moe.py has an MoE base's counts).
    assert card.model_extra["parameters"] == card.model_extra["active_parameters"] > 0
    assert server.client().models.retrieve(MODEL).model_dump() == card.model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        server.client().models.retrieve("org/not-served")
    assert _error(info.value)["code"] == "model_not_found"


def test_healthz(server: Server) -> None:
    response = httpx.get(f"{server.url}/healthz")
    assert response.status_code == 200


def test_state_reports_load_and_pool(server: Server) -> None:
    state = server.state()
    assert state["model"] == MODEL
    assert state["max_model_len"] == MAX_MODEL_LEN
    assert state["num_waiting"] == 0
    assert state["num_running"] == 0
    assert state["num_preemptions"] == 0
    pool = state["pool"]
    assert pool["num_pages"] > 0
    # Nothing runs: every page is free or an idle prefix-cache block (earlier tests' prompts).
    assert pool["num_free"] + pool["num_evictable"] == pool["num_pages"]
    assert pool["page_bytes"] > 0
    assert pool["by_kind"] == {"kv": state["prefix_cache"]["blocks"], "adapter": 0}
    assert pool["num_evictable"] == state["prefix_cache"]["blocks"]


def test_state_and_metrics_say_which_path_each_operator_runs(server: Server) -> None:
    """The tiny model is float32 on the CPU: its decode attention and LoRA run the native level this CPU loaded
    (the test session builds it: `make native`), or torch where none is."""
    expected = native.status().path
    assert expected == "torch" or expected.startswith("native/x86-64") or expected == "native/armv8-a"
    # and its float32 matmuls the library this CPU's vendor runs fastest (decision 0055).
    matmul = cpu_matmul()
    assert server.state()["operators"] == {"paged_attention": expected, "lora": expected, "matmul": matmul}
    for operator, path in (("paged_attention", expected), ("lora", expected), ("matmul", matmul)):
        assert server.metric("loraplex_engine_operator_path", f'{{operator="{operator}",path="{path}"}}') == 1


def test_metrics_count_requests_and_tokens(server: Server) -> None:
    before_length = server.metric("loraplex_engine_requests_total", '{finish_reason="length"}')
    before_generated = server.metric("loraplex_engine_generation_tokens_total")
    before_prompt = server.metric("loraplex_engine_prompt_tokens_total")
    before_ttft = server.metric("loraplex_engine_time_to_first_token_seconds_count")
    response = server.client().completions.create(model=MODEL, prompt="Metered", max_tokens=5, extra_body=NO_EOS)
    assert response.usage is not None

    assert server.metric("loraplex_engine_requests_total", '{finish_reason="length"}') == before_length + 1
    assert server.metric("loraplex_engine_generation_tokens_total") == before_generated + 5
    assert server.metric("loraplex_engine_prompt_tokens_total") == before_prompt + response.usage.prompt_tokens
    assert server.metric("loraplex_engine_time_to_first_token_seconds_count") == before_ttft + 1
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "loraplex_engine_request_latency_seconds_bucket",
        "loraplex_engine_num_requests_running",
        "loraplex_engine_num_requests_waiting",
        "loraplex_engine_pool_pages_free",
        'loraplex_engine_pool_pages_used{kind="kv"}',
        "loraplex_engine_preemptions_total",
    ):
        assert name in text


def test_cache_salt_isolates_the_prefix_cache_and_metrics_show_hits(server: Server) -> None:
    prompt = [5 + (i * 7) % 200 for i in range(3 * 16 + 4)]  # three full blocks and a few tokens
    hits_before = server.metric("loraplex_engine_prefix_cache_hit_tokens_total", '{adapter=""}')
    queried_before = server.metric("loraplex_engine_prefix_cache_queried_tokens_total", '{adapter=""}')

    def cached(salt: str) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("salt-a") == 0
    assert cached("salt-b") == 0
    assert cached("salt-a") == 3 * 16
    assert server.metric("loraplex_engine_prefix_cache_hit_tokens_total", '{adapter=""}') == hits_before + 48
    assert server.metric("loraplex_engine_prefix_cache_queried_tokens_total", '{adapter=""}') == queried_before + 3 * 52
    state = server.state()["prefix_cache"]
    assert state["blocks"] >= 6 and state["hit_tokens"] >= 48
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def _pages_freed(server: Server) -> bool:
    state = server.state()
    idle = state["pool"]["by_kind"]["kv"] == state["pool"]["num_evictable"]  # only idle prefix-cache blocks left
    return bool(idle and state["num_running"] == 0 and state["num_waiting"] == 0)


def test_client_disconnecting_mid_stream_aborts_its_request(server: Server) -> None:
    aborted = server.metric("loraplex_engine_requests_total", '{finish_reason="abort"}')
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 1000, "stream": True, **NO_EOS}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line in (next(lines), next(lines), next(lines)) if line]
        assert received and received[0].startswith("data: ")
        pool = server.state()["pool"]
        assert pool["by_kind"]["kv"] > pool["num_evictable"]  # it is still generating
    assert poll(lambda: _pages_freed(server))
    assert server.metric("loraplex_engine_requests_total", '{finish_reason="abort"}') == aborted + 1


def test_client_giving_up_on_a_non_streaming_request_aborts_it(server: Server) -> None:
    aborted = server.metric("loraplex_engine_requests_total", '{finish_reason="abort"}')
    body = {"model": MODEL, "prompt": "Tell me more", "max_tokens": 1000, **NO_EOS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    assert poll(lambda: _pages_freed(server))
    assert server.metric("loraplex_engine_requests_total", '{finish_reason="abort"}') == aborted + 1


def test_the_server_still_serves_after_aborts(server: Server) -> None:
    response = server.client().completions.create(model=MODEL, prompt="Again", max_tokens=2)
    assert response.choices[0].finish_reason in ("stop", "length")


def test_each_app_has_its_own_metrics_registry() -> None:
    # A process-wide registry would refuse the second app's series (duplicated timeseries).
    state = EngineState(
        num_waiting=0,
        num_running=0,
        pool=PoolUsage(num_pages=4, num_free=4, page_bytes=1, by_kind={}),
        num_preemptions=0,
        num_steps=0,
    )
    first = EngineMetrics(lambda: state, lambda: True)
    second = EngineMetrics(lambda: state, lambda: True)
    assert b"loraplex_engine_pool_pages_free 4.0" in first.render()
    assert b"loraplex_engine_pool_pages_free 4.0" in second.render()


def test_a_failed_engine_ends_streams_with_an_error_event_then_answers_503(model_path: Path) -> None:
    with _running_server(_config(model_path)) as (url, engine):
        real_step = engine.core.step
        num_steps = 0

        def failing_step() -> list[Any]:
            nonlocal num_steps
            num_steps += 1
            if num_steps > 3:
                raise RuntimeError("simulated device failure")
            return real_step()

        engine.core.step = failing_step  # type: ignore[method-assign]
        body = {"model": MODEL, "prompt": "Doomed", "max_tokens": 50, "stream": True, **NO_EOS}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            events = _sse_events(response.read().decode())
        *chunks, error, done = events
        assert done == "[DONE]"
        assert all("choices" in json.loads(c) for c in chunks)
        assert json.loads(error)["error"]["type"] == "server_error"

        assert httpx.get(f"{url}/healthz").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "server_error"


# --- structured outputs and sampling extras through the server ------------------------------------------------------


class Person(pydantic.BaseModel):
    """What the `openai` SDK's parse helper turns into a strict json_schema response format."""

    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)
    role: Literal["admin", "user"]


def test_sdk_parse_returns_the_parsed_object(server: Server) -> None:
    client = server.client()
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=120, temperature=1.0, seed=seed
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person)
        assert message.parsed == Person.model_validate_json(message.content or "")


def test_sdk_stream_helper_parses_the_streamed_object(server: Server) -> None:
    with server.client().chat.completions.stream(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=120, temperature=1.0, seed=5
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1
    assert isinstance(final.choices[0].message.parsed, Person)
    assert "".join(deltas) == final.choices[0].message.content


def test_json_object_and_vllm_guided_fields(server: Server) -> None:
    client = server.client()
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=8, max_tokens=200, temperature=1.0, seed=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    finished = [c.message.content or "" for c in chat.choices if c.finish_reason == "stop"]
    assert finished  # a random model under "any object" finishes now and then; what it finishes is an object
    assert all(isinstance(json.loads(text), dict) for text in finished)
    choice = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=8, extra_body={"guided_choice": ["left", "right"]}
    )
    assert choice.choices[0].text in ("left", "right")
    regex = client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=12, extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"}
    )
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", regex.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for body in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        out = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=20, extra_body=body)
        assert isinstance(json.loads(out.choices[0].text)["ok"], bool)


def test_a_schema_keyword_it_cannot_enforce_is_a_400_naming_it(server: Server) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
    }
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            response_format=response_format,  # type: ignore[arg-type]
        )
    error = _error(info.value)
    assert error["param"] == "response_format.json_schema.schema"
    assert "'uniqueItems'" in error["message"]


def test_logit_bias_and_penalties_are_honoured(server: Server) -> None:
    client = server.client()
    token = server.tokenizer.encode("a", add_special_tokens=False)[0]
    forced = client.completions.create(
        model=MODEL, prompt="x", max_tokens=6, temperature=1.0, logit_bias={str(token): 100}, extra_body=NO_EOS
    )
    assert forced.choices[0].text == "a" * 6
    plain = client.completions.create(model=MODEL, prompt="x", max_tokens=24, extra_body={**GREEDY, **NO_EOS})
    penalized = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=24,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={**GREEDY, **NO_EOS, "repetition_penalty": 1.5},
    )
    assert penalized.choices[0].text != plain.choices[0].text
