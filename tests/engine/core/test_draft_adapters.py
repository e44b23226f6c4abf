"""Draft counterparts of adapters: an adapter folder's `draft/` adapter is what the draft model runs for that adapter's
rows. With the target as its own draft and the target's adapter as its own counterpart, LoRA rows keep nearly every
proposal (without the counterpart, far fewer); greedy output stays token for token the engine's without speculation
(plain, chunked prefill, preemption, a truncated draft with a truncated counterpart, a counterpart that does not fit
the draft); counterparts take pool pages only while they are resident, are idle and evictable once requests finish;
a row whose counterpart arrives late computes its draft K/V again under it."""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from _support.speculation import (
    DEMO,
    GREEDY,
    PREEMPTION,
    PROMPTS,
    UPPER,
    counts_of,
    demo,
    proposer_of,
    run,
    speculative,
)
from safetensors.torch import load_file

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.draft_adapters import DraftAdapters, draft_source
from loraplex.engine.core.speculator import SpeculationCounts
from loraplex.engine.lora import parse_adapter
from loraplex.engine.lora.manager import AdapterEntry, AdapterState
from loraplex.engine.memory.page_pool import PageKind
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.draft import make_truncated_draft, make_truncated_draft_adapter

pytestmark = pytest.mark.unit

OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "chunked-prefill": {"max_num_batched_tokens": 32},  # prompts (and the draft's catch-ups) in chunks
    # The demo adapter takes 10 pages, its counterpart 10 more: 28 pages hold both and preempt requests.
    "preemption": {**PREEMPTION, "kv_budget": 28 * 64 * 2**10},
}


@functools.cache
def expected(options: str) -> tuple[tuple[int, ...], ...]:
    """The engine's greedy answers without speculation, LoRA (the demo adapter) on every other prompt."""
    answers = run(demo(**OPTIONS[options]), mixed(LoRARequest("upper", str(UPPER))))
    return tuple(tuple(answer) for answer in answers)


def mixed(lora: LoRARequest) -> list[LoRARequest | None]:
    return [lora if i % 2 else None for i in range(len(PROMPTS))]


def with_counterpart(path: Path, make_draft: Any = None) -> LoRARequest:
    """A copy of the demo adapter at `path` whose `draft/` is what `make_draft(out)` writes (default: the adapter
    itself, the counterpart of a draft that is the target)."""
    shutil.copytree(UPPER, path)
    if make_draft is None:
        shutil.copytree(UPPER, path / "draft")
    else:
        make_draft(path / "draft")
    return LoRARequest("upper", str(path))


def draft_adapters(llm: LLM) -> DraftAdapters:
    adapters = proposer_of(llm).adapters
    assert adapters is not None
    return adapters


def counterpart(llm: LLM) -> AdapterEntry:
    (entry,) = draft_adapters(llm).manager.entries.values()
    return entry


def rate(counts: SpeculationCounts) -> float:
    assert counts.num_proposed > 0
    return counts.num_accepted / counts.num_proposed


def test_the_targets_adapter_as_its_own_counterpart_keeps_nearly_every_proposal(tmp_path: Path) -> None:
    """The target as its own draft: with the adapter as its own counterpart, its rows' proposals are the adapted
    target's argmax, as base rows' are the base target's; without it, the draft proposes what the base model would
    say, and fewer are kept."""
    llm = speculative(DEMO)
    assert run(llm, mixed(with_counterpart(tmp_path / "upper"))) == [list(a) for a in expected("plain")]
    assert rate(counts_of(llm, "upper")) >= 0.95 and rate(counts_of(llm, "")) >= 0.95
    assert counterpart(llm).ref.source == str(tmp_path / "upper" / "draft")

    bare = speculative(DEMO)
    assert run(bare, mixed(LoRARequest("upper", str(UPPER)))) == [list(a) for a in expected("plain")]
    assert rate(counts_of(bare, "upper")) < 0.8
    assert not draft_adapters(bare).manager.entries  # no draft/ folder: nothing to load


