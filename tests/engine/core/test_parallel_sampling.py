"""n > 1: the prompt is prefilled once and its blocks shared by reference count; each choice samples with its own
seed stream; the offline API returns the n choices of a prompt as one output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _support.checkpoints import tiny_spec

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.errors import RequestError
from loraplex.engine.tools.demo import write_random_model

pytestmark = pytest.mark.unit

BLOCK = 16
PROMPT = [(5 * i) % 400 + 4 for i in range(4 * BLOCK + 6)]  # four full blocks and a partial one


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("n") / "m", tiny_spec(max_position_embeddings=512))


class PoolWatch:
    """A logits processor that records the pool's KV pages each time it runs (once per step per row)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.kv_pages: list[int] = []

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.kv_pages.append(self.llm.engine.pool.usage().by_kind.get("kv", 0))
        return logits


def test_choices_share_the_prompts_blocks(model: Path) -> None:
    llm = LLM(model, device="cpu", dtype="float32", block_size=BLOCK)
    watch = PoolWatch(llm)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, logits_processors=[watch])
    [output] = llm.generate([{"prompt_token_ids": PROMPT}], params)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in output.outputs)
    assert output.num_cached_tokens == 0  # the prompt was computed once, by the first choice, for the bill too
    # All three running: 4 shared prompt blocks + one partial block each, not 3 x 5 blocks.
    assert max(watch.kv_pages) == 4 + 3
    # Each choice its own seed stream: the same as a single request seeded seed + j.
    for j, completion in enumerate(output.outputs):
        [alone] = llm.generate(
            [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=1.0, seed=1 + j, max_tokens=8, ignore_eos=True)
        )
        assert completion.token_ids == alone.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_without_a_seed_choices_differ_and_n_is_bounded(model: Path) -> None:
    llm = LLM(model, device="cpu", dtype="float32")
    [output] = llm.generate(["Hello"], SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4
    with pytest.raises(RequestError) as caught:
        SamplingParams(n=129)
    assert caught.value.param == "n"
    with pytest.raises(RequestError):
        llm.engine.add_request("x", [1, 2], SamplingParams(n=2))  # the engine takes one choice per request
