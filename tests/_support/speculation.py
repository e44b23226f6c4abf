"""The demo model, prompts and engine helpers the speculative decoding tests share (test_speculative_decoding.py,
test_draft_model.py, test_draft_adapters.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.draft_model import DraftModelProposer
from loraplex.engine.core.speculator import SpeculationCounts

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "demo" / "model"
UPPER = REPO / "demo" / "adapters" / "upper"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [
    'The "for" statement is used to iterate over the elements of a sequence. The "for" statement',
    'Tell me about the "json" module.',
    'The "if" statement is used for conditional execution: The "if"',
    "What is the difference between a list and a tuple?",
    'The "while" statement is used for repeated execution as long as an expression is true. The "while"',
    'Tell me about the "try" statement.',
]
PREEMPTION = {"kv_budget": 8 * 64 * 2**10, "max_model_len": 96}  # 8 pages: requests are preempted and recomputed


def draft_config(model: Path, **fields: Any) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 4, **fields}


def demo(**options: Any) -> LLM:
    return LLM(DEMO, device="cpu", dtype="float32", **options)


def speculative(draft: Path, **options: Any) -> LLM:
    """The demo model speculating with `draft`, deciding from acceptance and room alone (not the gate's clock, which
    under a loaded machine may switch speculation off), so tests may count proposals."""
    return demo(
        speculative_config=draft_config(draft), speculative_knee_tokens=64, speculative_use_clock=False, **options
    )


def run(llm: LLM, loras: list[LoRARequest | None] | None = None) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outputs]


def proposer_of(llm: LLM) -> DraftModelProposer:
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    assert isinstance(speculator.proposer, DraftModelProposer)
    return speculator.proposer


def counts_of(llm: LLM, adapter: str) -> SpeculationCounts:
    """Speculation's totals on the rows of `adapter` ("" the base model)."""
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    return speculator.stats.by_adapter.get(adapter, SpeculationCounts())


def totals(llm: LLM) -> tuple[int, int]:
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    counts = speculator.stats.by_adapter.values()
    return sum(c.num_proposed for c in counts), sum(c.num_accepted for c in counts)
