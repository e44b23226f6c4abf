"""The checks a request passes once, wherever it enters the engine: its prompt's ids and length against the model,
its sampling parameters against what the engine was started with; `CheckedPrompt` is what passes."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.core.structured_output import CompiledGrammar, GrammarCompiler
from loraplex.engine.errors import ContextLengthExceeded, RequestError
from loraplex.engine.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class CheckedPrompt:
    """A prompt and its sampling parameters that `check_request` found able to run, with the room it
    leaves for the completion. Made only there: a request is checked once, wherever it enters the engine."""

    token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # min(params.max_tokens, room left in the context)
    grammar: CompiledGrammar | None = None  # params.structured_outputs, compiled


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    reasoning: bool,
    grammars: GrammarCompiler,
) -> CheckedPrompt:
    """Raise RequestError if the request can never run on a model of `vocab_size` and `max_model_len` (with a
    reasoning parser or not); else the checked prompt, with how many tokens it may generate at most. A new grammar
    is compiled into `grammars` (thread-safe)."""
    if not prompt_token_ids:
        raise RequestError("the prompt must contain at least one token", param="prompt")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    num_prompt = len(prompt_token_ids)
    room = max_model_len - num_prompt
    if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
        asked = num_prompt + (params.max_tokens or 0)
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{asked} tokens ({num_prompt} in the prompt, {params.max_tokens or 0} for the completion). "
            "Please reduce the length of the prompt or the completion."
        )
    if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:  # sorted by token id
        token = params.logit_bias[-1][0]
        raise RequestError(
            f"logit_bias names token {token}, which is not in the vocabulary (ids 0 to {vocab_size - 1})",
            param="logit_bias",
        )
    if params.reasoning and not reasoning:
        field = "thinking_token_budget" if params.thinking_token_budget is not None else "reasoning"
        raise RequestError(
            f"{field} needs a reasoning model: this engine was started without --reasoning-parser",
            code="unsupported_value",
            param=field,
        )
    grammar = grammars.compile(params.structured_outputs) if params.structured_outputs is not None else None
    return CheckedPrompt(list(prompt_token_ids), params, min(params.max_tokens or room, room), grammar)


def check_prompt_text(tokenizer: Tokenizer, max_model_len: int, text: str, param: str = "prompt") -> None:
    """Raise ContextLengthExceeded if `text` is surely too long for the context, told from its length alone, so
    that a prompt megabytes long is refused before it is tokenized."""
    if tokenizer.surely_longer_than(text, max_model_len - 1):
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
            f"{len(text)} characters long, more than that many tokens can hold. Please reduce the length of the "
            "prompt.",
            param=param,
        )
