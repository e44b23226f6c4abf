"""Draft-model speculative decoding on the demo model: with the target itself as draft nearly every proposal is kept,
and with any draft (a layer-skip cut of the target, random layers, a shorter context) greedy output is token for token
the engine's without speculation, for base and LoRA rows, with chunked prefill and preemption. The draft's K/V live in
the target's page pool (they show in its usage, are all freed when requests finish, and are what the pool takes back
under pressure, never the target's requests); a draft with another vocabulary, or whose K/V do not fit a pool page,
is refused at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _support.speculation import (
    DEMO,
    GREEDY,
    PREEMPTION,
    PROMPTS,
    UPPER,
    demo,
    draft_config,
    proposer_of,
    run,
    speculative,
    totals,
)
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from loraplex.engine import LLM, LoRARequest
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.memory.page_pool import PageKind
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.serve.cli import engine as engine_cli
from loraplex.engine.tools.demo import RandomModelSpec, write_random_model
from loraplex.engine.tools.draft import make_truncated_draft

pytestmark = pytest.mark.unit


def demo_shaped_draft(path: Path, *, num_layers: int, seed: int = 0, **config_fields: Any) -> Path:
    """A draft of the demo model's shape and tokenizer with `num_layers` random layers (its embeddings and final
    norm are the demo's), and config.json fields overridden by `config_fields`."""
    make_truncated_draft(DEMO, path, 1)
    tensors = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    layer = {name.removeprefix("model.layers.0."): t for name, t in tensors.items() if name.startswith("model.layers.")}
    weights = {name: t for name, t in tensors.items() if not name.startswith("model.layers.")}
    for i in range(num_layers):
        for name, tensor in layer.items():
            if name.endswith("norm.weight"):
                weights[f"model.layers.{i}.{name}"] = torch.ones_like(tensor)
            else:
                weights[f"model.layers.{i}.{name}"] = (
                    torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 0.05
                )
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=num_layers, **config_fields)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 32}, PREEMPTION],  # prompts (and the draft's catch-ups) in chunks
    ids=["plain", "chunked-prefill", "preemption"],
)
def test_the_target_as_its_own_draft_is_nearly_always_right_and_output_is_the_engines(options: dict[str, Any]) -> None:
    lora = LoRARequest("upper", str(UPPER))
    loras = [lora if i % 2 else None for i in range(len(PROMPTS))]
    plain = demo(**options)
    expected = run(plain, loras)
    llm = speculative(DEMO, **options)
    assert run(llm, loras) == expected
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    base = speculator.stats.by_adapter[""]
    # The same model on base rows: every proposal is the target's own argmax. (The demo adapter has no draft
    # counterpart, so on its rows the draft proposes what the base model would say: test_draft_adapters.py.)
    assert base.num_proposed > 0 and base.num_accepted >= 0.95 * base.num_proposed
    if options is PREEMPTION:
        assert llm.engine.num_preemptions > 0 and plain.engine.num_preemptions > 0
    else:
        assert set(speculator.stats.by_adapter) == {"", "upper"}
    assert proposer_of(llm).num_pages == 0  # every request finished: its draft pages went back


@pytest.mark.parametrize("draft", ["truncated-1", "truncated-2", "random", "short-context"])
@pytest.mark.parametrize("options", [{}, PREEMPTION], ids=["plain", "preemption"])
def test_any_draft_keeps_the_output_exactly_the_engines(draft: str, options: dict[str, Any], tmp_path: Path) -> None:
    if draft.startswith("truncated"):
        path = make_truncated_draft(DEMO, tmp_path / "draft", int(draft.rsplit("-", 1)[1]))
    elif draft == "random":
        path = demo_shaped_draft(tmp_path / "draft", num_layers=1)
    else:  # fewer positions than the target's context: rows past them propose less, then nothing
        path = make_truncated_draft(DEMO, tmp_path / "draft", 2)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    lora = LoRARequest("upper", str(UPPER))
    loras = [lora if i % 3 == 1 else None for i in range(len(PROMPTS))]
    llm = speculative(path, **options)
    assert run(llm, loras) == run(demo(**options), loras)
    assert totals(llm)[0] > 0
    if draft == "short-context":
        assert proposer_of(llm).draft.max_positions == 40


def test_the_truncated_draft_is_the_targets_first_layers(tmp_path: Path) -> None:
    path = make_truncated_draft(DEMO, tmp_path / "draft", 2)
    config = ModelConfig.from_dir(path)
    target = ModelConfig.from_dir(DEMO)
    assert (config.num_layers, config.vocab_size, config.hidden_size) == (2, target.vocab_size, target.hidden_size)
    draft_tensors = load_file(str(path / "model.safetensors"))
    target_tensors = load_file(str(DEMO / "model.safetensors"))
    assert set(draft_tensors) == {n for n in target_tensors if not n.startswith(("model.layers.2.", "model.layers.3."))}
    assert all(torch.equal(t, target_tensors[n]) for n, t in draft_tensors.items())
    assert (path / "tokenizer.json").read_bytes() == (DEMO / "tokenizer.json").read_bytes()
    answer = LLM(path, device="cpu", dtype="float32").generate(PROMPTS[0], GREEDY)  # a checkpoint the engine serves
    assert len(answer[0].outputs[0].token_ids) == GREEDY.max_tokens
    for bad in (0, 5):
        with pytest.raises(ValueError, match="num_layers must be between 1 and the target's 4 layers"):
            make_truncated_draft(DEMO, tmp_path / f"bad-{bad}", bad)


