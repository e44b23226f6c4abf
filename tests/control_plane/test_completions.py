"""Tenant completions end to end: the `openai` package against the platform on a real uvicorn socket, with the
engine in process (embedded mode) on a tiny random Llama, and real Postgres, Redis and S3 behind it.

One platform serves the whole module; each test makes the tenants it needs, so usage rows and rate limits never
mix. The model's text is gibberish, so tests compare the platform with itself (streamed vs not, adapter vs base)
and with transformers + peft, using greedy sampling so outputs are deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
import torch
from _support import services
from _support.adapters import make_peft_adapter
from _support.services import PostgresServer, RedisServer, S3Server
from _support.waiting import wait_for
from litestar import Litestar
from sqlalchemy import text

from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, module_settings_sync, serving

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_MODEL_LEN = 1024
OTHER_BASE = "unserved-base"  # registered, but no engine serves it
ENDPOINT = "support-bot"
GREEDY: dict[str, Any] = {"temperature": 0}
PROMPT = "Summarize the ticket below for the on-call engineer, in one short paragraph please."
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]


# --- the platform on a socket -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass(frozen=True)
class Platform:
    url: str
    app: Litestar
    base_model: str  # what the embedded engine serves
    tokenizer: Tokenizer

    @property
    def resources(self) -> Resources:
        value: Resources = self.app.state.resources
        return value

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def async_client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, f"{self.url}{path}", headers=ADMIN, timeout=30, **kwargs)

    def get(self, tenant: Tenant, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=tenant.headers, timeout=30, **kwargs)

    def post(self, tenant: Tenant, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", headers=tenant.headers, **{"timeout": 60, **kwargs})

    def make_tenant(self) -> Tenant:
        response = self.admin("POST", "/admin/tenants", json={"name": f"tenant-{secrets.token_hex(4)}"})
        assert response.status_code == 201, response.text
        tenant_id = response.json()["id"]
        response = self.admin("POST", f"/admin/tenants/{tenant_id}/api-keys", json={"name": "k"})
        assert response.status_code == 201, response.text
        return Tenant(tenant_id, response.json()["key"])

    def upload_adapter(self, tenant: Tenant, folder: Path, name: str) -> dict[str, Any]:
        files = {
            CONFIG_FILE: (CONFIG_FILE, (folder / CONFIG_FILE).read_bytes()),
            WEIGHTS_FILE: (WEIGHTS_FILE, (folder / WEIGHTS_FILE).read_bytes()),
        }
        response = self.post(tenant, "/v1/adapters", data={"name": name, "base_model": self.base_model}, files=files)
        assert response.status_code == 201, response.text
        adapter: dict[str, Any] = response.json()
        assert adapter["status"] == "ready", adapter
        return adapter

    def make_endpoint(self, tenant: Tenant, name: str, base_model: str, adapter_id: str | None = None) -> None:
        body = {"name": name, "base_model": base_model, "adapter_id": adapter_id}
        response = self.post(tenant, "/v1/endpoints", json=body)
        assert response.status_code == 201, response.text

    def usage_rows(self, tenant: Tenant) -> list[dict[str, Any]]:
        response = self.get(tenant, "/v1/usage", params={"limit": 100})
        assert response.status_code == 200, response.text
        rows: list[dict[str, Any]] = response.json()["data"]
        return rows


@contextlib.contextmanager
def _serving(app: Litestar) -> Iterator[str]:
    """`serving`, giving the rest of the session torch's thread count back (the engine sets it process-wide)."""
    num_threads = torch.get_num_threads()
    try:
        with serving(app) as url:
            yield url
    finally:
        torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
    tiny_base_checkpoint: Path,
) -> Iterator[Settings]:
    """Settings on a database, Redis prefix and bucket of this module's own, and the embedded engine on the tiny
    checkpoint with a small page pool."""
    with module_settings_sync(
        tmp_path_factory.mktemp("data"),
        postgres_server,
        redis_server,
        s3_server,
        session_tag,
        engine_mode="embedded",
        engine_model=str(tiny_base_checkpoint),
        engine_dtype="float32",
        engine_max_model_len=MAX_MODEL_LEN,
        engine_kv_budget="8MiB",
    ) as value:
        yield value


@pytest.fixture(scope="module")
def platform(settings: Settings, tiny_base_checkpoint: Path) -> Iterator[Platform]:
    app = create_app(settings)
    with _serving(app) as url:
        resources: Resources = app.state.resources
        assert resources.embedded_engine is not None
        base_model = resources.embedded_engine.core.served_model_name
        value = Platform(url, app, base_model, Tokenizer.from_dir(tiny_base_checkpoint))
        # A second base model, registered but served by no engine.
        response = value.admin(
            "POST", "/admin/base-models", json={"name": OTHER_BASE, "source": str(tiny_base_checkpoint)}
        )
        assert response.status_code == 201, response.text
        yield value


