"""The serving logic behind the engine's OpenAI-compatible server: OpenAI requests in, engine requests out.

`OpenAIServing` validates a request (model, sampling fields, prompt length) into a `Job` before anything is sent,
so the HTTP layer can answer a bad request with a 400 even when it asked for a stream. It then runs the job's
engine requests (one per prompt, merged as their outputs come) and turns the outputs into OpenAI's responses or
stream chunks, recording each engine request's metrics and log line however it ends. A non-streaming request races
its generation against the client's disconnect and raises `ClientDisconnected` if the client goes first; closing a
stream's generator aborts its engine requests. HTTP framing (SSE, status codes, the error envelope) is `server`'s.

`model` names the base model or a registered LoRA adapter (`LoraRegistry`); the name is resolved to an
`AdapterRef` once, when the job is made, so a name re-pointed later never changes a request already accepted.
A request may instead carry its own adapter (`lora_adapter`: name, source, digest; `model` is then the base
model): its source must lie under the server's `AdapterRoots`, and its digest is taken as given, to be verified
when the engine reads the files (a mismatch fails the request with a 400, as any adapter that cannot load does).

With `stream_options.continuous_usage_stats` every chunk carries the usage so far: all prompt tokens, the completion
tokens handed out in this and earlier chunks (a chunk carries every token generated since the previous one of its
choice, even those whose text is still held back), and the cached prompt tokens once known. So a caller relaying
chunks knows exactly what it has handed out if its own client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Final, TypeVar

from litestar import Request
from pydantic import BaseModel

from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.core.request_check import CheckedPrompt
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.errors import ContextLengthExceeded
from loraplex.engine.lora.manager import AdapterState
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.serve.api_errors import ApiError
from loraplex.engine.serve.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from loraplex.engine.serve.jobs import Delta, Job, JobPrompt, job_usage, merge, unless_disconnected
from loraplex.engine.serve.logprobs import ChoiceLogprobs, CompletionLogprobs
from loraplex.engine.serve.lora_registry import LORA_ADAPTER_PARAM, AdapterRoots, LoraRegistry
from loraplex.engine.serve.lora_spec import LoraAdapterSpec
from loraplex.engine.serve.metrics import EngineMetrics, LoraMetrics, RequestRecord, VllmMetrics
from loraplex.engine.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from loraplex.engine.serve.reasoning_parser import ReasoningStream
from loraplex.engine.serve.reasoning_parser import split as split_reasoning
from loraplex.engine.serve.tool_calls import (
    TOOL_CALL_PARSERS,
    DeltaFunctionCall,
    DeltaToolCall,
    NamedToolChoice,
    ParsedToolCall,
    ToolCallStream,
    detect_parser,
    new_call_id,
    parse_auto,
    parse_required,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Prompts at least this long are tokenized in a worker thread; shorter ones take less than a millisecond, less than
# the hop to a thread costs.
OFFLOAD_TOKENIZE_CHARS: Final = 16_384


# --- the serving logic -------------------------------------------------------------------------------------------


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: AsyncEngine,
        loras: LoraRegistry | None = None,
        *,
        adapter_roots: AdapterRoots | None = None,
        model_aliases: Sequence[str] = (),
        tool_call_parser: str | None = None,
    ) -> None:
        """`adapter_roots`: where a request's `lora_adapter` may point (None or empty: the field is refused);
        `model_aliases`: other names of the base model in `model` (the name the platform knows it by);
        `tool_call_parser`: how `tool_choice: auto` finds calls in the model's text (`TOOL_CALL_PARSERS`; None: the
        one the chat template's format calls for, else hermes)."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, not {tool_call_parser!r}"
            )
        self.engine = engine
        self.tool_call_parser = tool_call_parser or detect_parser(engine.core.tokenizer.chat_template) or "hermes"
        self.model_name = engine.core.served_model_name
        self.model_aliases = frozenset(model_aliases) - {self.model_name}
        self.adapter_roots = adapter_roots if adapter_roots is not None else AdapterRoots()
        self.max_model_len = engine.core.max_model_len
        self.created = int(time.time())
        self.loras = loras if loras is not None else LoraRegistry(engine, self.model_name)
        self.metrics = EngineMetrics(engine.state, lambda: engine.is_healthy, engine.refusals)
        self.lora_metrics = LoraMetrics(
            self.metrics.registry, self._num_resident_adapters, lambda: len(self.loras.adapters())
        )
        config = engine.core.config
        # Distinct adapters that can run at once: the scheduler's cap per step, and they must all be resident.
        self.vllm_metrics = VllmMetrics(
            self.metrics.registry,
            engine.state,
            model_name=self.model_name,
            max_lora=min(config.max_loras, config.max_adapters_per_batch),
        )

    # validation, before any response byte

    def _num_resident_adapters(self) -> int:
        return sum(1 for state in self.engine.adapter_states().values() if state is AdapterState.RESIDENT)

    def _is_base_model(self, model: str | None) -> bool:
        return model is None or model == self.model_name or model in self.model_aliases

    def _check_model(self, model: str | None, adapter: LoraAdapterSpec | None) -> tuple[str, AdapterRef | None]:
        """The name to echo and the adapter to run (None: the base model)."""
        if not self.engine.is_healthy:
            raise EngineDeadError("the engine has failed; restart it")
        if adapter is not None:
            return self._check_lora_adapter(model, adapter)
        if model is None or self._is_base_model(model):
            return model or self.model_name, None
        lora = self.loras.get(model)
        if lora is None:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}` and its LoRA adapters "
                "(GET /v1/models lists them).",
                code="model_not_found",
                param="model",
            )
        return model, lora

    def _check_lora_adapter(self, model: str | None, adapter: LoraAdapterSpec) -> tuple[str, AdapterRef]:
        # Roots first: a client that may not use the field learns that, not how to shape it.
        source = self.adapter_roots.check(adapter.source)
        if not self._is_base_model(model):
            raise ApiError(
                400,
                f"With `lora_adapter`, `model` must name the base model `{self.model_name}`, not `{model}`.",
                code="invalid_value",
                param="model",
            )
        return model or self.model_name, AdapterRef(name=adapter.name, source=source, digest=adapter.digest)

    async def _check_prompt(self, token_ids: list[int], params: SamplingParams, param: str) -> CheckedPrompt:
        """The checked prompt; one with an output grammar is checked in a worker thread, since compiling a new
        grammar (and loading xgrammar, the first time) would stall this server's other requests."""
        check = self.engine.core.check_request
        try:
            if params.structured_outputs is not None:
                return await asyncio.to_thread(check, token_ids, params)
            return check(token_ids, params)
        except ContextLengthExceeded as exc:
            exc.param = param
            raise

    def _job(
        self,
        kind: str,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[JobPrompt],
        params: SamplingParams,
        arrived: float,
        model: str,
        lora: AdapterRef | None,
    ) -> Job:
        lora_param = LORA_ADAPTER_PARAM if body.lora_adapter is not None else "model"
        job = Job(
            f"{kind}-{secrets.token_hex(16)}",
            int(time.time()),
            prompts,
            params,
            arrived,
            model,
            lora,
            lora_param,
            body.cache_salt,
            params.n,
            body.share_key,
            body.fairness_weight,
            body.effective_priority,
            body.resolved_service_tier,
        )
        if body.unknown_fields:
            logger.warning("%s: ignoring unknown fields %s", job.response_id, ", ".join(body.unknown_fields))
        return job

    async def _encode(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        """`text`'s token ids; a text surely over the context is refused untokenized, and a long one is tokenized
        in a worker thread (the tokenizer lets go of the GIL), so that it never stalls this server's other requests."""
        core = self.engine.core
        core.check_prompt_text(text, param)
        if len(text) < OFFLOAD_TOKENIZE_CHARS:
            return core.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(core.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def completion_job(self, body: CompletionRequest) -> Job:
        arrived = time.perf_counter()
        model, lora = self._check_model(body.model, body.lora_adapter)
        params = body.sampling_params(self.engine.core.tokenizer.sampling_defaults)
        tokenizer = self.engine.core.tokenizer
        prompts: list[JobPrompt] = []
        for prompt in body.prompts:
            text: str | None
            if isinstance(prompt, str):
                token_ids, text = await self._encode(prompt, add_special_tokens=True, param="prompt"), prompt
            else:
                token_ids = list(prompt)
                text = tokenizer.decode(prompt, skip_special_tokens=False) if body.echo else None
            prompts.append(JobPrompt(await self._check_prompt(token_ids, params, "prompt"), text))
        return self._job("cmpl", body, prompts, params, arrived, model, lora)

    def chat_prompt(self, body: ChatCompletionRequest) -> str:
        """The chat's prompt: the model's chat template over its messages and tools."""
        return self.engine.core.tokenizer.apply_chat_template(
            body.template_messages(),
            add_generation_prompt=body.add_generation_prompt,
            tools=body.template_tools(),
            template_kwargs=body.template_kwargs(),
        )

    async def count_chat_tokens(self, body: ChatCompletionRequest) -> int:
        """How many tokens the chat's prompt is (the Messages API's count_tokens), without running it."""
        self._check_model(body.model, body.lora_adapter)
        return len(await self._encode(self.chat_prompt(body), add_special_tokens=False, param="messages"))

    async def chat_job(self, body: ChatCompletionRequest) -> Job:
        arrived = time.perf_counter()
        model, lora = self._check_model(body.model, body.lora_adapter)
        params = body.sampling_params(self.engine.core.tokenizer.sampling_defaults)
        text = self.chat_prompt(body)
        reasoning = self.engine.core.config.reasoning
        if reasoning is not None:  # a reasoning model: its think block is followed, split off and held to a budget
            budget = params.thinking_token_budget
            params = dataclasses.replace(
                params,
                reasoning=True,
                thinking_token_budget=budget if budget is not None else reasoning.budget(body.reasoning_effort),
            )
        if body.tool_mode == "auto" and params.skip_special_tokens:
            # Call markers such as Hermes' <tool_call> are special tokens: the parser must see them.
            params = dataclasses.replace(params, skip_special_tokens=False)
        # The rendered template carries its own special tokens (BOS included): adding them again would double them.
        token_ids = await self._encode(text, add_special_tokens=False, param="messages")
        prompt = JobPrompt(await self._check_prompt(token_ids, params, "messages"), text)
        return self._job("chatcmpl", body, [prompt], params, arrived, model, lora)

    # generation

    async def _generate(self, job: Job, index: int) -> AsyncGenerator[RequestOutput, None]:
        """One engine request's outputs; records its metrics and log line however it ends."""
        request_id = job.request_id(index)
        prompt = job.prompt_of(index)
        first_token_at: float | None = None
        token_at = 0.0  # when the latest output that brought tokens came
        num_tokens = 0
        intervals: list[float] = []  # between outputs that brought tokens, after the first
        last: RequestOutput | None = None
        failed = False
        try:
            outputs = job.streams[index]
            # Closing the stream is what aborts the request.
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    if len(output.outputs[0].token_ids) > num_tokens:
                        now = time.perf_counter()
                        if first_token_at is None:
                            first_token_at = now
                        else:
                            intervals.append(now - token_at)
                        token_at, num_tokens = now, len(output.outputs[0].token_ids)
                    last = output
                    yield output
        except RequestFailed as exc:
            failed = True
            if exc.is_client_error:  # the adapter's fault: name the field that chose it
                raise ApiError(400, str(exc), code="lora_adapter_load_failed", param=job.lora_param) from exc
            raise
        except Exception:
            failed = True
            raise
        finally:
            ended = time.perf_counter()
            if last is not None and last.finished:
                finish_reason = last.outputs[0].finish_reason or "stop"
            else:
                finish_reason = "error" if failed else "abort"
            first = index % job.n == 0  # a prompt's tokens are counted with its first choice only, as billed
            record = RequestRecord(
                finish_reason=finish_reason,
                num_prompt_tokens=len(prompt.token_ids) if first else 0,
                num_cached_tokens=last.num_cached_tokens if last is not None and first else 0,
                num_generated_tokens=len(last.outputs[0].token_ids) if last is not None else 0,
                time_to_first_token_s=None if first_token_at is None else first_token_at - job.arrived,
                latency_s=ended - job.arrived,
                adapter=job.lora.name if job.lora is not None else "",
                num_reasoning_tokens=reasoning.num_tokens
                if last is not None and (reasoning := last.outputs[0].reasoning) is not None
                else 0,
                queue_time_s=last.queue_time_s if last is not None else None,
                inter_token_latencies_s=tuple(intervals),
            )
            self.metrics.record(record)
            self.vllm_metrics.record(record)
            if job.lora is not None:
                self.lora_metrics.record(job.lora.name, finish_reason)
            logger.info(
                "%s: %s, %d prompt tokens (%d cached), %d generated, finish %s, first token %s, %.3f s",
                request_id,
                job.model if job.lora is None or job.lora.name == job.model else f"{job.model} + {job.lora}",
                record.num_prompt_tokens,
                record.num_cached_tokens,
                record.num_generated_tokens,
                finish_reason,
                "-" if record.time_to_first_token_s is None else f"{record.time_to_first_token_s:.3f} s",
                record.latency_s,
            )

    def _outputs(self, job: Job) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        return merge([self._generate(job, i) for i in range(job.num_choices)])

    async def _finals(self, job: Job) -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self._outputs(job)) as outputs:
            async for index, output in outputs:
                finals[index] = output
        return finals

    async def _deltas(self, job: Job) -> AsyncGenerator[Delta, None]:
        """What each output adds to its choice; outputs that add no visible text (a held-back tail, a partial
        character) are folded into the next one, so no chunk is empty but the finishing one."""
        num_chars = [0] * job.num_choices
        num_tokens = [0] * job.num_choices
        sent: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self._outputs(job)) as outputs:
            async for index, output in outputs:
                completion = output.outputs[0]
                text = completion.text[num_chars[index] :]
                if not text and not completion.finished:
                    continue
                start = num_tokens[index]
                logprobs = completion.logprobs[start:] if completion.logprobs is not None else None
                num_chars[index] = len(completion.text)
                num_tokens[index] = len(completion.token_ids)
                sent[index] = output
                yield Delta(index, text, completion.token_ids[start:], logprobs, output, sent)

    # completions

    async def complete(self, job: Job, body: CompletionRequest, request: Request[Any, Any, Any]) -> CompletionResponse:
        finals = await unless_disconnected(request, self._finals(job))
        choices = []
        for index in range(job.num_choices):
            prompt = job.prompt_of(index)
            completion = finals[index].outputs[0]
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                logprobs, _ = CompletionLogprobs.of(completion.token_ids, completion.logprobs, 0)
            echo = (prompt.text or "") if body.echo else ""
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        return CompletionResponse(**job.envelope(), choices=choices, usage=job_usage(job, finals))

    async def complete_stream(self, job: Job, body: CompletionRequest) -> AsyncGenerator[BaseModel, None]:
        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionChunk:
            return CompletionChunk(**job.envelope(), choices=choices, usage=usage)

        continuous = body.continuous_usage
        if body.echo:
            for index in range(job.num_choices):
                text = job.prompt_of(index).text or ""
                yield chunk([CompletionChoice(index=index, text=text)], job_usage(job, {}) if continuous else None)
        text_offsets = [0] * job.num_choices
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self._deltas(job)) as deltas:
            async for delta in deltas:
                logprobs = None
                if body.logprobs is not None and delta.logprobs is not None:
                    logprobs, text_offsets[delta.index] = CompletionLogprobs.of(
                        delta.token_ids, delta.logprobs, text_offsets[delta.index]
                    )
                if delta.output.finished:
                    finals[delta.index] = delta.output
                completion = delta.output.outputs[0]
                choice = CompletionChoice(
                    index=delta.index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                yield chunk([choice], job_usage(job, delta.sent) if continuous else None)
        if body.include_usage:
            yield chunk([], job_usage(job, finals))

    # chat

    async def chat(
        self, job: Job, body: ChatCompletionRequest, request: Request[Any, Any, Any]
    ) -> ChatCompletionResponse:
        finals = await unless_disconnected(request, self._finals(job))
        choices: list[ChatChoice] = []
        for index in range(job.num_choices):
            completion = finals[index].outputs[0]
            logprobs = None
            if body.logprobs and completion.logprobs is not None:
                logprobs = ChoiceLogprobs.of(completion.token_ids, completion.logprobs, body.top_logprobs or 0)
            parts = split_reasoning(completion.text, completion.reasoning)
            content, calls = self._tool_calls(body, parts.content)
            choices.append(
                ChatChoice(
                    index=index,
                    message=AssistantMessage(
                        content=content, reasoning_content=parts.reasoning, tool_calls=[c.wire() for c in calls]
                    ),
                    logprobs=logprobs,
                    finish_reason="tool_calls" if calls else completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        return ChatCompletionResponse(**job.envelope(), choices=choices, usage=job_usage(job, finals))

    def _tool_calls(self, body: ChatCompletionRequest, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a finished chat output, as its tool_choice reads it."""
        mode = body.tool_mode
        if mode == "none":
            return text, []
        if mode == "required":
            return None, parse_required(text)
        if mode == "named":
            assert isinstance(body.tool_choice, NamedToolChoice)
            return None, [ParsedToolCall(new_call_id(), body.tool_choice.function.name, text)]
        return parse_auto(self.tool_call_parser, text, body.tool_names)

    async def chat_stream(self, job: Job, body: ChatCompletionRequest) -> AsyncGenerator[BaseModel, None]:
        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(**job.envelope(), choices=choices, usage=usage)

        continuous = body.continuous_usage
        roles = [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(job.num_choices)
        ]
        yield chunk(roles, job_usage(job, {}) if continuous else None)
        mode = body.tool_mode
        streams = [
            ToolCallStream(self.tool_call_parser, body.tool_names) if mode == "auto" else None
            for _ in range(job.num_choices)
        ]
        held = [""] * job.num_choices  # required: each choice's calls as text, sent as calls at the end
        thinking = [ReasoningStream() for _ in range(job.num_choices)]  # think blocks apart from the answers
        named_started = [False] * job.num_choices  # named: the call's id and name went out
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self._deltas(job)) as deltas:
            async for delta in deltas:
                logprobs = None
                if body.logprobs and delta.logprobs is not None:
                    logprobs = ChoiceLogprobs.of(delta.token_ids, delta.logprobs, body.top_logprobs or 0)
                if delta.output.finished:
                    finals[delta.index] = delta.output
                completion = delta.output.outputs[0]
                text = delta.text
                if completion.reasoning is not None:
                    thought, text = thinking[delta.index].feed(
                        completion.text, completion.reasoning, finished=completion.finished
                    )
                    if thought:  # the think block's part goes first, in a chunk of its own
                        yield chunk(
                            [
                                ChatChunkChoice(
                                    index=delta.index, delta=DeltaMessage(reasoning_content=thought), logprobs=logprobs
                                )
                            ],
                            job_usage(job, delta.sent) if continuous else None,
                        )
                        logprobs = None
                    if not text and not completion.finished:
                        continue
                auto = streams[delta.index]
                finishing = "tool_calls" if mode != "none" and completion.finish_reason is not None else None
                if mode == "named":
                    # The text is the arguments: they stream as OpenAI streams them, the call's id and name first.
                    assert isinstance(body.tool_choice, NamedToolChoice)
                    first = not named_started[delta.index]
                    named_started[delta.index] = True
                    piece = DeltaToolCall(
                        index=0,
                        id=new_call_id() if first else None,
                        type="function" if first else None,
                        function=DeltaFunctionCall(
                            name=body.tool_choice.function.name if first else None, arguments=text
                        ),
                    )
                    yield chunk(
                        [
                            ChatChunkChoice(
                                index=delta.index,
                                delta=DeltaMessage(tool_calls=[piece]),
                                logprobs=logprobs,
                                finish_reason=finishing or completion.finish_reason,
                                stop_reason=completion.stop_reason,
                            )
                        ],
                        job_usage(job, delta.sent) if continuous else None,
                    )
                    continue
                if mode == "required":
                    held[delta.index], text = held[delta.index] + text, ""
                elif auto is not None:
                    text = auto.feed(text)
                calls: list[ParsedToolCall] = []
                if completion.finish_reason is not None and mode != "none":
                    if auto is not None:
                        rest, calls = auto.finish()
                        text += rest
                    else:
                        _, calls = self._tool_calls(body, held[delta.index])
                delta_message = DeltaMessage(content=text) if text else DeltaMessage()
                if calls:  # one delta per call, as the SDK's stream helpers read OpenAI's
                    if text:
                        yield chunk([ChatChunkChoice(index=delta.index, delta=delta_message)])
                    delta_message = DeltaMessage(
                        tool_calls=[
                            DeltaToolCall(
                                index=i,
                                id=call.id,
                                type="function",
                                function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                            )
                            for i, call in enumerate(calls)
                        ]
                    )
                choice = ChatChunkChoice(
                    index=delta.index,
                    delta=delta_message,
                    logprobs=logprobs,
                    finish_reason="tool_calls" if calls else completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                yield chunk([choice], job_usage(job, delta.sent) if continuous else None)
        if body.include_usage:
            yield chunk([], job_usage(job, finals))


__all__ = ["Job", "OpenAIServing"]
