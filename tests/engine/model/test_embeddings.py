"""Embedding models: the engine's vectors equal sentence-transformers' over the same checkpoint (its modules.json
pooling: last token, mean or CLS; normalized), through chunked prefill, batches, preemption and prefix hits; with a
peft adapter they equal transformers + peft pooled the same way; what does not fit is refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _support.adapters import make_peft_adapter
from _support.checkpoints import VOCAB
from _support.embeddings import make_embedding_checkpoint

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.errors import CheckpointError, RequestError

pytestmark = pytest.mark.unit

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog " * 6,  # past several prefill chunks
    "a",
    "embeddings are pooled hidden states",
]


def _llm(path: Path, **options: Any) -> LLM:
    settings: dict[str, Any] = {"kv_budget": 8 * 2**20, "max_num_batched_tokens": 16} | options
    return LLM(path, dtype="float32", device="cpu", **settings)


def _sentence_transformers(path: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return torch.tensor(model.encode(texts, batch_size=1))  # one at a time: the test tokenizer has no pad token


def _cosines(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(ours.double(), reference.double(), dim=-1)


@pytest.mark.parametrize("headless", [True, False], ids=["bare-decoder", "causal-lm"])
@pytest.mark.parametrize(("variant", "pooling"), [("qwen3", "last"), ("llama-gqa", "mean"), ("qwen3", "cls")])
def test_embeddings_equal_sentence_transformers(variant: str, pooling: str, headless: bool, tmp_path: Path) -> None:
    path = make_embedding_checkpoint(tmp_path / "model", variant, pooling=pooling, headless=headless)  # type: ignore[arg-type]
    reference = _sentence_transformers(path, TEXTS)
    outputs = _llm(path).embed(TEXTS)  # one batch, chunked (16 tokens a step)
    ours = torch.tensor([output.embedding for output in outputs])
    assert all(output.outputs[0].token_ids == [] for output in outputs), "an embedding request generates nothing"
    assert (_cosines(ours, reference) > 1 - 1e-4).all()
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5, rtol=0)


def test_unnormalized_pooling_and_dimensions(tmp_path: Path) -> None:
    path = make_embedding_checkpoint(tmp_path / "model", "qwen3", pooling="mean", normalize=False)
    reference = _sentence_transformers(path, TEXTS)
    llm = _llm(path)
    ours = torch.tensor([o.embedding for o in llm.embed(TEXTS)])
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    assert not torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)))
    # Matryoshka: the first 16 components (not normalized again: this model does not normalize).
    short = torch.tensor([o.embedding for o in llm.embed(TEXTS, dimensions=16)])
    torch.testing.assert_close(short, reference[:, :16], atol=1e-5, rtol=0)
    normalized = make_embedding_checkpoint(tmp_path / "normalized", "qwen3", pooling="last")
    full = torch.tensor([o.embedding for o in _llm(normalized).embed(TEXTS)])
    short = torch.tensor([o.embedding for o in _llm(normalized).embed(TEXTS, dimensions=16)])
    torch.testing.assert_close(short, F.normalize(full[:, :16], dim=-1), atol=1e-5, rtol=0)


def test_preemption_and_prefix_hits_keep_the_vectors(tmp_path: Path) -> None:
    """Embedding requests of six tenants in a pool that holds one long prompt: their chunks interleave (fair share),
    the pool fills with prompts halfway done, and preemption restarts them; the vectors are still each alone's."""
    path = make_embedding_checkpoint(tmp_path / "model", "qwen3", pooling="mean")
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(60, 120))] for _ in range(6)]
    alone = _llm(path, max_num_batched_tokens=512)
    expected = [alone.embed({"prompt_token_ids": p})[0].embedding for p in prompts]
    core = _llm(path, kv_budget=8 * _block_bytes(path), max_model_len=128).engine
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, pooling=core.pooling_state(None), fairness_key=f"tenant-{i}")
    done: dict[str, list[float] | None] = {}
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        done |= {o.request_id: o.embedding for o in core.step() if o.finished}
    assert not core.has_unfinished_requests(), "the engine stopped making progress"
    assert core.num_preemptions > 0, "the pool was meant to be too small for all of them at once"
    ours = torch.tensor([done[str(i)] for i in range(len(prompts))])
    torch.testing.assert_close(ours, torch.tensor(expected), atol=1e-5, rtol=0)


