"""Verifying speculative proposals: which of a row's proposed tokens it keeps, and the token that follows them.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) keeps the output distribution exactly the target's.
Semantics, per row, with the target's distributions p[0..k] (p[j] after the first j proposals, each already
adjusted and filtered as the sampler does for that row), proposals d[0..k) drawn from the draft's distributions
q[0..k) (a deterministic proposer, such as n-gram lookup, has q[j] one-hot at d[j]), and uniforms u[j], v:
    for j in 0..k-1:
        if u[j] * q[j][d[j]] < p[j][d[j]]: keep d[j]          # with probability min(1, p/q)
        else: emit one token drawn with v from max(0, p[j] - q[j]) (normalized); stop
    if all k were kept: emit one token drawn with v from p[k]  # the bonus token
A greedy row's p[j] is one-hot at its argmax: it keeps d[j] exactly when d[j] is the argmax and otherwise emits
the argmax, which is token for token what the row would produce without speculation. The caller draws the uniforms
(a seeded row's from its own generator), so a row's result depends on its generator and its distributions only.

The engine's proposers (n-gram lookup, a draft model's argmax) are deterministic: q[j] is one-hot at d[j]. Then
the rule is: keep d[j] with probability p[j][d[j]], else emit a token drawn from p[j] without d[j], renormalized.
Drawing x[j] ~ p[j] and keeping d[j] iff x[j] == d[j], else emitting x[j], is that rule exactly (x[j] == d[j] has
probability p[j][d[j]], and x[j] given x[j] != d[j] is p[j] without d[j], renormalized). So the engine verifies by
sampling each position as the sampler samples it without speculation (`accepted_prefix`): the same distribution,
and for a seeded row, drawn from the same per-position generator, the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.core.sampler import inverse_cdf


@dataclass(frozen=True, slots=True)
class Verified:
    """One step's verification of every speculating row."""

    token_ids: torch.Tensor  # [rows, max_k + 1] int64: the kept proposals, then the emitted token; -1 after
    num_accepted: torch.Tensor  # [rows] int64: proposals kept (the row emits num_accepted + 1 tokens)


def verify(
    target_probs: torch.Tensor,  # [rows, max_k + 1, vocab] float: p[j], rows' distributions after j proposals
    draft_token_ids: torch.Tensor,  # [rows, max_k] int64: proposals; entries at j >= num_draft[i] are ignored
    num_draft: torch.Tensor,  # [rows] int64: proposals of each row, 0..max_k
    accept_uniforms: torch.Tensor,  # [rows, max_k] float in [0, 1): u[j]
    draw_uniforms: torch.Tensor,  # [rows] float in [0, 1): v
    draft_probs: torch.Tensor | None = None,  # [rows, max_k, vocab] q[j]; None: one-hot at the proposals
) -> Verified:
    """Keep or refuse every row's proposals and emit the token after them (see the module's semantics)."""
    num_rows, width, vocab = target_probs.shape
    max_k = width - 1
    if draft_token_ids.shape != (num_rows, max_k) or accept_uniforms.shape != (num_rows, max_k):
        raise ValueError("draft_token_ids and accept_uniforms must be [rows, max_k]")
    if num_draft.shape != (num_rows,) or draw_uniforms.shape != (num_rows,):
        raise ValueError("num_draft and draw_uniforms must have one entry per row")
    if draft_probs is not None and draft_probs.shape != (num_rows, max_k, vocab):
        raise ValueError("draft_probs must be [rows, max_k, vocab]")
    device = target_probs.device
    rows = torch.arange(num_rows, device=device)
    depth = torch.arange(max_k, device=device)
    proposals = draft_token_ids.clamp(0, vocab - 1)  # padding may hold anything; it is masked below
    p_at = target_probs[:, :max_k].gather(2, proposals[:, :, None]).squeeze(2)  # [rows, max_k]
    q_at = torch.ones_like(p_at) if draft_probs is None else draft_probs.gather(2, proposals[:, :, None]).squeeze(2)
    kept = (accept_uniforms * q_at < p_at) & (depth[None, :] < num_draft[:, None])
    num_accepted = kept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [rows] the kept prefix's length

    final = target_probs[rows, num_accepted]  # [rows, vocab] p at the first refusal, or p[k] for the bonus
    refused = num_accepted < num_draft
    if bool(refused.any()):
        at = num_accepted.clamp(max=max(max_k - 1, 0))
        if draft_probs is None:
            q_final = torch.zeros_like(final)
            q_final[rows, proposals[rows, at]] = 1.0
        else:
            q_final = draft_probs[rows, at]
        residual = (final - q_final).clamp(min=0.0)
        # A refusal means p < q at the proposal, so the residual has mass wherever p exceeds q; guard rounding.
        has_mass = residual.sum(dim=1) > 0
        residual = torch.where(has_mass[:, None], residual, final)
        final = torch.where(refused[:, None], residual, final)
    emitted = inverse_cdf(final, draw_uniforms)

    token_ids = torch.full((num_rows, max_k + 1), -1, dtype=torch.int64, device=device)
    keep_mask = depth[None, :] < num_accepted[:, None]
    token_ids[:, :max_k] = torch.where(keep_mask, draft_token_ids, token_ids[:, :max_k])
    token_ids[rows, num_accepted] = emitted
    return Verified(token_ids=token_ids, num_accepted=num_accepted)


def accepted_prefix(proposal: list[int], drawn: list[int]) -> int:
    """How many of a row's proposals it keeps, given `drawn`: the token the row samples at each position (len(proposal)
    + 1 of them; position j sampled as if the first j proposals were kept). It keeps proposals while they equal what
    was drawn, and then emits drawn[kept]: `verify` for a deterministic proposer (the module's last paragraph)."""
    if len(drawn) != len(proposal) + 1:
        raise ValueError(f"{len(proposal)} proposals need {len(proposal) + 1} drawn tokens, not {len(drawn)}")
    kept = 0
    while kept < len(proposal) and proposal[kept] == drawn[kept]:
        kept += 1
    return kept
