"""`kv_transfer_params` and POST /v1/kv/blocks as clients send them, through the `openai` SDK (`extra_body`, the
stream helper): a prefill answers with its transfer, a decode takes it, plain answers keep OpenAI's shape, and every
malformed or unauthorised use is a 4xx in OpenAI's envelope."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _support.engine_server import running_engine_server
from litestar import Litestar

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.kv_transfer import KVTransferConfig
from loraplex.engine.serve.server import create_engine_app

pytestmark = pytest.mark.unit

KEY = "kv-api-test-key"
PROMPT = [(5 * i + 3) % 500 + 2 for i in range(40)]  # 2 full blocks before the last token's
MESSAGES: Any = [{"role": "user", "content": "Tell me about lighthouses and the keepers who ran them, please."}]


def _server(checkpoint: Path, api_key: str | None) -> Any:
    config = EngineConfig(model=checkpoint, dtype="float32", device="cpu", kv_budget=4 * 2**20, max_model_len=256)

    async def make_app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine, api_key=api_key, kv_transfer=KVTransferConfig(public_url=url, api_key=api_key))

    return running_engine_server(config, make_app)


@pytest.fixture(scope="module")
def keyed(checkpoint: Callable[..., Path]) -> Iterator[str]:
    with _server(checkpoint("llama-gqa"), KEY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def open_engine(checkpoint: Callable[..., Path]) -> Iterator[str]:
    with _server(checkpoint("llama-gqa"), None) as (url, _):
        yield url


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_a_prefill_answers_with_its_transfer_and_a_decode_takes_it(keyed: str) -> None:
    client = _client(keyed)
    model = client.models.list().data[0].id
    prefill = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, extra_body={"kv_transfer_params": {"do_remote_decode": True}}
    )
    params = (prefill.model_extra or {})["kv_transfer_params"]
    assert params["remote_url"] == keyed and params["num_blocks"] == 2 and len(params["transfer_id"]) == 32
    decode = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=4,
        extra_body={"kv_transfer_params": {"do_remote_prefill": True, **params}},
    )
    assert decode.usage is not None and decode.usage.completion_tokens == 4
    assert "kv_transfer_params" not in (decode.model_extra or {}), "only a prefill's answer carries a transfer"
    # A streamed chat prefill: its transfer comes as the stream's own last event, after the chunks.
    transfer_body = {"kv_transfer_params": {"do_remote_decode": True}}
    chunks = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=1, stream=True, extra_body=transfer_body
        )
    )
    assert [c.object for c in chunks][-1] == "kv_transfer"
    assert chunks[-1].model_extra is not None and chunks[-1].model_extra["kv_transfer_params"]["num_blocks"] >= 1
    # The SDK's stream helper, which knows only OpenAI's chunks, passes over that event and finishes the answer.
    with client.chat.completions.stream(model=model, messages=MESSAGES, max_tokens=1, extra_body=transfer_body) as st:
        seen = [event.chunk for event in st if event.type == "chunk"]
    assert seen and seen[-1].choices[0].finish_reason == "length"


def test_plain_answers_keep_openais_shape(keyed: str) -> None:
    client = _client(keyed)
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert "kv_transfer_params" not in (answer.model_extra or {})
    # The SDK's parse helper on a message of content parts, with and without a transfer asked for. A random model
    # runs to its length limit, which parse refuses, after reading the answer into its completion.
    parts: Any = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": " more"}]}]
    with pytest.raises(openai.LengthFinishReasonError) as plain:
        client.chat.completions.parse(model=model, messages=parts, max_tokens=2)
    assert "kv_transfer_params" not in (plain.value.completion.model_extra or {})
    transfer = {"kv_transfer_params": {"do_remote_decode": True}}
    with pytest.raises(openai.LengthFinishReasonError) as asked:
        client.chat.completions.parse(model=model, messages=parts, max_tokens=1, extra_body=transfer)
    assert (asked.value.completion.model_extra or {})["kv_transfer_params"]["num_blocks"] >= 1
    raw = httpx.post(
        f"{keyed}/v1/completions",
        json={"model": model, "prompt": "hi", "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    assert "kv_transfer_params" not in raw


@pytest.mark.parametrize(
    ("params", "extra", "words"),
    [
        ({"do_remote_prefill": True}, {}, "remote_url"),
        ({"do_remote_prefill": True, "remote_url": "ftp://peer"}, {}, "kv_transfer_params.remote_url"),
        ({"do_remote_decode": True, "do_remote_prefill": True, "remote_url": "http://p"}, {}, "either"),
        ({"do_remote_decode": True}, {"n": 2}, "one prompt and one choice"),
        ({"do_remote_decode": True, "transfer_id": "../x"}, {}, "kv_transfer_params.transfer_id"),
        ({"remote_engine_id": "e1"}, {}, "kv_transfer_params.remote_engine_id"),
    ],
)
def test_malformed_transfer_params_are_400(
    keyed: str, params: dict[str, Any], extra: dict[str, Any], words: str
) -> None:
    client = _client(keyed)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPT,
            max_tokens=1,
            extra_body={"kv_transfer_params": params, **extra},
        )
    assert words in str(caught.value)


def test_an_engine_without_an_api_key_takes_no_transfers(open_engine: str) -> None:
    client = _client(open_engine, "unused")
    with pytest.raises(openai.BadRequestError, match="needs an engine started with --api-key"):
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=MESSAGES,
            extra_body={"kv_transfer_params": {"do_remote_prefill": True, "remote_url": "http://169.254.169.254"}},
        )
    response = httpx.post(f"{open_engine}/v1/kv/blocks", json={"block_hashes": []})
    assert response.status_code == 404 and "error" in response.json()


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"block_hashes": ["zz"]}, 400),
        ({"block_hashes": "00"}, 400),
        ({"block_hashes": [], "other": 1}, 400),
        ({"block_hashes": [], "transfer_id": "a b"}, 400),
    ],
)
def test_malformed_block_requests_are_400(keyed: str, body: dict[str, Any], status: int) -> None:
    response = httpx.post(f"{keyed}/v1/kv/blocks", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == status and "error" in response.json()
    assert httpx.post(f"{keyed}/v1/kv/blocks", json={"block_hashes": []}).status_code == 401