def test_last_token_pooling_takes_prefix_hits(tmp_path: Path) -> None:
    path = make_embedding_checkpoint(tmp_path / "model", "qwen3", pooling="last")
    llm = _llm(path)
    shared = list(range(2, 66))
    first = llm.embed({"prompt_token_ids": [*shared, 70, 71]})[0]
    hit = llm.embed({"prompt_token_ids": [*shared, 80]})[0]
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == 64
    cold = _llm(path, enable_prefix_caching=False).embed({"prompt_token_ids": [*shared, 80]})[0]
    torch.testing.assert_close(torch.tensor(hit.embedding), torch.tensor(cold.embedding), atol=1e-5, rtol=0)


def test_mean_pooling_takes_no_prefix_hits(tmp_path: Path) -> None:
    path = make_embedding_checkpoint(tmp_path / "model", "qwen3", pooling="mean")
    llm = _llm(path)
    prompt = {"prompt_token_ids": list(range(2, 70))}
    first, again = llm.embed(prompt)[0], llm.embed(prompt)[0]
    assert again.num_cached_tokens == 0  # a hit would skip the rows the mean needs
    assert first.embedding == again.embedding


def _block_bytes(path: Path) -> int:
    llm = _llm(path, kv_budget=2**20)
    return llm.engine.pool.page_bytes * llm.engine.kv_groups.num_groups


def test_an_adapter_on_an_embedding_model(tmp_path: Path) -> None:
    """A LoRA fine-tune of an embedding model: the engine's vectors equal transformers + peft's last hidden states,
    pooled as the model says (last token, normalized)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = make_embedding_checkpoint(tmp_path / "model", "qwen3", pooling="last", headless=False)
    adapter = make_peft_adapter(path, tmp_path / "adapter", seed=1, r=8, lora_alpha=16, target_modules="all-linear")
    llm = _llm(path, enable_prefix_caching=True)
    prompts = [[random.Random(i).randrange(2, VOCAB) for _ in range(20 + 9 * i)] for i in range(3)]
    loras = [LoRARequest("tuned", adapter), None, LoRARequest("tuned", adapter)]
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], lora_request=loras)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter).eval()
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        with torch.no_grad(), peft.disable_adapter() if lora is None else _nothing():
            hidden = peft.base_model.model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(output.embedding), F.normalize(hidden, dim=-1), atol=1e-5, rtol=0)
    assert outputs[0].embedding != outputs[1].embedding


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


# --- refusals ---------------------------------------------------------------------------------------------------------


def test_an_embedding_model_does_not_generate_and_a_generator_does_not_embed(tmp_path: Path, checkpoint: Any) -> None:
    embedder = _llm(make_embedding_checkpoint(tmp_path / "model", "qwen3"))
    with pytest.raises(RequestError, match="is an embedding model") as caught:
        embedder.generate("hello", SamplingParams(max_tokens=2))
    assert caught.value.param == "model"
    with pytest.raises(RequestError, match="is not an embedding model"):
        _llm(checkpoint("qwen3")).embed("hello")
    with pytest.raises(RequestError, match="dimensions must be an integer from 1 to 64") as bad:
        embedder.embed("hello", dimensions=65)
    assert bad.value.param == "dimensions"
    assert not embedder.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"pooling_mode_lasttoken": False, "pooling_mode_max_tokens": True},
            r"pooling_mode_max_tokens is not supported",
        ),
        ({"pooling_mode_mean_tokens": True}, r"exactly one of .* must be true, got 2"),
        ({"include_prompt": False}, r"include_prompt false"),
    ],
)
def test_poolings_loraplex_does_not_run_are_refused(edit: dict[str, Any], message: str, tmp_path: Path) -> None:
    path = make_embedding_checkpoint(tmp_path / "model", "qwen3", pooling="last")
    config_file = path / "1_Pooling" / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | edit))
    with pytest.raises(CheckpointError, match=message):
        _llm(path)


def test_an_unknown_module_is_refused(tmp_path: Path) -> None:
    path = make_embedding_checkpoint(tmp_path / "model", "qwen3")
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match=r"module type 'sentence_transformers.models.Dense' is not supported"):
        _llm(path)