def other_tokenizer_draft(path: Path) -> Path:
    """The demo's own first layer, with two tokens of its tokenizer swapped: same vocab_size, other token ids."""
    make_truncated_draft(DEMO, path, 1)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {token_id: token for token, token_id in vocab.items()}
    first, second = by_id[300], by_id[301]
    vocab[first], vocab[second] = 301, 300
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


def test_a_draft_with_another_vocabulary_is_refused_at_start(tmp_path: Path) -> None:
    other_size = write_random_model(tmp_path / "small-vocab", RandomModelSpec(num_hidden_layers=1, vocab_size=2048))
    with pytest.raises(ValueError, match="has vocab_size 2048, the target 4096: a draft must share the target's"):
        speculative(other_size)
    with pytest.raises(ValueError, match="has another tokenizer than the target"):
        speculative(other_tokenizer_draft(tmp_path / "swapped"))


def test_a_draft_whose_kv_does_not_fit_a_pool_page_is_refused_at_start(tmp_path: Path) -> None:
    """Five layers of the demo's shape against the demo's four: one block of them is more than one pool page."""
    with pytest.raises(ValueError, match=r"K/V of one block \(5 layers x 4096 values\) does not fit one page"):
        speculative(demo_shaped_draft(tmp_path / "deep", num_layers=5))


def test_the_cli_parses_a_draft_config_and_the_engine_refuses_a_draft_of_another_vocabulary(tmp_path: Path) -> None:
    draft = other_tokenizer_draft(tmp_path / "swapped")
    value = json.dumps(draft_config(draft))
    result = CliRunner().invoke(
        engine_cli, ["serve", "--model", str(DEMO), "--device", "cpu", "--speculative-config", value]
    )
    assert result.exit_code == 1, result.output
    assert "has another tokenizer than the target" in result.output


def kv_pages_of_requests(core: EngineCore) -> int:
    return sum(len(r.blocks.block_ids) for r in core.scheduler.running)


def test_draft_pages_show_in_the_pools_usage_and_are_freed_when_requests_finish() -> None:
    """Without the prefix cache, every KV page is a running request's or the draft's; all go back at the end, an
    aborted request's draft pages too."""
    llm = speculative(DEMO, enable_prefix_caching=False)
    core, proposer = llm.engine, proposer_of(llm)
    tokenizer = llm.get_tokenizer()
    for i, prompt in enumerate(PROMPTS):
        core.add_request(str(i), tokenizer.encode(prompt), GREEDY)
    seen_draft_pages = 0
    aborted = False
    while core.has_unfinished_requests():
        core.step()
        usage = core.pool.usage()
        assert usage.by_kind[PageKind.KV.value] == kv_pages_of_requests(core) + proposer.num_pages
        assert usage.num_evictable == proposer.num_pages  # between steps the pool may take any of them back
        seen_draft_pages = max(seen_draft_pages, proposer.num_pages)
        if proposer.num_pages and not aborted:
            held = next(r for r in core.scheduler.running if proposer.num_pages_of(r))
            before, its_own = proposer.num_pages, proposer.num_pages_of(held)
            core.abort_request(held.request_id)
            assert proposer.num_pages == before - its_own and proposer.num_pages_of(held) == 0
            aborted = True
    assert seen_draft_pages > 0 and aborted
    usage = core.pool.usage()
    assert proposer.num_pages == 0
    assert usage.by_kind[PageKind.KV.value] == 0 and usage.num_free == usage.num_pages


def test_under_pool_pressure_the_draft_is_evicted_not_the_targets_requests_preempted() -> None:
    """A pool too small for all six requests: the speculating engine's draft pages are taken back for the target's
    blocks, and it preempts no more requests than the engine without speculation does."""
    options = {"kv_budget": 16 * 64 * 2**10, "max_model_len": 96, "enable_prefix_caching": False}
    plain = demo(**options)
    expected = run(plain)
    llm = speculative(DEMO, **options)
    assert run(llm) == expected
    assert proposer_of(llm).num_evictions > 0
    assert totals(llm)[0] > 0
    assert llm.engine.num_preemptions <= plain.engine.num_preemptions


def test_a_target_allocation_takes_every_draft_page_back() -> None:
    llm = speculative(DEMO)
    core, proposer = llm.engine, proposer_of(llm)
    tokenizer = llm.get_tokenizer()
    core.add_request("a", tokenizer.encode(PROMPTS[0]), GREEDY)
    while proposer.num_pages == 0:
        core.step()
    held = proposer.num_pages
    pool = core.pool
    assert pool.can_allocate(pool.num_free + held)
    taken = pool.allocate(pool.num_free + held, PageKind.KV)  # what a target's request would take
    assert proposer.num_pages == 0 and proposer.num_evictions == 1
    pool.release(taken)
    expected = demo().generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
    while core.has_unfinished_requests():
        outputs = core.step()
        done = [o for o in outputs if o.finished]
        if done:
            assert done[0].outputs[0].token_ids == expected  # the draft caught up again from the real tokens


def test_llm_accepts_the_draft_config_in_vllms_shape(tmp_path: Path) -> None:
    draft = make_truncated_draft(DEMO, tmp_path / "draft", 1)
    llm = LLM(DEMO, device="cpu", dtype="float32", speculative_config={"method": "draft", "model": str(draft)})
    proposer = proposer_of(llm)
    assert proposer.draft.path == draft and proposer.draft.config.num_layers == 1
    assert proposer.draft.model.dtype == torch.float32


def test_an_unusable_draft_folder_is_refused_at_start(tmp_path: Path) -> None:
    shutil.copytree(DEMO, tmp_path / "no-config")
    (tmp_path / "no-config" / "config.json").unlink()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        speculative(tmp_path / "no-config")
