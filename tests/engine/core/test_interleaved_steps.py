"""Interleaved steps (issue 37, point 4; docs/decisions/0053): a light key's newcomer runs in a short step between two
layers of a flood's long prefill step, its first token handed out before that step ends; every request, the
newcomers' and the paused step's, computes exactly what it computes alone."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from _support.checkpoints import VOCAB, tiny_spec
from _support.engine_runs import assert_same_runs
from _support.recording import Recorder

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.lora.ref import LoRARequest
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo import write_random_model
from loraplex.engine.tools.demo_adapter import write_random_adapter

pytestmark = pytest.mark.unit

OPTIONS = {"device": "cpu", "dtype": "float32", "max_num_batched_tokens": 256, "max_num_seqs": 8}


def test_newcomers_run_between_the_layers_of_a_flood_s_step_and_everyone_computes_what_they_would_alone(
    tmp_path: Path,
) -> None:
    model = write_random_model(tmp_path / "m", tiny_spec(max_position_embeddings=1024))
    adapter = write_random_adapter(tmp_path / "lora", ModelConfig.from_dir(model), rank=8, seed=3, init_std=0.2)
    lora = LoRARequest("b-tune", str(adapter))
    rng = random.Random(0)
    floods = [[rng.randrange(4, VOCAB) for _ in range(600)] for _ in range(3)]
    newcomers = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (20, 9, 40)]
    newcomer_loras = [None, lora, None]
    max_tokens = 6

    llm = LLM(model, **OPTIONS)
    core = llm.engine
    ref = core.resolve_lora(lora)
    core.add_request("warm", [5, 6, 7], SamplingParams(max_tokens=1), lora=ref)  # the adapter resident
    while core.has_unfinished_requests():
        core.step()

    recorders: dict[str, Recorder] = {}

    def add(request_id: str, prompt: list[int], key: str, adapter: LoRARequest | None) -> None:
        recorders[request_id] = Recorder()
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, logits_processors=[recorders[request_id]]
        )
        core.add_request(
            request_id, prompt, params, fairness_key=key, lora=None if adapter is None else core.resolve_lora(adapter)
        )

    for i, prompt in enumerate(floods):
        add(f"a{i}", prompt, "a", None)
    # The newcomers arrive at chosen layer boundaries of the first long steps: the 1st, 4th and 5th calls.
    arrive_at = {1: 0, 4: 1, 5: 2}
    calls = 0

    def arrivals() -> bool:
        nonlocal calls
        calls += 1
        index = arrive_at.get(calls)
        if index is None:
            return False
        add(f"b{index}", newcomers[index], "b", newcomer_loras[index])
        return True

    events: list[tuple[str, str]] = []  # ("inside", id) for outputs delivered mid-step, ("after", id) at its end
    tokens: dict[str, list[int]] = {}

    def deliver(output: RequestOutput) -> None:
        events.append(("inside", output.request_id))
        tokens[output.request_id] = list(output.outputs[0].token_ids)

    while core.has_unfinished_requests():
        events.append(("step", ""))
        for output in core.step(arrivals=arrivals, deliver=deliver):
            events.append(("after", output.request_id))
            tokens[output.request_id] = list(output.outputs[0].token_ids)

    assert core.num_interleaved_steps == 3
    for index in range(3):
        first = next(e for e in events if e[1] == f"b{index}")
        assert first[0] == "inside", f"b{index}'s first token waited for the flood's step to end"
    # The flood's prompts were mid-prefill then: none of theirs had sampled a token before b0's.
    assert not any(e[1].startswith("a") for e in events[: events.index(("inside", "b0"))])

    # Each request alone, on a fresh engine, is the reference: same tokens, same logits at every step.
    alone = LLM(model, **OPTIONS)
    reference = {}
    for request_id, prompt, adapter_request in [
        *((f"a{i}", p, None) for i, p in enumerate(floods)),
        *((f"b{i}", p, newcomer_loras[i]) for i, p in enumerate(newcomers)),
    ]:
        recorder = Recorder()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logits_processors=[recorder])
        (out,) = alone.generate([{"prompt_token_ids": prompt}], params, lora_request=adapter_request)
        reference[request_id] = (list(out.outputs[0].token_ids), recorder.steps)
    ids = sorted(reference)
    assert_same_runs([(tokens[i], recorders[i].steps) for i in ids], [reference[i] for i in ids])


def test_without_arrivals_or_under_fcfs_a_step_runs_whole(tmp_path: Path) -> None:
    model = write_random_model(tmp_path / "m", tiny_spec(max_position_embeddings=1024))
    for policy in ("fair", "fcfs"):
        core = LLM(model, **OPTIONS, scheduling_policy=policy).engine
        core.add_request("a", list(range(4, 504)), SamplingParams(max_tokens=2), fairness_key="a")
        asked: list[int] = []

        def arrivals(core: EngineCore = core, asked: list[int] = asked) -> bool:
            asked.append(1)
            if len(asked) == 1:
                core.add_request("b", [4, 5, 6], SamplingParams(max_tokens=2), fairness_key="b")
                return True
            return False

        core.step(arrivals=arrivals, deliver=lambda output: None)
        assert core.num_interleaved_steps == (1 if policy == "fair" else 0)
        assert len(asked) == (2 if policy == "fair" else 0)  # after each of the tiny model's two layers