@pytest.mark.parametrize("options", ["chunked-prefill", "preemption"])
def test_with_counterparts_output_is_the_engines(options: str, tmp_path: Path) -> None:
    llm = speculative(DEMO, **OPTIONS[options])
    lora = with_counterpart(tmp_path / "upper")
    if options == "preemption":
        # Resident before the run (a pool this small seldom has room to place it), then evicted by the target's
        # allocations and placed again.
        make_resident(llm, lora)
    assert run(llm, mixed(lora)) == [list(a) for a in expected(options)]
    assert counts_of(llm, "upper").num_proposed > 0
    if options == "preemption":
        assert llm.engine.num_preemptions > 0 and counterpart(llm).placement >= 2
    else:
        assert rate(counts_of(llm, "upper")) >= 0.95
    assert proposer_of(llm).num_pages == 0  # every request finished: its draft K/V went back


def make_resident(llm: LLM, lora: LoRARequest) -> None:
    """Run requests of `lora` until its counterpart is resident (it loads on worker threads)."""
    for _ in range(5):
        llm.generate("Hello", GREEDY, lora_request=lora)
        if counterpart(llm).state is AdapterState.RESIDENT:
            return
    raise AssertionError("the counterpart never became resident")


def test_a_truncated_draft_runs_the_truncated_counterpart(tmp_path: Path) -> None:
    """A one-layer draft of the demo model, and the demo adapter's first layer as its counterpart: the counterpart
    is placed and used (its adapter tables sized by the draft's one layer, not the pool's four)."""
    draft = make_truncated_draft(DEMO, tmp_path / "draft", 1)
    lora = with_counterpart(tmp_path / "upper", lambda out: make_truncated_draft_adapter(UPPER, out, 1))
    llm = speculative(draft)
    assert run(llm, mixed(lora)) == [list(a) for a in expected("plain")]
    entry = counterpart(llm)
    assert entry.state is AdapterState.RESIDENT and entry.layout is not None and len(entry.layout.layers) == 1
    assert counts_of(llm, "upper").num_proposed > 0


def test_the_truncated_counterpart_is_the_adapters_first_layers(tmp_path: Path) -> None:
    out = make_truncated_draft_adapter(UPPER, tmp_path / "draft", 2)
    kept, full = load_file(str(out / "adapter_model.safetensors")), load_file(str(UPPER / "adapter_model.safetensors"))
    assert set(kept) == {name for name in full if ".layers.0." in name or ".layers.1." in name}
    assert all(t.equal(full[name]) for name, t in kept.items())
    draft_config = ModelConfig.from_dir(make_truncated_draft(DEMO, tmp_path / "model", 2))
    files = ((out / "adapter_config.json").read_bytes(), (out / "adapter_model.safetensors").read_bytes())
    assert parse_adapter(*files, draft_config).layers == (0, 1)  # servable by the two-layer draft
    with pytest.raises(ValueError, match="num_layers must be at least 1"):
        make_truncated_draft_adapter(UPPER, tmp_path / "bad", 0)


