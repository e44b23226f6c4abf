"""Running an engine the way the exactness tests compare engines: every prefill position's logits through the
engine's own step path, and a greedy batch's tokens with every step's logits (tensor-parallel and family tests)."""

from __future__ import annotations

import dataclasses

import torch

from _support.recording import Recorder
from loraplex.engine import LLM, SamplingParams
from loraplex.engine.core.runner import PreparedStep

ATOL = 1e-4


def prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits [len(prompt), vocab] at every position of one prefill, through the engine's own step path (so under
    tensor parallelism the other ranks run it too and rank 0 gathers the vocabulary)."""
    core = llm.engine
    core.add_request("prefill", prompt, SamplingParams(temperature=0, max_tokens=1))
    prepared = core.runner.prepare(core.scheduler.schedule())
    host = dataclasses.replace(prepared.host, logits_widths=prepared.host.query_lens.copy())
    batch = host.forward_batch(
        num_kv_heads=core.model.config.num_kv_heads,
        block_size=core.config.block_size,
        device=core.device,
        lora=core.runner.lora,
    )
    logits = core.runner.execute(PreparedStep(host, batch, [], [], [0]))
    core.abort_request("prefill")
    return logits


def decode_run(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy tokens and every step's logits of a batch of prompts."""
    recorders = [Recorder() for _ in prompts]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logits_processors=[r])
        for n, r in zip(max_tokens, recorders, strict=True)
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, r.steps) for o, r in zip(outputs, recorders, strict=True)]


def assert_same_runs(
    ours: list[tuple[list[int], list[torch.Tensor]]], reference: list[tuple[list[int], list[torch.Tensor]]]
) -> None:
    for row, ((tokens, steps), (ref_tokens, ref_steps)) in enumerate(zip(ours, reference, strict=True)):
        assert tokens == ref_tokens, f"row {row}: greedy tokens differ"
        assert len(steps) == len(ref_steps) == len(tokens)
        for k, (a, b) in enumerate(zip(steps, ref_steps, strict=True)):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m, k=k, row=row: f"row {row} step {k}: {m}")
