"""A logits processor that records what the engine sampled from, for tests that compare logits step by step."""

from __future__ import annotations

import torch


class Recorder:
    """Keeps a copy of the raw logits of every step one request samples (one per output token: a preempted request
    recomputes but samples each position once)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        assert len(output_token_ids) == len(self.steps)
        self.steps.append(logits.clone())
        return logits