@pytest.fixture(scope="module")
def adapter_dir(tiny_base_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random PEFT adapter on every projection, strong enough (alpha / r = 8) to change greedy outputs."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    out = tmp_path_factory.mktemp("adapter") / "support"
    return make_peft_adapter(tiny_base_checkpoint, out, seed=11, r=4, lora_alpha=32, target_modules=targets)


@dataclass(frozen=True)
class Owner:
    """The tenant that owns ENDPOINT (an endpoint over the adapter)."""

    tenant: Tenant
    adapter: dict[str, Any]


@pytest.fixture(scope="module")
def owner(platform: Platform, adapter_dir: Path) -> Owner:
    tenant = platform.make_tenant()
    adapter = platform.upload_adapter(tenant, adapter_dir, "support")
    platform.make_endpoint(tenant, ENDPOINT, platform.base_model, adapter["id"])
    return Owner(tenant, adapter)


# --- helpers ----------------------------------------------------------------------------------------------------


def envelope(exc: openai.APIStatusError) -> dict[str, Any]:
    """The OpenAI error envelope of a refused request: exactly {message, type, param, code}."""
    body = exc.response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def same_counts(usage: Any, other: Any) -> bool:
    """Whether two usages of the same request count the same tokens; the second run may find the first's prompt in
    the prefix cache, so cached_tokens may differ (but never exceeds the prompt)."""
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    return bool(
        (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
        == (other.prompt_tokens, other.completion_tokens, other.total_tokens)
    )


def usage_status(finish_reason: str | None) -> str:
    return "ok" if finish_reason == "stop" else str(finish_reason)


def hf_greedy(base: Path, adapter: Path | None, prompt_ids: list[int], max_tokens: int, tokenizer: Tokenizer) -> str:
    """The text transformers (+ peft) generates greedily from `prompt_ids`, stopping where the engine would."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    eos = sorted(tokenizer.eos_token_ids)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    new = [int(t) for t in out[0, len(prompt_ids) :]]
    for index, token in enumerate(new):
        if token in eos:
            new = new[:index]
            break
    return tokenizer.decode(new)


# --- chat and completions through the openai package --------------------------------------------------------


def test_chat_through_an_endpoint_answers_in_openais_shape(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    response = client.chat.completions.create(
        model=ENDPOINT, messages=MESSAGES, max_completion_tokens=12, logprobs=True, top_logprobs=3, **GREEDY
    )
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == ENDPOINT  # the name the client used, not the engine's
    [choice] = response.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None
    assert usage.prompt_tokens == len(platform.tokenizer.encode_chat(MESSAGES))
    assert 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= usage.prompt_tokens
    # logprobs and top_logprobs reach the engine: one entry per token, 3 alternatives each, and greedy picks the
    # likeliest one.
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == usage.completion_tokens
    for token in choice.logprobs.content:
        assert len(token.top_logprobs) == 3
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-4)


@pytest.mark.parametrize("use_endpoint", [True, False], ids=["endpoint", "base-model"])
def test_streamed_chat_is_the_answer_in_chunks_ending_with_usage(
    platform: Platform, owner: Owner, use_endpoint: bool
) -> None:
    model = ENDPOINT if use_endpoint else platform.base_model
    client = platform.client(owner.tenant.key)
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {c.model for c in chunks} == {model}
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"  # the role comes first
    finishes = [c.choices[0].finish_reason for c in content]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    # include_usage: usage on a last chunk of its own, with no choices, and on no other chunk
    assert last.choices == []
    assert last.usage is not None and whole.usage is not None
    assert same_counts(last.usage, whole.usage)
    assert all(c.usage is None for c in content)


def test_on_the_wire_answers_are_200_and_streams_plain_sse_ending_with_done(platform: Platform, owner: Owner) -> None:
    for path, ask in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": PROMPT})):
        response = platform.post(owner.tenant, path, json={"model": ENDPOINT, "max_tokens": 2, **ask})
        assert response.status_code == 200, response.text  # OpenAI's status: not 201
        assert response.headers["x-request-id"] == response.json()["id"]  # the key of its usage row
    body = {"model": ENDPOINT, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", f"{platform.url}/v1/chat/completions", json=body, headers=owner.tenant.headers, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        request_id = response.headers["x-request-id"]
        raw = response.read().decode()
    assert "\r" not in raw
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {request_id}
    assert all(e.startswith("data: {") for e in events[:-1])
    # No usage asked for, none sent: every chunk has its choice.
    assert all(len(c["choices"]) == 1 and c.get("usage") is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_streamed_and_not(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    whole = client.completions.create(model=ENDPOINT, prompt=PROMPT, max_tokens=10, logprobs=2, **GREEDY)
    assert whole.id.startswith("cmpl-")
    assert whole.object == "text_completion"
    assert whole.model == ENDPOINT
    [choice] = whole.choices
    assert choice.finish_reason in ("stop", "length")
    usage = whole.usage
    assert usage is not None
    assert usage.prompt_tokens == len(platform.tokenizer.encode(PROMPT))
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert len(choice.logprobs.tokens) == usage.completion_tokens
    chunks = list(
        client.completions.create(
            model=ENDPOINT,
            prompt=PROMPT,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    *content, last = chunks
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in content) == choice.text
    assert content[-1].choices[0].finish_reason == choice.finish_reason
    assert last.choices == [] and last.usage is not None
    assert same_counts(last.usage, usage)


def test_an_endpoint_runs_its_adapter(
    platform: Platform, owner: Owner, adapter_dir: Path, tiny_base_checkpoint: Path
) -> None:
    client = platform.client(owner.tenant.key)
    prompt_ids = platform.tokenizer.encode("An adapter changes what the model says next:")
    via_endpoint = client.completions.create(model=ENDPOINT, prompt=prompt_ids, max_tokens=12, **GREEDY)
    via_base = client.completions.create(model=platform.base_model, prompt=prompt_ids, max_tokens=12, **GREEDY)
    assert via_endpoint.choices[0].text != via_base.choices[0].text
    # And each is what transformers (+ peft) computes with the same weights.
    tokenizer = platform.tokenizer
    assert via_endpoint.choices[0].text == hf_greedy(tiny_base_checkpoint, adapter_dir, prompt_ids, 12, tokenizer)
    assert via_base.choices[0].text == hf_greedy(tiny_base_checkpoint, None, prompt_ids, 12, tokenizer)


def test_sampling_parameters_reach_the_engine(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    ask: dict[str, Any] = {"model": platform.base_model, "prompt": PROMPT, "max_tokens": 16}

    def text(**params: Any) -> str:
        return client.completions.create(**ask, **params).choices[0].text

    greedy = text(temperature=0)
    first, again, other = text(temperature=1.0, seed=7), text(temperature=1.0, seed=7), text(temperature=1.0, seed=8)
    assert first == again  # a seed makes sampling repeatable
    assert first != other and first != greedy  # and it does sample
    # top_p so small that only the likeliest token is left: greedy, whatever the temperature.
    assert text(temperature=1.0, top_p=1e-6, seed=8) == greedy
    # A stop string ends the text before it.
    start = len(greedy) // 3
    stop = next(
        (greedy[i : i + 2] for i in range(start, len(greedy) - 1) if greedy.find(greedy[i : i + 2]) == i),
        None,
    )
    assert stop is not None, f"no stop string to pick from {greedy!r}"
    stopped = client.completions.create(**ask, temperature=0, stop=[stop, "never seen"])
    assert stopped.choices[0].text == greedy[: greedy.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    # max_completion_tokens bounds a chat.
    chat = client.chat.completions.create(model=ENDPOINT, messages=MESSAGES, max_completion_tokens=3, **GREEDY)
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    assert chat.choices[0].finish_reason == "length"


def test_an_endpoints_defaults_apply_unless_the_request_sets_them(platform: Platform, owner: Owner) -> None:
    body = {
        "name": "terse-bot",
        "base_model": platform.base_model,
        "adapter_id": owner.adapter["id"],
        "defaults": {"max_tokens": 3, "temperature": 0},
    }
    response = platform.post(owner.tenant, "/v1/endpoints", json=body)
    assert response.status_code == 201, response.text
    client = platform.client(owner.tenant.key)
    greedy = client.completions.create(model=ENDPOINT, prompt=PROMPT, max_tokens=3, **GREEDY)
    terse = client.completions.create(model="terse-bot", prompt=PROMPT)  # OpenAI's default would be 16 tokens
    assert terse.usage is not None and terse.usage.completion_tokens == 3
    assert terse.choices[0].text == greedy.choices[0].text  # temperature 0 from the defaults
    chat = client.chat.completions.create(model="terse-bot", messages=MESSAGES)
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    longer = client.completions.create(model="terse-bot", prompt=PROMPT, max_tokens=5)
    assert longer.usage is not None and longer.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="terse-bot", messages=MESSAGES, max_completion_tokens=4)
    assert chat.usage is not None and chat.usage.completion_tokens == 4


async def test_concurrent_requests_of_two_tenants_are_batched_without_mixing(platform: Platform, owner: Owner) -> None:
    other = platform.make_tenant()
    prompt_ids = platform.tokenizer.encode("Several tenants at once, one batch:")
    ask: dict[str, Any] = {"prompt": prompt_ids, "max_tokens": 12, **GREEDY}
    sync = platform.client(owner.tenant.key)
    alone = {
        model: sync.completions.create(model=model, **ask).choices[0].text for model in (ENDPOINT, platform.base_model)
    }
    async with platform.async_client(owner.tenant.key) as mine, platform.async_client(other.key) as theirs:
        results = await asyncio.gather(
            mine.completions.create(model=ENDPOINT, **ask),
            theirs.completions.create(model=platform.base_model, **ask),
            mine.completions.create(model=platform.base_model, **ask),
            mine.completions.create(model=ENDPOINT, **ask),
        )
    assert [r.model for r in results] == [ENDPOINT, platform.base_model, platform.base_model, ENDPOINT]
    assert len({r.id for r in results}) == 4
    assert [r.choices[0].text for r in results] == [
        alone[ENDPOINT],
        alone[platform.base_model],
        alone[platform.base_model],
        alone[ENDPOINT],
    ]


def test_cached_prompt_tokens_are_reported_and_never_shared_across_tenants_or_adapters(
    platform: Platform, owner: Owner
) -> None:
    # A prompt of its own (no other test warms it), several blocks long.
    prompt = f"{secrets.token_hex(8)} " + " ".join(f"step {i} of the runbook;" for i in range(40))
    num_prompt = len(platform.tokenizer.encode(prompt))
    assert num_prompt >= 64
    mine = platform.client(owner.tenant.key)
    stranger = platform.client(platform.make_tenant().key)

    def cached(client: openai.OpenAI, model: str) -> int:
        usage = client.completions.create(model=model, prompt=prompt, max_tokens=1).usage
        assert usage is not None and usage.prompt_tokens == num_prompt
        assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None
        return usage.prompt_tokens_details.cached_tokens

    assert cached(mine, platform.base_model) == 0
    warm = cached(mine, platform.base_model)
    assert 0 < warm < num_prompt  # the full blocks of the prompt, computed once and billed apart
    # Another tenant's identical prompt is never served from this tenant's blocks (nor is the adapter's).
    assert cached(stranger, platform.base_model) == 0
    assert cached(mine, ENDPOINT) == 0
    assert cached(mine, ENDPOINT) == warm


# --- models -----------------------------------------------------------------------------------------------------


def test_models_lists_the_tenants_endpoints_and_the_base_models(platform: Platform, owner: Owner) -> None:
    other = platform.make_tenant()
    platform.make_endpoint(other, "their-bot", platform.base_model)
    mine = {m.id: m for m in platform.client(owner.tenant.key).models.list()}
    theirs = {m.id for m in platform.client(other.key).models.list()}
    assert {ENDPOINT, platform.base_model, OTHER_BASE} <= set(mine)
    assert "their-bot" not in mine
    assert {"their-bot", platform.base_model, OTHER_BASE} <= theirs
    assert ENDPOINT not in theirs
    assert all(m.object == "model" for m in mine.values())
    # A base model's card counts its parameters from its config.json: all of them run for each token of a dense one.
    base = mine[platform.base_model].model_extra or {}
    assert base["parameters"] == base["active_parameters"] > 0
    # The SDK's models.retrieve: the same cards one at a time, and another tenant's endpoint is not there.
    client = platform.client(owner.tenant.key)
    assert client.models.retrieve(ENDPOINT).model_dump() == mine[ENDPOINT].model_dump()
    assert client.models.retrieve(platform.base_model).model_dump() == mine[platform.base_model].model_dump()
    for missing in ("their-bot", "no-such-model", "a/b"):
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(missing)
        assert envelope(info.value)["code"] == "model_not_found"


# --- errors -----------------------------------------------------------------------------------------------------


def test_an_invalid_key_is_401(platform: Platform) -> None:
    client = platform.client("lpx_notakey_0123456789abcdef")
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=ENDPOINT, messages=MESSAGES)
    assert info.value.status_code == 401
    assert envelope(info.value)["code"] == "invalid_api_key"


def test_an_unknown_model_and_another_tenants_endpoint_are_both_404(platform: Platform, owner: Owner) -> None:
    stranger = platform.client(platform.make_tenant().key)
    errors = []
    for model in ("no-such-model", ENDPOINT):  # ENDPOINT is the owner's: for anyone else it does not exist
        with pytest.raises(openai.NotFoundError) as info:
            stranger.chat.completions.create(model=model, messages=MESSAGES)
        error = envelope(info.value)
        assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
        assert model in error["message"]
        errors.append(error["message"].replace(model, "M"))
    assert errors[0] == errors[1]  # nothing tells a stranger that the name is taken
    with pytest.raises(openai.NotFoundError):
        stranger.completions.create(model=ENDPOINT, prompt="x", stream=True)


def test_a_prompt_longer_than_the_context_is_400_context_length_exceeded(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    long_text = " ".join(str(i) for i in range(1200))
    assert len(platform.tokenizer.encode(long_text)) > MAX_MODEL_LEN
    attempts: list[Callable[[], Any]] = [
        lambda: client.chat.completions.create(model=ENDPOINT, messages=[{"role": "user", "content": long_text}]),
        lambda: client.chat.completions.create(
            model=ENDPOINT, messages=[{"role": "user", "content": long_text}], stream=True
        ),
        lambda: client.completions.create(model=platform.base_model, prompt=[5] * (MAX_MODEL_LEN + 1)),
        # a completion that cannot fit either, streamed or not
        lambda: client.chat.completions.create(model=ENDPOINT, messages=MESSAGES, max_completion_tokens=5000),
        lambda: client.completions.create(model=ENDPOINT, prompt=PROMPT, max_tokens=999_999, stream=True),
    ]
    for attempt in attempts:
        with pytest.raises(openai.BadRequestError) as info:
            attempt()
        error = envelope(info.value)
        assert error["code"] == "context_length_exceeded", error
        assert str(MAX_MODEL_LEN) in error["message"]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"n": 129}, "n"),
        ({"extra_body": {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}}, "tools"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"logit_bias": {"-1": 5}}, "logit_bias"),
        ({"extra_body": {"response_format": {"type": "json_schema"}}}, "response_format"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"max_tokens": 10**7}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),
        ({"extra_body": {"lora_adapter": {"name": "x", "source": "/etc", "digest": "sha256:" + "0" * 64}}}, None),
        ({"temperature": 3}, "temperature"),
        ({"top_logprobs": 2}, None),  # without logprobs
    ],
    ids=[
        "n",
        "tools",
        "frequency_penalty",
        "logit_bias",
        "json_schema",
        "guided_choice",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "chat_template",
        "lora_adapter",
        "temperature",
        "top_lp",
    ],
)
def test_requests_the_platform_does_not_offer_are_400(
    platform: Platform, owner: Owner, params: dict[str, Any], param: str | None
) -> None:
    client = platform.client(owner.tenant.key)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=ENDPOINT, messages=MESSAGES, **params)
    error = envelope(info.value)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error


def test_refusals_say_what_is_wrong_in_openais_words(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    cases = [
        ({"n": 0}, "greater than or equal to 1"),
        ({"extra_body": {"no_such_field": 1}}, "Unrecognized request argument supplied: no_such_field"),
        ({"extra_body": {"chat_template": "{{ x }}"}}, "the model's own template is used"),
        ({"extra_body": {"tool_choice": "sometimes"}}, "tool_choice"),
    ]
    for params, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=ENDPOINT, messages=MESSAGES, **params)
        assert words in envelope(info.value)["message"]


class Ticket(pydantic.BaseModel):
    """A structured answer, as the `openai` SDK's parse helper asks for it (a strict json_schema)."""

    title: str = pydantic.Field(max_length=8)
    priority: int = pydantic.Field(ge=1, le=5)
    team: Literal["infra", "billing", "support"]


def test_structured_outputs_through_an_adapters_endpoint(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=ENDPOINT, messages=MESSAGES, response_format=Ticket, max_completion_tokens=80, temperature=1.0,
            seed=seed,
        )  # fmt: skip
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(completion.choices[0].message.parsed, Ticket)
    with client.chat.completions.stream(
        model=ENDPOINT,
        messages=MESSAGES,
        response_format=Ticket,
        max_completion_tokens=80,
        temperature=1.0,
        seed=9,
        stream_options={"include_usage": True},
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Ticket)
    assert final.usage is not None and final.usage.completion_tokens > 0
    choice = client.completions.create(
        model=platform.base_model, prompt=PROMPT, max_tokens=8, extra_body={"guided_choice": ["page", "wait"]}
    )
    assert choice.choices[0].text in ("page", "wait")


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}


def test_tool_calls_through_an_adapters_endpoint(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    required = client.chat.completions.create(
        model=ENDPOINT, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=1, max_completion_tokens=120,
    )  # fmt: skip
    [call] = required.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}  # type: ignore[union-attr]
    assert required.choices[0].finish_reason == "tool_calls"
    # auto: the model's own <tool_call> text (held to one by a regex, as a random model writes none) is parsed.
    regex = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,5}", "unit": "f"\}\}</tool_call>'
    ask: dict[str, Any] = {"model": ENDPOINT, "messages": MESSAGES, "tools": [WEATHER_TOOL], "temperature": 0}
    auto = client.chat.completions.create(**ask, max_completion_tokens=80, extra_body={"guided_regex": regex})
    [parsed] = auto.choices[0].message.tool_calls or []
    assert json.loads(parsed.function.arguments)["unit"] == "f"  # type: ignore[union-attr]
    with client.chat.completions.stream(**ask, max_completion_tokens=80, extra_body={"guided_regex": regex}) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls or []
    assert streamed.function.arguments == parsed.function.arguments  # type: ignore[union-attr]
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_schema_the_engine_cannot_enforce_is_a_400_naming_the_keyword(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    response_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"not": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=ENDPOINT,
            messages=MESSAGES,
            response_format=response_format,  # type: ignore[arg-type]
        )
    error = envelope(info.value)
    assert "'not'" in error["message"], error
    assert error["param"] == "response_format.json_schema.schema"


