"""The batched sampler: one call per step picks the next token of every row of the logits.

Semantics, per row, in this order (the reference loop; the code does it for all rows at once):
1. Adjustments of the row's raw logits: `logit_bias` is added; then the penalties, with `count[t]` the times token
   t is in the row's output so far: `x[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)`
   (OpenAI's), and for each token t in the prompt or the output, `x[t] /= repetition_penalty` if x[t] > 0 else
   `x[t] *= repetition_penalty` (vLLM's); then `logits_processors`, in order; then the grammar's mask (tokens the
   row's grammar does not allow) and the caller's forbidden tokens (EOS and stop tokens before `min_tokens`) are
   set to -inf, so nothing before can re-allow them.
   A forced row (a think block closed by its budget, reasoning.py) takes its forced token after steps 2-3, whatever
   they drew; its logprobs are still those of step 4.
2. Greedy rows (temperature below GREEDY_TEMPERATURE, whatever else is set) take `argmax`: the lowest index
   on ties, as `torch.argmax`.
3. Other rows: x = logits / temperature, p = softmax(x). Every filter keeps an upper set of x, ties included:
   - top-k keeps tokens with x >= the k-th largest x (more than k only on ties, as vLLM and transformers do);
   - top-p keeps token i iff the top-k-renormalized mass of the tokens strictly more likely than i is below
     top_p: the smallest set of most likely tokens whose mass reaches top_p, ties at the edge kept. The most
     likely token always stays;
   - min-p keeps tokens with p >= min_p * max(p), that is x >= max(x) + log(min_p).
   The token is drawn from p restricted to what all three keep.
4. Logprobs (when asked) come from log_softmax of the raw logits, before processors, forbidden tokens and
   temperature: vLLM v1's default ("raw_logprobs"). They describe the model, not the sampling settings, so a
   forbidden or filtered token can show up among the top ones with a finite logprob. rank = 1 + the number of
   tokens with a strictly larger logprob (the greedy token is always rank 1).

How it samples without sorting: a full sort of the batch's logits and exponential noise for the Gumbel race both
cost a CPU more than the whole rest of sampling (decision 0019), so neither is used:
- a row's token is drawn by inverse CDF from ONE uniform number: cumulative sums of the weights in blocks of
  `_BLOCK` tokens (fast, and float32-accurate since each sum is short), search the block, then the token;
- top-p is exact rejection sampling: draw from the row's other filters, accept if the draw lies in the
  nucleus (a single masked sum), else drop every token no more likely than the draw (none of them can be in
  the nucleus) and draw again. A draw is accepted with probability at least top_p, and each rejection cuts a
  tail, so at top_p = 0.9 a batch of 64 needs two or three rounds, the later ones on a few rows only.
- top-k uses `torch.topk` with the largest k in the batch (no full sort unless someone asks for k ~ vocab).

Seeds: a seeded row's uniforms come from its own generator, one per draw, and every operation above works
within a row, so its tokens depend only on its generator and its logits, never on the batch around it.
Unseeded rows draw their uniforms together from the step's default generator. The engine gives a seeded request
a fresh generator for each output position, `position_generator(seed, position)`: its token at a position then
depends on the seed, the position and the logits only, whether that position is sampled alone or as one of the
positions a speculating row verifies at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.engine.core.sampling_params import LogitsProcessor, SamplingParams
from loraplex.engine.core.structured_output import GrammarMasks, apply_masks

logger = logging.getLogger(__name__)

_BLOCK = 128  # tokens per block of the two-level inverse CDF

# Rejection rounds are few (see the module docstring); the cap only bounds a pathological row (NaN logits),
# which then takes its most likely token, a token every filter keeps.
_MAX_DRAW_ROUNDS = 64


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_generator(seed: int, position: int, device: torch.device | str) -> torch.Generator:
    """The generator a request with `seed` samples its output token at `position` (0 for the first) with: seeded
    from the two alone (splitmix64, so nearby seeds and positions give unrelated streams)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 1)
    return generator


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The sampled token's raw logprob and rank, and the top `logprobs` tokens sorted by logprob, descending."""

    token_id: int
    logprob: float
    rank: int  # 1 + number of tokens with a strictly larger logprob
    top: list[tuple[int, float]]  # (token id, logprob), len = the request's `logprobs`


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None] | None = None  # per row; None when no row asked for logprobs


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step sampling tensors, built once per step by `build`; row i is row i of the step's logits.

    Random rows are the rows that do not sample greedily; per-random-row tensors are indexed by position among
    them (`random_rows[j]` is the logits row of position j). A filter's tensor is None when no random row uses it.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy_rows: torch.Tensor | None  # [num_greedy] int64 logits rows; None unless the batch mixes both kinds
    random_rows: torch.Tensor | None  # [num_random] int64 logits rows; None unless the batch mixes both kinds
    temperature: torch.Tensor | None  # [num_random] float32, > 0; None when all are 1.0 (nothing to divide)
    top_k: torch.Tensor | None  # [num_random] int64; 0 = no limit
    max_top_k: int  # largest top_k among random rows (0 when top_k is None)
    top_p: torch.Tensor | None  # [num_random] float32; 1.0 = no limit
    min_p: torch.Tensor | None  # [num_random] float32; 0.0 = no limit
    generators: dict[int, torch.Generator]  # position among random rows -> the request's own generator
    default_generator: torch.Generator | None  # for rows without one; None: torch's default for the device
    num_logprobs: list[int | None]  # per row: how many top logprobs, None for none
    max_num_logprobs: int | None  # None when no row asked for logprobs
    logprob_rows: torch.Tensor | None  # [num_logprob_rows] int64; None when every row (or none) asked
    logits_processors: list[tuple[int, tuple[LogitsProcessor, ...]]]  # (row, its processors), rows that have some
    output_token_ids: list[list[int]]  # per row, what processors see; owned by the caller, not copied
    forbidden_rows: torch.Tensor | None  # [num_forbidden] int64 row of each forbidden (row, token) pair
    forbidden_token_ids: torch.Tensor | None  # [num_forbidden] int64 token of each pair
    max_forbidden_token_id: int  # -1 when there are none; ids >= vocab are ignored at sampling time
    bias_rows: torch.Tensor | None = None  # [num_biases] int64 row of each logit_bias entry
    bias_token_ids: torch.Tensor | None = None  # [num_biases] int64 (below the vocab: check_request saw to it)
    bias_values: torch.Tensor | None = None  # [num_biases] float32
    penalty_rows: torch.Tensor | None = None  # [num_penalized] int64 rows with any penalty
    presence_penalty: torch.Tensor | None = None  # [num_penalized] float32
    frequency_penalty: torch.Tensor | None = None  # [num_penalized] float32
    repetition_penalty: torch.Tensor | None = None  # [num_penalized] float32; None when every row's is 1
    output_ids: torch.Tensor | None = None  # [num_penalized, longest output] int64, padded with 0
    output_mask: torch.Tensor | None = None  # [num_penalized, longest output] float32: 1 for a real token
    seen_ids: torch.Tensor | None = None  # [num_penalized, longest prompt+output] int64, padded with 0 (repetition)
    seen_mask: torch.Tensor | None = None  # same shape, float32: 1 for a real token
    grammar: GrammarMasks | None = None  # the constrained rows' allowed tokens
    forced_rows: torch.Tensor | None = None  # [num_forced] int64 rows whose token is decided already
    forced_token_ids: torch.Tensor | None = None  # [num_forced] int64 their tokens (a think block's forced close)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        output_token_ids: list[list[int]],
        *,
        device: torch.device | str,
        forbidden_token_ids: Sequence[frozenset[int]] | None = None,
        default_generator: torch.Generator | None = None,
        prompt_token_ids: Sequence[list[int]] | None = None,
        grammar: GrammarMasks | None = None,
        forced_token_ids: Sequence[int | None] | None = None,
    ) -> SamplingMetadata:
        """One step's metadata: row i samples for `params[i]` with `generators[i]` (the request's own generator,
        seeded once when the request started, or None), whose tokens so far are `output_token_ids[i]` and which
        may not sample `forbidden_token_ids[i]` this step; a row whose `forced_token_ids[i]` is set takes that token
        whatever its logits say (its logprobs are still the model's)."""
        num_rows = len(params)
        forbidden = forbidden_token_ids if forbidden_token_ids is not None else [frozenset()] * num_rows
        if not len(generators) == len(output_token_ids) == len(forbidden) == num_rows:
            raise ValueError(
                f"one entry per row expected: {num_rows} params, {len(generators)} generators, "
                f"{len(output_token_ids)} output token lists, {len(forbidden)} forbidden sets"
            )
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        mixed = bool(random_rows) and bool(greedy_rows)
        random_params = [params[i] for i in random_rows]

        temperatures = [p.temperature for p in random_params]
        top_ks = [max(p.top_k, 0) for p in random_params]
        top_ps = [p.top_p for p in random_params]
        min_ps = [p.min_p for p in random_params]

        num_logprobs = [p.logprobs for p in params]
        logprob_rows = [i for i, n in enumerate(num_logprobs) if n is not None]
        max_num_logprobs = max((n for n in num_logprobs if n is not None), default=None)

        pair_rows = [row for row, tokens in enumerate(forbidden) for _ in tokens]
        pair_tokens = [token for tokens in forbidden for token in tokens]

        def int_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        def float_tensor(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        bias_pairs = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        penalties: dict[str, torch.Tensor | None] = {}
        if penalized:
            if prompt_token_ids is None and any(params[i].repetition_penalty != 1.0 for i in penalized):
                raise ValueError("repetition_penalty needs the rows' prompt token ids")
            outputs = [output_token_ids[i] for i in penalized]
            penalties["output_ids"], penalties["output_mask"] = _padded(outputs, device)
            repetition = [params[i].repetition_penalty for i in penalized]
            if any(r != 1.0 for r in repetition):
                assert prompt_token_ids is not None
                seen = [prompt_token_ids[i] + output_token_ids[i] for i in penalized]
                penalties["seen_ids"], penalties["seen_mask"] = _padded(seen, device)
                penalties["repetition_penalty"] = float_tensor(repetition)
            penalties["penalty_rows"] = int_tensor(penalized)
            penalties["presence_penalty"] = float_tensor([params[i].presence_penalty for i in penalized])
            penalties["frequency_penalty"] = float_tensor([params[i].frequency_penalty for i in penalized])

        forced = [(row, token) for row, token in enumerate(forced_token_ids or ()) if token is not None]
        return cls(
            num_rows=num_rows,
            all_greedy=not random_rows,
            all_random=not greedy_rows,
            greedy_rows=int_tensor(greedy_rows) if mixed else None,
            random_rows=int_tensor(random_rows) if mixed else None,
            temperature=float_tensor(temperatures) if any(t != 1.0 for t in temperatures) else None,
            top_k=int_tensor(top_ks) if any(top_ks) else None,
            max_top_k=max(top_ks, default=0),
            top_p=float_tensor(top_ps) if any(p < 1.0 for p in top_ps) else None,
            min_p=float_tensor(min_ps) if any(min_ps) else None,
            generators={j: g for j, row in enumerate(random_rows) if (g := generators[row]) is not None},
            default_generator=default_generator,
            num_logprobs=num_logprobs,
            max_num_logprobs=max_num_logprobs,
            logprob_rows=int_tensor(logprob_rows) if 0 < len(logprob_rows) < num_rows else None,
            logits_processors=[(i, p.logits_processors) for i, p in enumerate(params) if p.logits_processors],
            output_token_ids=output_token_ids,
            forbidden_rows=int_tensor(pair_rows) if pair_rows else None,
            forbidden_token_ids=int_tensor(pair_tokens) if pair_tokens else None,
            max_forbidden_token_id=max(pair_tokens, default=-1),
            bias_rows=int_tensor([r for r, _, _ in bias_pairs]) if bias_pairs else None,
            bias_token_ids=int_tensor([t for _, t, _ in bias_pairs]) if bias_pairs else None,
            bias_values=float_tensor([b for _, _, b in bias_pairs]) if bias_pairs else None,
            grammar=grammar,
            forced_rows=int_tensor([row for row, _ in forced]) if forced else None,
            forced_token_ids=int_tensor([token for _, token in forced]) if forced else None,
            **penalties,
        )


def _padded(rows: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one [len(rows), longest] int64 tensor padded with 0, and its float32 mask of real tokens."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, tokens in enumerate(rows):
        if tokens:
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            mask[i, : len(tokens)] = 1.0
    return ids.to(device), mask.to(device)


class Sampler:
    """Stateless; the engine keeps one and calls `sample` once per step."""

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Pick one token per row of `logits` [num_rows, vocab] (float32, on the engine's device).

        The caller's `logits` are left unchanged. Everything stays on the logits' device; the chosen ids come to
        the host in one transfer (with logprobs: ids, ranks and top ids in one, the floats in a second). Apart
        from that, only top-p rounds after the first and processors, if any, wait for the device.
        """
        if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
            raise ValueError(f"logits must be [{metadata.num_rows}, vocab], got {list(logits.shape)}")
        if metadata.num_rows == 0:
            return SamplerOutput(token_ids=[])
        raw = logits.float()
        processed = adjusted_logits(raw, metadata)
        token_ids = _choose(processed, metadata)
        if metadata.forced_rows is not None and metadata.forced_token_ids is not None:
            token_ids[metadata.forced_rows] = metadata.forced_token_ids
        if metadata.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids.tolist())
        return _with_logprobs(raw, token_ids, metadata.max_num_logprobs, metadata)


def adjusted_logits(raw: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits after step 1 of the module doc; `raw` itself when nothing applies, else a new tensor."""
    if (
        not md.logits_processors
        and md.forbidden_rows is None
        and md.bias_rows is None
        and md.penalty_rows is None
        and md.grammar is None
    ):
        return raw
    logits = raw.clone()
    vocab = logits.shape[1]
    if md.bias_rows is not None and md.bias_token_ids is not None and md.bias_values is not None:
        logits.index_put_((md.bias_rows, md.bias_token_ids), md.bias_values, accumulate=True)
    if md.penalty_rows is not None:
        _apply_penalties(logits, md)
    for row, processors in md.logits_processors:
        row_logits = logits[row]
        out = row_logits
        for processor in processors:
            out = processor(md.output_token_ids[row], out)
        if out is not row_logits:
            row_logits.copy_(out)
    if md.grammar is not None:
        apply_masks(logits, md.grammar)
    if md.forbidden_rows is not None and md.forbidden_token_ids is not None:
        rows, tokens = md.forbidden_rows, md.forbidden_token_ids
        if md.max_forbidden_token_id >= vocab:  # an id past this model's vocab cannot be sampled anyway
            in_vocab = tokens < vocab
            rows, tokens = rows[in_vocab], tokens[in_vocab]
        logits.index_put_((rows, tokens), torch.tensor(float("-inf"), device=logits.device))
    return logits


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Presence, frequency and repetition penalties of the penalized rows, in place, all rows at once."""
    assert md.penalty_rows is not None
    assert md.output_ids is not None
    assert md.output_mask is not None
    assert md.presence_penalty is not None
    assert md.frequency_penalty is not None
    rows = md.penalty_rows
    vocab = logits.shape[1]
    x = logits[rows]
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, md.output_ids.clamp(max=vocab - 1), md.output_mask)
    x -= md.frequency_penalty[:, None] * counts + md.presence_penalty[:, None] * counts.clamp(max=1.0)
    if md.repetition_penalty is not None and md.seen_ids is not None and md.seen_mask is not None:
        seen = torch.zeros(len(rows), vocab, dtype=torch.float32, device=logits.device)
        seen.scatter_add_(1, md.seen_ids.clamp(max=vocab - 1), md.seen_mask)
        penalty = md.repetition_penalty[:, None]
        penalized = torch.where(x > 0, x / penalty, x * penalty)
        x = torch.where(seen > 0, penalized, x)
    logits[rows] = x


def _choose(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[num_rows] int64 token ids."""
    if md.greedy_rows is None or md.random_rows is None:  # not a mixed batch
        return logits.argmax(dim=-1) if md.all_greedy else _sample_random(logits, md)
    token_ids = torch.empty(md.num_rows, dtype=torch.int64, device=logits.device)
    token_ids[md.greedy_rows] = logits[md.greedy_rows].argmax(dim=-1)
    token_ids[md.random_rows] = _sample_random(logits[md.random_rows], md)
    return token_ids


def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Sample the random rows; `logits` [num_random, vocab] holds just them, in `random_rows` order."""
    num_rows, vocab = logits.shape
    x = logits if md.temperature is None else logits / md.temperature[:, None]  # never modified in place

    # Floors are finite (the lowest float32 means none) so that the masks' arithmetic never meets inf - inf.
    lowest = torch.finfo(torch.float32).min
    floor: torch.Tensor | None = None  # [num_rows] smallest x each row keeps (inclusive), before top-p
    top_k_floor: torch.Tensor | None = None
    if md.top_k is not None:
        k = md.top_k.clamp(max=vocab)
        kth_largest = x.topk(min(md.max_top_k, vocab), dim=-1).values.gather(1, (k.clamp(min=1) - 1)[:, None])
        top_k_floor = torch.where(k > 0, kth_largest.squeeze(1), lowest)
        floor = top_k_floor
    if md.min_p is not None:
        min_p_floor = (x.amax(dim=-1) + md.min_p.log()).clamp(min=lowest)  # log(0) = -inf: no limit
        floor = min_p_floor if floor is None else torch.maximum(floor, min_p_floor)

    probs = x.softmax(dim=-1)
    nucleus_budget: torch.Tensor | None = None  # [num_rows] accept a draw iff the mass above it is below this
    if md.top_p is not None:
        top_k_mass = (
            _keep_at_least(probs, x, top_k_floor).sum(dim=-1)
            if top_k_floor is not None
            else torch.ones(num_rows, device=x.device)
        )
        # top_p = 1 must never reject: the mass above a tiny-probability draw can round to the whole mass.
        nucleus_budget = torch.where(md.top_p < 1.0, md.top_p * top_k_mass, float("inf"))
    return _draw(x, probs, floor, nucleus_budget, md)


def _draw(
    x: torch.Tensor,
    probs: torch.Tensor,
    floor: torch.Tensor | None,
    nucleus_budget: torch.Tensor | None,
    md: SamplingMetadata,
) -> torch.Tensor:
    """Draw from `probs` [n, vocab] restricted to x >= floor, by rejection for the nucleus (see the module doc)."""
    num_rows = x.shape[0]
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    pending = torch.arange(num_rows, device=x.device)  # positions still drawing
    pending_list: list[int] | None = None  # host copy of `pending` after the first round, for seeded rows
    for _ in range(_MAX_DRAW_ROUNDS):
        weights = probs if floor is None else _keep_at_least(probs, x, floor)
        uniforms = _uniforms(pending, pending_list, md)
        drawn = inverse_cdf(weights, uniforms)
        if nucleus_budget is None:
            token_ids[pending] = drawn
            return token_ids
        drawn_x = x.gather(1, drawn[:, None])
        mass_above = torch.linalg.vecdot(_step_above(x, drawn_x), probs)
        accepted = mass_above < nucleus_budget
        token_ids[pending[accepted]] = drawn[accepted]
        rejected = ~accepted
        if not bool(rejected.any()):
            return token_ids
        pending, x, probs, nucleus_budget = pending[rejected], x[rejected], probs[rejected], nucleus_budget[rejected]
        # Every token at most as likely as a rejected draw is outside the nucleus too; the old floor is lower.
        floor = torch.nextafter(drawn_x[rejected].squeeze(1), torch.tensor(float("inf"), device=x.device))
        pending_list = pending.tolist() if md.generators else []
    logger.warning("sampling gave up drawing for %d rows (non-finite logits?); taking their argmax", len(pending))
    token_ids[pending] = x.argmax(dim=-1)
    return token_ids


# Masks as float arithmetic: on CPU, torch.where and reductions over bool tensors cost several times more (0019).
# For floats a and b, a - b > 0 exactly when a > b, and clamp(., 0, 1).ceil() turns that into 1.0 or 0.0.


def _step_above(x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """[n, vocab] 1.0 where x > level [n, 1] (finite), else 0.0."""
    return (x - level).clamp_(0.0, 1.0).ceil_()


def _keep_at_least(probs: torch.Tensor, x: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """probs where x >= floor [n] (finite), else 0.0."""
    below = (floor[:, None] - x).clamp_(0.0, 1.0).ceil_()
    return torch.addcmul(probs, probs, below, value=-1.0)


def _uniforms(pending: torch.Tensor, pending_list: list[int] | None, md: SamplingMetadata) -> torch.Tensor:
    """One uniform in [0, 1) per pending row: a seeded row's from its own generator, the rest from the default."""
    device = pending.device
    uniforms = torch.rand(pending.shape[0], generator=md.default_generator, device=device)
    if pending_list is None:  # first round: every row is pending, in order
        for position, generator in md.generators.items():
            uniforms[position] = torch.rand((), generator=generator, device=device)
        return uniforms
    for i, position in enumerate(pending_list):
        if (own := md.generators.get(position)) is not None:
            uniforms[i] = torch.rand((), generator=own, device=device)
    return uniforms


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[n] int64: for each row, the token whose cumulative-weight interval holds uniform * total.

    weights [n, vocab] are >= 0 with a positive entry per row; a token of zero weight is never returned. Sums run
    over blocks of _BLOCK tokens and then over block totals, which keeps float32 rounding small and vectorizes.
    """
    num_rows, vocab = weights.shape
    num_blocks = -(-vocab // _BLOCK)
    if num_blocks * _BLOCK != vocab:
        weights = F.pad(weights, (0, num_blocks * _BLOCK - vocab))
    within = weights.view(num_rows, num_blocks, _BLOCK).cumsum(dim=-1)  # running sum inside each block
    block_cum = within[:, :, -1].cumsum(dim=-1)  # [n, num_blocks] running sum of block totals
    total = block_cum[:, -1:]
    zero = torch.zeros_like(total)
    # Strictly below the total, so some block's running sum exceeds it; u * total alone can round up to it.
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, zero))
    block = torch.searchsorted(block_cum, target, right=True).clamp(max=num_blocks - 1)  # [n, 1]
    before = torch.where(block > 0, block_cum.gather(1, (block - 1).clamp(min=0)), zero)
    block_within = within.gather(1, block[:, :, None].expand(num_rows, 1, _BLOCK)).squeeze(1)  # [n, _BLOCK]
    block_total = block_within[:, -1:]
    # The block was chosen on block_cum, whose rounding differs slightly from its own sums: stay inside it.
    local = torch.minimum(target - before, torch.nextafter(block_total, zero))
    offset = torch.searchsorted(block_within, local, right=True).clamp(max=_BLOCK - 1)
    return (block * _BLOCK + offset).squeeze(1).clamp(max=vocab - 1)


def _with_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, max_num_logprobs: int, md: SamplingMetadata
) -> SamplerOutput:
    rows = md.logprob_rows
    logprobs = (raw if rows is None else raw[rows]).log_softmax(dim=-1)
    chosen = token_ids if rows is None else token_ids[rows]
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = _step_above(logprobs, chosen_logprobs).sum(dim=-1).long() + 1  # float counts are exact below 2**24
    num_rows, num_top = md.num_rows, min(max_num_logprobs, raw.shape[1])
    top = logprobs.topk(num_top, dim=-1)
    # Two host transfers in all: every integer, then every float.
    ints = torch.cat([token_ids, ranks, top.indices.flatten()]).tolist()
    floats = torch.cat([chosen_logprobs.squeeze(1), top.values.flatten()]).tolist()
    host_ids: list[int] = ints[:num_rows]
    host_ranks, host_top_ids = ints[num_rows : num_rows + len(chosen)], ints[num_rows + len(chosen) :]
    host_logprobs, host_top_values = floats[: len(chosen)], floats[len(chosen) :]

    out: list[TokenLogprobs | None] = [None] * num_rows
    logprob_rows = range(num_rows) if rows is None else [i for i, n in enumerate(md.num_logprobs) if n is not None]
    for j, row in enumerate(logprob_rows):
        n = min(md.num_logprobs[row] or 0, num_top)
        start = j * num_top
        out[row] = TokenLogprobs(
            token_id=host_ids[row],
            logprob=host_logprobs[j],
            rank=host_ranks[j],
            top=list(zip(host_top_ids[start : start + n], host_top_values[start : start + n], strict=True)),
        )
    return SamplerOutput(token_ids=host_ids, logprobs=out)
