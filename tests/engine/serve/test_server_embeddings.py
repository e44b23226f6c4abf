"""POST /v1/embeddings on the engine's server, driven by the `openai` SDK: strings, lists of them, token ids,
`dimensions`, base64 (the SDK's default, which it decodes itself), an adapter by name; the vectors equal
sentence-transformers' over the same checkpoint; an embedding model refuses chat, a chat model refuses embeddings,
each with a 400 in OpenAI's error shape."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from _support.adapters import make_peft_adapter
from _support.checkpoints import make_checkpoint
from _support.embeddings import make_embedding_checkpoint
from _support.engine_server import running_engine_server
from litestar import Litestar

from loraplex.engine import LoRARequest
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.server import create_engine_app, load_lora_modules

pytestmark = pytest.mark.unit

TEXTS = ["hello world", "embeddings for everyone, " * 5, "z"]


def _server(path: Path, name: str, loras: dict[str, Path] | None = None) -> contextlib.AbstractContextManager[Any]:
    async def app(engine: AsyncEngine, url: str) -> Litestar:
        modules = [LoRARequest(adapter, str(folder)) for adapter, folder in (loras or {}).items()]
        return create_engine_app(engine, await load_lora_modules(engine, modules))

    config = EngineConfig(model=path, device="cpu", kv_budget=8 * 2**20, served_model_name=name, num_threads=2)
    return running_engine_server(config, app)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str, Path]]:
    root = tmp_path_factory.mktemp("embedder")
    path = make_embedding_checkpoint(root / "model", "qwen3", pooling="last", headless=False)
    adapter = make_peft_adapter(path, root / "adapter", seed=2, r=8, lora_alpha=16, target_modules="all-linear")
    with _server(path, "qwen3-embed", {"tuned": adapter}) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60), url, path


def _reference(path: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.tensor(SentenceTransformer(str(path), device="cpu").encode(texts, batch_size=1))


def test_vectors_equal_sentence_transformers_in_both_encodings(embedder: tuple[openai.OpenAI, str, Path]) -> None:
    client, _, path = embedder
    reference = _reference(path, TEXTS)
    for encoding in ("float", "base64"):  # the SDK asks for base64 unless told, and decodes it to floats
        kwargs: dict[str, Any] = {"encoding_format": encoding} if encoding == "float" else {}
        response = client.embeddings.create(model="qwen3-embed", input=TEXTS, **kwargs)
        assert [d.index for d in response.data] == [0, 1, 2]
        ours = torch.tensor([d.embedding for d in response.data])
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
        assert response.model == "qwen3-embed" and response.object == "list"
        assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)


def test_token_ids_a_single_string_and_dimensions(embedder: tuple[openai.OpenAI, str, Path]) -> None:
    client, _, path = embedder
    one = client.embeddings.create(model="qwen3-embed", input="hello world", encoding_format="float")
    tokens = Tokenizer.from_dir(path).encode("hello world")
    by_ids = client.embeddings.create(model="qwen3-embed", input=tokens, encoding_format="float")
    batch = client.embeddings.create(model="qwen3-embed", input=[tokens, tokens[:2]], encoding_format="float")
    for other in (by_ids, batch):  # the same tokens; in a batch of two the sums may round apart in the last bits
        torch.testing.assert_close(torch.tensor(other.data[0].embedding), torch.tensor(one.data[0].embedding))
    assert len(batch.data) == 2 and by_ids.usage.prompt_tokens == len(tokens)
    short = client.embeddings.create(model="qwen3-embed", input="hello world", dimensions=8, encoding_format="float")
    vector = torch.tensor(short.data[0].embedding)
    assert vector.shape == (8,)
    torch.testing.assert_close(vector, torch.nn.functional.normalize(torch.tensor(one.data[0].embedding[:8]), dim=0))


def test_an_adapter_by_name(embedder: tuple[openai.OpenAI, str, Path]) -> None:
    client, _, _ = embedder
    base = client.embeddings.create(model="qwen3-embed", input="hello", encoding_format="float").data[0].embedding
    tuned = client.embeddings.create(model="tuned", input="hello", encoding_format="float")
    assert tuned.model == "tuned" and tuned.data[0].embedding != base


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": "hi", "dimensions": 0}, None),
        ({"input": "hi", "dimensions": 65}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, None),
        ({"input": [1, "two"]}, None),
        ({"input": [10**9]}, "input"),
    ],
)
def test_bad_input_is_a_400_in_openais_shape(
    embedder: tuple[openai.OpenAI, str, Path], body: dict[str, Any], param: str | None
) -> None:
    _, url, _ = embedder
    response = httpx.post(f"{url}/v1/embeddings", json={"model": "qwen3-embed", **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_an_embedding_model_refuses_chat(embedder: tuple[openai.OpenAI, str, Path]) -> None:
    client, _, _ = embedder
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        client.completions.create(model="qwen3-embed", prompt="hi", max_tokens=2)


def test_a_chat_model_refuses_embeddings(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "chat", "qwen3")
    with _server(path, "chat") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="is not an embedding model") as caught:
            client.embeddings.create(model="chat", input="hi")
        assert caught.value.body["param"] == "model"  # type: ignore[index]