def test_logit_bias_and_penalties_reach_the_engine(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    token = platform.tokenizer.encode("a", add_special_tokens=False)[0]
    forced = client.completions.create(
        model=ENDPOINT, prompt=PROMPT, max_tokens=5, logit_bias={str(token): 100}, extra_body={"min_tokens": 5}
    )
    assert forced.choices[0].text == "a" * 5
    plain = client.completions.create(model=ENDPOINT, prompt=PROMPT, max_tokens=16, **GREEDY)
    penalized = client.completions.create(
        model=ENDPOINT, prompt=PROMPT, max_tokens=16, frequency_penalty=2, presence_penalty=2, **GREEDY,
        extra_body={"repetition_penalty": 1.5},
    )  # fmt: skip
    assert penalized.choices[0].text != plain.choices[0].text


def test_an_oversized_body_is_refused_with_an_envelope(platform: Platform, owner: Owner) -> None:
    client = platform.client(owner.tenant.key)
    huge = [{"role": "user", "content": "x" * (5 * 2**20)}]
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=ENDPOINT, messages=huge)
    assert info.value.status_code == 413
    error = envelope(info.value)
    assert error["code"] == "request_too_large", error
    assert "bytes" in error["message"]


def test_a_tenant_over_its_limits_gets_429_with_retry_after(platform: Platform) -> None:
    tenant = platform.make_tenant()
    response = platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json={"limits": {"requests_per_minute": 2}})
    assert response.status_code == 200, response.text
    client = platform.client(tenant.key)
    for remaining in ("1", "0"):
        raw = client.chat.completions.with_raw_response.create(
            model=platform.base_model, messages=MESSAGES, max_completion_tokens=2
        )
        assert raw.status_code == 200
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert raw.headers["x-ratelimit-remaining-requests"] == remaining
        assert "x-ratelimit-reset-requests" in raw.headers
        assert raw.parse().choices
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=platform.base_model, messages=MESSAGES, max_completion_tokens=2)
    headers = info.value.response.headers
    assert info.value.status_code == 429
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    error = envelope(info.value)
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    # A request larger than a whole minute's token budget is refused outright: waiting would not help.
    response = platform.admin(
        "PATCH", f"/admin/tenants/{tenant.id}", json={"limits": {"requests_per_minute": 100, "tokens_per_minute": 50}}
    )
    assert response.status_code == 200, response.text
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=platform.base_model, prompt="x", max_tokens=100)
    assert "retry-after" not in info.value.response.headers
    assert "too large" in envelope(info.value)["message"].lower()


