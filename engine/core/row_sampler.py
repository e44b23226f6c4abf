"""How a step's sampling rows are drawn: each row's positions (one, or one per proposal it verifies, then one), with
everything each position's distribution depends on (penalties, grammar masks, forbidden and forced tokens,
per-position generators), in one sampler call."""

from __future__ import annotations

import torch

from loraplex.engine.core.output_processor import OutputProcessor
from loraplex.engine.core.reasoning import Phase
from loraplex.engine.core.request import Request
from loraplex.engine.core.sampler import Sampler, SamplingMetadata, TokenLogprobs, position_generator
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.core.structured_output import GrammarCompiler, GrammarState, fill_bitmasks


class RowSampler:
    def __init__(
        self,
        sampler: Sampler,
        outputs: OutputProcessor,
        grammars: GrammarCompiler,
        vocab_size: int,
        default_generator: torch.Generator,
        device: torch.device,
    ) -> None:
        self.sampler = sampler
        self.outputs = outputs
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.default_generator = default_generator  # unseeded rows draw from it
        self.device = device

    def sample(
        self, rows: list[Request], proposals: list[list[int]], logits: torch.Tensor
    ) -> list[list[tuple[int, TokenLogprobs | None]]]:
        """What each row draws at each of its positions (one, or 1 + its proposal's length: the logits rows of
        runner.PreparedStep), with its logprobs when asked, in one sampler call. Position j of a row that verifies a
        proposal is sampled as the row would be had it kept the first j proposals: its output so far (for
        penalties), its grammar's mask, its forbidden tokens (min_tokens) and its think block's forced tokens all
        include them. A seeded row draws each position with that position's own generator
        (sampler.position_generator), so what it draws does not depend on whether the position was speculated.

        A row inside its think block has no grammar mask: the grammar constrains the answer after the block. A row
        with a grammar that may still open a block may take the grammar's tokens or the opening marker's first."""
        params: list[SamplingParams] = []
        generators: list[torch.Generator | None] = []
        outputs: list[list[int]] = []
        forbidden: list[frozenset[int]] = []
        forced: list[int | None] = []
        prompts: list[list[int]] = []
        constrained: list[tuple[int, GrammarState, list[int]]] = []
        also_allowed: list[tuple[int, int]] = []
        for request, proposal in zip(rows, proposals, strict=True):
            row_params = request.sampling_params
            seed = None if row_params.is_greedy else row_params.seed
            state = request.reasoning
            if request.grammar is not None:
                if state is None or not state.is_open:
                    constrained.append((len(params), request.grammar, proposal))
                elif state.phase is Phase.OPENING and not state.matched:  # such a row never speculates
                    constrained.append((len(params), request.grammar, []))
                    if state.forbids_marker() is None:
                        also_allowed.append((len(params), state.markers.start_ids[0]))
            done = request.output_token_ids
            for j in range(len(proposal) + 1):
                params.append(row_params)
                outputs.append(done if j == 0 else done + proposal[:j])
                banned = self.outputs.forbidden_tokens(request, ahead=j)
                if state is not None:
                    banned |= self.outputs.reasoning_forbidden(request, state)
                    forced.append(state.forced(complete_marker=request.grammar is not None))
                    if j < len(proposal):
                        state = state.after(proposal[j])
                else:
                    forced.append(None)
                forbidden.append(banned)
                prompts.append(request.prompt_token_ids)
                generators.append(None if seed is None else position_generator(seed, len(done) + j, self.device))
        metadata = SamplingMetadata.build(
            params,
            generators,
            outputs,
            forbidden_token_ids=forbidden,
            default_generator=self.default_generator,
            device=self.device,
            prompt_token_ids=prompts,
            grammar=fill_bitmasks(constrained, len(params), self.vocab_size, self.grammars.json_safe, also_allowed)
            if constrained
            else None,
            forced_token_ids=forced if any(token is not None for token in forced) else None,
        )
        sampled = self.sampler.sample(logits, metadata)
        drawn: list[list[tuple[int, TokenLogprobs | None]]] = []
        start = 0
        for proposal in proposals:
            end = start + len(proposal) + 1
            drawn.append(
                [
                    (sampled.token_ids[i], sampled.logprobs[i] if sampled.logprobs is not None else None)
                    for i in range(start, end)
                ]
            )
            start = end
        return drawn
