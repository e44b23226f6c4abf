"""POST /v1/embeddings through the platform (issue 35): the `openai` package against the platform on a real socket,
the embedded engine on a random Qwen3 embedding checkpoint (sentence-transformers' layout, last-token pooling,
normalized), real Postgres, Redis and S3. The base model's vectors equal sentence-transformers', an endpoint on a
tenant's adapter of the embedding model gives transformers + peft's; each request is one usage row of input tokens
(cache hits apart), rated from the price book; bad input, a chat request to the embedding model, an unknown model
are 4xx in OpenAI's shape and leave no usage row."""

from __future__ import annotations

import secrets
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from _support.adapters import make_peft_adapter
from _support.embeddings import make_embedding_checkpoint
from _support.waiting import wait_for

from .embedded_platform import embedded_fixtures
from .test_completions import Platform, Tenant

pytestmark = pytest.mark.integration

TEXTS = ["The nightly export failed twice.", "Refund the duplicate charge on invoice 4417, please."]
INPUT_PRICE, CACHED_PRICE = Decimal("2"), Decimal("0.5")  # USD per million tokens


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_checkpoint(tmp_path_factory.mktemp("embedder"), "qwen3", pooling="last", headless=False)


settings, served = embedded_fixtures("embedder", "served")


@pytest.fixture(scope="module")
def platform(served: Platform) -> Platform:
    platform = served
    response = platform.admin(
        "PUT",
        "/admin/prices",
        json={
            "base_model": platform.base_model,
            "input_per_mtok": str(INPUT_PRICE),
            "cached_input_per_mtok": str(CACHED_PRICE),
            "output_per_mtok": "8",
        },
    )
    assert response.status_code in (200, 201), response.text
    return platform


def _sentence_transformers(path: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.tensor(SentenceTransformer(str(path), device="cpu").encode(texts, batch_size=1))


def _peft(path: Path, adapter: Path, token_lists: list[list[int]]) -> torch.Tensor:
    """transformers + peft: the last token's final hidden state, normalized (the checkpoint's pooling)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter).eval()
    rows = []
    with torch.no_grad():
        for tokens in token_lists:
            hidden = model.base_model.model.model(torch.tensor([tokens])).last_hidden_state[0, -1]
            rows.append(F.normalize(hidden, dim=-1))
    return torch.stack(rows)


def _cosines(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(ours, reference, dim=-1)


def _report_row(platform: Platform, tenant: Tenant) -> dict[str, Any]:
    params = {"group_by": "model", "tenant_id": tenant.id}
    response = platform.admin("GET", "/admin/billing/report", params=params)
    assert response.status_code == 200, response.text
    [row] = response.json()["rows"]
    return dict(row)


def test_the_base_and_an_adapter_endpoint_embed_metered_and_billed(
    platform: Platform, embedder: Path, tmp_path: Path
) -> None:
    adapter_dir = make_peft_adapter(
        embedder, tmp_path / "adapter", seed=3, r=8, lora_alpha=32, target_modules="all-linear"
    )
    tenant = platform.make_tenant()
    adapter = platform.upload_adapter(tenant, adapter_dir, "search-tuned")
    platform.make_endpoint(tenant, "search", platform.base_model, adapter["id"])
    client = platform.client(tenant.key)

    # The SDK asks for base64 unless told, and decodes it: both encodings give the same vectors (the second from
    # prefix-cache hits, whose sums may round apart in the last bits).
    base = client.embeddings.create(model=platform.base_model, input=TEXTS)
    as_floats = client.embeddings.create(model=platform.base_model, input=TEXTS, encoding_format="float")
    ours = torch.tensor([d.embedding for d in base.data])
    torch.testing.assert_close(torch.tensor([d.embedding for d in as_floats.data]), ours, atol=1e-5, rtol=0)
    assert _cosines(ours, _sentence_transformers(embedder, TEXTS)).min() > 1 - 1e-4
    assert base.model == platform.base_model and [d.index for d in base.data] == [0, 1]

    token_lists = [platform.tokenizer.encode(text) for text in TEXTS]
    tuned = client.embeddings.create(model="search", input=token_lists, dimensions=16, encoding_format="float")
    assert tuned.model == "search"
    vectors = torch.tensor([d.embedding for d in tuned.data])
    reference = F.normalize(_peft(embedder, adapter_dir, token_lists)[:, :16], dim=-1)  # Matryoshka: cut, renormed
    assert vectors.shape == (2, 16) and _cosines(vectors, reference).min() > 1 - 1e-4
    assert not torch.allclose(vectors, F.normalize(ours[:, :16], dim=-1), atol=1e-3), "the adapter must count"

    num_tokens = sum(len(tokens) for tokens in token_lists)
    assert base.usage.prompt_tokens == base.usage.total_tokens == num_tokens
    rows = wait_for(lambda: found if len(found := platform.usage_rows(tenant)) >= 3 else None)
    assert sorted((r["model"], r["prompt_tokens"], r["completion_tokens"], r["status"]) for r in rows) == sorted(
        [(platform.base_model, num_tokens, 0, "ok")] * 2 + [("search", num_tokens, 0, "ok")]
    )
    # The same texts again: last-token pooling takes prefix hits, which are billed at the cached price.
    cached = sum(r["cached_tokens"] for r in rows)
    assert cached > 0
    line = _report_row(platform, tenant)
    assert line["requests"] == 3 and line["output_tokens"] == 0
    assert line["input_cached_tokens"] == cached and line["input_uncached_tokens"] == 3 * num_tokens - cached
    expected = (INPUT_PRICE * (3 * num_tokens - cached) + CACHED_PRICE * cached) / 10**6
    assert Decimal(line["cost_total"]) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [1, "two"]}, "input"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "unknown": True}, "unknown"),
        ({"input": [10**6]}, "input"),  # past the vocabulary: the engine's refusal, passed on
        ({"input": "hi", "dimensions": 4096}, "dimensions"),  # past the model's width: the engine's refusal
    ],
)
def test_bad_input_is_a_400_in_openais_shape_and_bills_nothing(
    platform: Platform, body: dict[str, Any], param: str
) -> None:
    tenant = platform.make_tenant()
    response = platform.post(tenant, "/v1/embeddings", json={"model": platform.base_model, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert param in (error.get("param") or "") + error["message"], error
    # A refusal before the engine was asked writes no usage row; one by the engine writes an error row of zero.
    assert all(r["prompt_tokens"] == 0 for r in platform.usage_rows(tenant))


def test_an_embedding_model_refuses_chat_and_unknown_models_are_404(platform: Platform) -> None:
    tenant = platform.make_tenant()
    client = platform.client(tenant.key)
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        client.chat.completions.create(model=platform.base_model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=f"nope-{secrets.token_hex(3)}", input="hi")
    response = httpx.post(f"{platform.url}/v1/embeddings", json={"model": platform.base_model, "input": "hi"})
    assert response.status_code == 401 and "error" in response.json()