def test_an_adapter_that_is_not_ready_is_409_wherever_it_is_named(
    platform: Platform, settings: Settings, adapter_dir: Path
) -> None:
    """One rule, one answer: a completion through an endpoint on it and a new endpoint on it are both 409."""
    tenant = platform.make_tenant()
    adapter = platform.upload_adapter(tenant, adapter_dir, "pending")
    platform.make_endpoint(tenant, "pending-bot", platform.base_model, adapter["id"])

    async def set_status(status: str) -> None:
        engine = create_engine(settings.effective_database_url)
        try:
            async with engine.begin() as connection:
                await connection.execute(
                    text("UPDATE adapters SET status = :status WHERE id = :id"), {"status": status, "id": adapter["id"]}
                )
        finally:
            await engine.dispose()

    asyncio.run(set_status("validating"))
    try:
        with pytest.raises(openai.ConflictError) as info:
            platform.client(tenant.key).chat.completions.create(model="pending-bot", messages=MESSAGES)
        assert envelope(info.value)["code"] == "adapter_not_ready"
        body = {"name": "another-bot", "base_model": platform.base_model, "adapter_id": adapter["id"]}
        response = platform.post(tenant, "/v1/endpoints", json=body)
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "adapter_not_ready"
        assert response.json()["error"]["param"] == "adapter_id"
    finally:
        asyncio.run(set_status("ready"))