def test_a_counterpart_of_other_shapes_fails_only_itself(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The demo adapter's four layers as the counterpart of a one-layer draft: it cannot load, a warning says so, and
    the requests answer as ever, their rows proposing with the bare draft."""
    draft = make_truncated_draft(DEMO, tmp_path / "draft", 1)
    lora = with_counterpart(tmp_path / "upper")
    llm = speculative(draft)
    with caplog.at_level(logging.WARNING, logger="loraplex.engine.core.draft_adapters"):
        outputs = llm.generate(PROMPTS, GREEDY, lora_request=mixed(lora))
    assert [list(o.outputs[0].token_ids) for o in outputs] == [list(a) for a in expected("plain")]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert counterpart(llm).state is AdapterState.FAILED
    assert any("could not be used" in r.message and "bare draft" in r.message for r in caplog.records)
    assert counts_of(llm, "upper").num_proposed > 0


def test_counterpart_pages_are_in_the_pool_and_evictable_once_requests_finish(tmp_path: Path) -> None:
    """Without the prefix cache: adapter pages are the target's resident adapters' and the counterparts'; once every
    request finished the counterpart is idle, evictable, and a target allocation takes it back; a later request
    places it again."""
    llm = speculative(DEMO, enable_prefix_caching=False)
    core, adapters = llm.engine, draft_adapters(llm)
    lora = with_counterpart(tmp_path / "upper")
    tokenizer = llm.get_tokenizer()
    for i, prompt in enumerate(PROMPTS[:4]):
        ref = core.resolve_lora(lora) if i % 2 else None
        core.add_request(str(i), tokenizer.encode(prompt), GREEDY, lora=ref)
    seen = 0
    while core.has_unfinished_requests():
        core.step()
        target_pages = sum(len(e.pages) for e in core.adapters.resident())
        assert core.pool.usage().by_kind[PageKind.ADAPTER.value] == target_pages + adapters.num_pages
        seen = max(seen, adapters.num_pages)
    assert seen > 0
    entry = counterpart(llm)
    assert entry.state is AdapterState.RESIDENT and entry.num_running == 0 and entry.num_requests == 0
    usage = core.pool.usage()
    idle_target = sum(len(e.pages) for e in core.adapters.resident())
    assert usage.num_evictable == idle_target + adapters.num_pages  # nothing pinned, no draft K/V left
    pool = core.pool
    taken = pool.allocate(pool.num_free + pool.num_evictable, PageKind.KV)  # what a target's requests could take
    assert adapters.num_pages == 0 and entry.state is not AdapterState.RESIDENT
    pool.release(taken)
    again = llm.generate(PROMPTS[1], GREEDY, lora_request=lora)
    assert list(again[0].outputs[0].token_ids) == list(expected("plain")[1])
    assert counterpart(llm).state is AdapterState.RESIDENT


def test_a_row_whose_counterpart_arrives_late_computes_its_draft_kv_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row first proposes with the bare draft (its prompt's draft K/V computed without the counterpart); once the
    counterpart is there it proposes under it, from draft K/V computed again under it: nearly every proposal after the
    switch is kept, which K/V of the bare draft under the adapted draft's later tokens would not give."""
    llm = speculative(DEMO, enable_prefix_caching=False)
    core, proposer = llm.engine, proposer_of(llm)
    adapters = draft_adapters(llm)
    lora = with_counterpart(tmp_path / "upper")
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    make_resident(llm, lora)  # so that the switch is at once
    tokenizer = llm.get_tokenizer()
    request = core.add_request("a", tokenizer.encode(PROMPTS[3]), params, lora=core.resolve_lora(lora))
    with monkeypatch.context() as patch:
        patch.setattr(adapters, "pin", lambda request: None)  # the counterpart is not there yet
        steps = counts_of(llm, "upper").num_steps
        while counts_of(llm, "upper").num_steps < steps + 3:
            core.step()
        assert proposer.num_pages_of(request) > 0
    before = dataclasses.replace(counts_of(llm, "upper"))
    answer: list[int] = []
    while core.has_unfinished_requests():
        for output in core.step():
            answer = list(output.outputs[0].token_ids)
    after = counts_of(llm, "upper")
    assert counterpart(llm).state is AdapterState.RESIDENT
    late = SpeculationCounts(
        num_proposed=after.num_proposed - before.num_proposed, num_accepted=after.num_accepted - before.num_accepted
    )
    assert late.num_proposed >= 20 and rate(late) >= 0.95
    alone = demo().generate(PROMPTS[3], params, lora_request=LoRARequest("upper", str(UPPER)))
    assert answer == list(alone[0].outputs[0].token_ids)


def test_the_counterpart_of_an_s3_adapter_is_its_draft_prefix() -> None:
    assert draft_source("s3://bucket/tenants/t/adapters/a/") == "s3://bucket/tenants/t/adapters/a/draft"
    assert draft_source("s3://bucket/a") == "s3://bucket/a/draft"
    assert draft_source("/srv/adapters/a") == "/srv/adapters/a/draft"
