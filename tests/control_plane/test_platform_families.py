"""A Qwen3 base and a tenant's Qwen3 LoRA through the platform end to end (issue 35): the `openai` package against
the platform on a real socket, the embedded engine on a random Qwen3 checkpoint written by transformers, real
Postgres, Redis and S3; greedy answers equal transformers' (+ peft's), usage is metered per request."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from _support.adapters import make_peft_adapter
from _support.checkpoints import make_checkpoint
from _support.waiting import wait_for

from .embedded_platform import embedded_fixtures
from .test_completions import Platform, hf_greedy

pytestmark = pytest.mark.integration

PROMPT = "Triage this ticket: the nightly export failed twice."


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


settings, platform = embedded_fixtures("qwen3")


def test_a_qwen3_base_and_a_qwen3_adapter_end_to_end(platform: Platform, qwen3: Path, tmp_path: Path) -> None:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter_dir = make_peft_adapter(qwen3, tmp_path / "adapter", seed=4, r=8, lora_alpha=64, target_modules=targets)
    tenant = platform.make_tenant()
    adapter = platform.upload_adapter(tenant, adapter_dir, "triage")
    platform.make_endpoint(tenant, "triage-bot", platform.base_model, adapter["id"])
    platform.make_endpoint(tenant, "plain-qwen3", platform.base_model)
    client = platform.client(tenant.key)
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = platform.tokenizer.encode_chat(messages)
    answers = {}
    for endpoint, folder in (("plain-qwen3", None), ("triage-bot", adapter_dir)):
        response = client.chat.completions.create(
            model=endpoint,
            messages=messages,
            max_completion_tokens=10,
            temperature=0,  # type: ignore[arg-type]
        )
        text = response.choices[0].message.content
        assert text == hf_greedy(qwen3, folder, prompt_ids, 10, platform.tokenizer), endpoint
        assert response.usage is not None and response.usage.prompt_tokens == len(prompt_ids)
        answers[endpoint] = text
    assert answers["plain-qwen3"] != answers["triage-bot"], "the adapter must change the greedy answer"
    rows = wait_for(lambda: found if len(found := platform.usage_rows(tenant)) >= 2 else None)
    assert sorted((r["model"], r["prompt_tokens"]) for r in rows) == [
        ("plain-qwen3", len(prompt_ids)),
        ("triage-bot", len(prompt_ids)),
    ]


def test_a_model_that_does_not_embed_refuses_embeddings(platform: Platform) -> None:
    tenant = platform.make_tenant()
    with pytest.raises(openai.BadRequestError, match="is not an embedding model") as caught:
        platform.client(tenant.key).embeddings.create(model=platform.base_model, input="hi")
    assert caught.value.body["param"] == "model"  # type: ignore[index]