def test_a_model_no_engine_serves_is_503(platform: Platform, owner: Owner) -> None:
    platform.make_endpoint(owner.tenant, "offline-bot", OTHER_BASE)
    client = platform.client(owner.tenant.key)
    for model in ("offline-bot", OTHER_BASE):
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                client.chat.completions.create(model=model, messages=MESSAGES, stream=stream)
            assert info.value.status_code == 503
            error = envelope(info.value)
            assert (error["code"], error["type"]) == ("engine_unavailable", "server_error")
            assert OTHER_BASE in error["message"]


def test_an_adapter_the_engine_cannot_load_fails_the_request_without_leaking_where_it_is(
    platform: Platform, settings: Settings, s3_server: S3Server, adapter_dir: Path, tmp_path: Path
) -> None:
    tenant = platform.make_tenant()
    # A copy with another config (so another digest: the engine has never loaded it), whose files then vanish.
    folder = tmp_path / "vanishing"
    folder.mkdir()
    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "lora_dropout": 0.01}))
    (folder / WEIGHTS_FILE).write_bytes((adapter_dir / WEIGHTS_FILE).read_bytes())
    adapter = platform.upload_adapter(tenant, folder, "vanishing")
    platform.make_endpoint(tenant, "broken-bot", platform.base_model, adapter["id"])
    s3 = services.s3_client(s3_server)
    try:
        prefix = f"tenants/{tenant.id}/adapters/{adapter['id']}/"
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            s3.delete_object(Bucket=str(settings.s3_bucket), Key=prefix + name)
    finally:
        s3.close()
    client = platform.client(tenant.key)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="broken-bot", messages=MESSAGES, max_completion_tokens=4)
    assert info.value.status_code == 502
    error = envelope(info.value)
    assert (error["type"], error["code"]) == ("server_error", "lora_adapter_load_failed")
    assert "s3://" not in error["message"] and str(settings.s3_bucket) not in error["message"]
    # Streamed: the failure comes after the role chunk, as an error event, and the stream still ends with [DONE].
    body = {"model": "broken-bot", "messages": MESSAGES, "max_tokens": 4, "stream": True}
    response = platform.post(tenant, "/v1/chat/completions", json=body)
    assert response.status_code == 200
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert set(last) == {"error"} and last["error"]["code"] == "lora_adapter_load_failed"
    assert "s3://" not in last["error"]["message"]
    # Both are billed as failed requests, with nothing generated.
    rows = wait_for(lambda: found if len(found := platform.usage_rows(tenant)) >= 2 else None)
    assert [(r["status"], r["completion_tokens"]) for r in rows] == [("error", 0), ("error", 0)]


# --- usage ------------------------------------------------------------------------------------------------------


def test_usage_has_one_row_per_request_with_the_tokens_the_responses_reported(
    platform: Platform, adapter_dir: Path
) -> None:
    tenant = platform.make_tenant()
    adapter = platform.upload_adapter(tenant, adapter_dir, "mine")
    platform.make_endpoint(tenant, "usage-bot", platform.base_model, adapter["id"])
    client = platform.client(tenant.key)
    base = platform.base_model
    expected: dict[str, tuple[str, int, int, int, str]] = {}  # id -> model, prompt, cached, completion, status

    def note(request_id: str, model: str, usage: Any, finish: str | None) -> None:
        cached = usage.prompt_tokens_details.cached_tokens
        expected[request_id] = (model, usage.prompt_tokens, cached, usage.completion_tokens, usage_status(finish))

    chat = client.chat.completions.create(model="usage-bot", messages=MESSAGES, max_completion_tokens=6, **GREEDY)
    note(chat.id, "usage-bot", chat.usage, chat.choices[0].finish_reason)
    chunks = list(
        client.chat.completions.create(
            model=base, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    note(chunks[-1].id, base, chunks[-1].usage, chunks[-2].choices[0].finish_reason)
    text = client.completions.create(model=base, prompt=PROMPT, max_tokens=4, **GREEDY)
    note(text.id, base, text.usage, text.choices[0].finish_reason)
    pieces = list(
        client.completions.create(
            model="usage-bot", prompt=PROMPT, max_tokens=7, stream=True, stream_options={"include_usage": True}
        )
    )
    note(pieces[-1].id, "usage-bot", pieces[-1].usage, pieces[-2].choices[0].finish_reason)
    # Three choices: the prompt billed once, every choice's tokens.
    three = client.chat.completions.create(
        model="usage-bot", messages=MESSAGES, n=3, max_completion_tokens=4, temperature=1.0, seed=2,
        extra_body={"min_tokens": 4},
    )  # fmt: skip
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage is not None and chat.usage is not None
    assert three.usage.prompt_tokens == chat.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 4
    note(three.id, "usage-bot", three.usage, three.choices[0].finish_reason)
    assert len(expected) == 5  # five distinct request ids

    rows = wait_for(lambda: found if len(found := platform.usage_rows(tenant)) >= 5 else None)
    assert len(rows) == 5
    got = {
        r["request_id"]: (r["model"], r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"], r["status"])
        for r in rows
    }
    assert got == expected
    for row in rows:
        assert row["started_at"] <= row["finished_at"]
    totals = platform.get(tenant, "/v1/usage").json()["totals"]
    assert totals == {
        "requests": 5,
        "prompt_tokens": sum(e[1] for e in expected.values()),
        "cached_tokens": sum(e[2] for e in expected.values()),
        "completion_tokens": sum(e[3] for e in expected.values()),
        "reasoning_tokens": 0,  # not a reasoning model (test_completions_reasoning.py has one)
    }


def test_a_client_gone_mid_stream_is_billed_once_for_what_it_was_sent(platform: Platform) -> None:
    tenant = platform.make_tenant()
    engine = platform.resources.embedded_engine
    assert engine is not None
    messages = [{"role": "user", "content": "Tell me everything you know, at length."}]
    max_tokens = MAX_MODEL_LEN - 64
    body = {
        "model": platform.base_model,
        "messages": messages,
        "max_completion_tokens": max_tokens,
        "stream": True,
        "logprobs": True,  # one logprobs entry per token: how the client counts what it received
        **GREEDY,
    }
    request_id = None
    received = 0
    with httpx.stream(
        "POST", f"{platform.url}/v1/chat/completions", json=body, headers=tenant.headers, timeout=30
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            request_id = chunk["id"]
            [choice] = chunk["choices"]
            assert choice["finish_reason"] is None, "the generation ended before the client left"
            received += len((choice.get("logprobs") or {}).get("content") or [])
            if received >= 5:
                break  # and leave: the connection closes here
    assert request_id is not None
    [row] = wait_for(lambda: platform.usage_rows(tenant))
    # The engine stopped generating for it (its request was aborted, not run to max_tokens)...
    wait_for(lambda: engine.state().num_running == 0 and engine.state().num_waiting == 0)
    wait_for(lambda: platform.resources.usage.num_in_flight == 0)  # nothing more is on its way to the ledger
    # ...and it is billed once, for every token it was sent and not for the ones it was not.
    assert platform.usage_rows(tenant) == [row]
    assert row["request_id"] == request_id
    assert row["status"] == "cancelled"
    assert row["prompt_tokens"] == len(platform.tokenizer.encode_chat(messages))
    assert received <= row["completion_tokens"] < max_tokens


def test_a_client_that_gives_up_on_a_non_streamed_request_stops_its_generation(platform: Platform) -> None:
    tenant = platform.make_tenant()
    engine = platform.resources.embedded_engine
    assert engine is not None
    max_tokens = MAX_MODEL_LEN - 64
    body = {
        "model": platform.base_model,
        "messages": [{"role": "user", "content": "Tell me everything you know, at length."}],
        "max_tokens": max_tokens,
        **GREEDY,
    }
    with pytest.raises(httpx.ReadTimeout):
        platform.post(tenant, "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.2))
    [row] = wait_for(lambda: platform.usage_rows(tenant))
    wait_for(lambda: engine.state().num_running == 0 and engine.state().num_waiting == 0)
    assert row["status"] == "cancelled"
    assert row["completion_tokens"] < max_tokens  # aborted, not run to the end for nobody


# --- service tiers and fair share -------------------------------------------------------------------------------


@dataclass
class RecordingEngineClient:
    """The embedded engine's client, keeping every body the platform sends it."""

    inner: Any
    bodies: list[dict[str, Any]]

    def stream(self, path: str, body: dict[str, Any]) -> Any:
        self.bodies.append(json.loads(json.dumps(body)))
        return self.inner.stream(path, body)

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture
def engine_bodies(platform: Platform, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    fleet: Any = platform.resources.fleet
    bodies: list[dict[str, Any]] = []
    monkeypatch.setattr(fleet, "engine_client", RecordingEngineClient(fleet.engine_client, bodies))
    return bodies


def test_a_service_tier_reaches_the_engine_the_answer_and_the_usage_row(
    platform: Platform, engine_bodies: list[dict[str, Any]]
) -> None:
    tenant = platform.make_tenant()
    assert platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json={"fairness_weight": 2.5}).status_code == 200
    client = platform.client(tenant.key)
    ask: dict[str, Any] = {"model": platform.base_model, "messages": MESSAGES, "max_completion_tokens": 3, **GREEDY}
    tiers: dict[str, str] = {}  # request id -> the tier its row must say

    flex = client.chat.completions.create(**ask, service_tier="flex")
    assert flex.service_tier == "flex"
    tiers[flex.id] = "flex"
    chunks = list(
        client.chat.completions.create(**ask, service_tier="flex", stream=True, stream_options={"include_usage": True})
    )
    assert {c.service_tier for c in chunks} == {"flex"}  # every chunk, the usage chunk included
    tiers[chunks[0].id] = "flex"
    # auto, and no tier at all, run on default and say so.
    for params in ({"service_tier": "auto"}, {}):
        answer = client.chat.completions.create(**ask, **params)
        assert answer.service_tier == "default"
        tiers[answer.id] = "default"
    # The SDK's legacy completions take it as an extra field; the answer carries it all the same.
    text = client.completions.create(
        model=platform.base_model, prompt=PROMPT, max_tokens=3, extra_body={"service_tier": "flex"}
    )
    assert text.model_extra is not None and text.model_extra["service_tier"] == "flex"
    tiers[text.id] = "flex"

    # The engine got the resolved tier (it maps it to a priority itself) and the tenant's weight and key; the
    # platform sends no priority of its own.
    assert [b["service_tier"] for b in engine_bodies] == ["flex", "flex", "default", "default", "flex"]
    assert {b["fairness_weight"] for b in engine_bodies} == {2.5}
    assert {b["fairness_key"] for b in engine_bodies} == {tenant.id}
    assert all("priority" not in b for b in engine_bodies)
    rows = wait_for(lambda: found if len(found := platform.usage_rows(tenant)) >= 5 else None)
    assert {r["request_id"]: r["service_tier"] for r in rows} == tiers


def test_a_service_tier_the_tenant_may_not_use_is_400_and_runs_nothing(
    platform: Platform, engine_bodies: list[dict[str, Any]]
) -> None:
    tenant = platform.make_tenant()
    client = platform.client(tenant.key)
    ask: dict[str, Any] = {"model": platform.base_model, "messages": MESSAGES, "max_completion_tokens": 2}
    # priority is not in the platform's default tiers: an admin grants it.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**ask, service_tier="priority")
    error = envelope(info.value)
    assert (error["code"], error["param"]) == ("service_tier_not_allowed", "service_tier")
    assert "'flex', 'default'" in error["message"]
    # A tier that does not exist here is refused by the schema, naming what is accepted.
    for tier in ("scale", "fast", "Flex"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**ask, extra_body={"service_tier": tier})
        error = envelope(info.value)
        assert error["param"] == "service_tier"
        assert "'auto', 'default', 'flex' or 'priority'" in error["message"]
    assert engine_bodies == []  # none of them reached an engine

    # Granted, it runs; taken away (back to the default tiers), it is refused again.
    path = f"/admin/tenants/{tenant.id}"
    granted = platform.admin("PATCH", path, json={"service_tiers": ["default", "priority"]})
    assert granted.status_code == 200 and granted.json()["service_tiers"] == ["default", "priority"]
    answer = client.chat.completions.create(**ask, service_tier="priority")
    assert answer.service_tier == "priority"
    assert [b["service_tier"] for b in engine_bodies] == ["priority"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**ask, service_tier="flex")  # no longer in its own list
    assert "'default', 'priority'" in envelope(info.value)["message"]
    assert platform.admin("PATCH", path, json={"service_tiers": None}).status_code == 200
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**ask, service_tier="priority")
    # The one request that ran is the one usage row: the refusals recorded nothing.
    [row] = wait_for(lambda: platform.usage_rows(tenant))
    wait_for(lambda: platform.resources.usage.num_in_flight == 0)
    assert [r["request_id"] for r in platform.usage_rows(tenant)] == [answer.id]
    assert row["service_tier"] == "priority"
