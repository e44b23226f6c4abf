"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Required, TypedDict

from loraplex.engine.core.config import DTypeName, EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.core.speculative_config import SpeculativeConfig
from loraplex.engine.lora.ref import AdapterRef, LoRARequest
from loraplex.engine.model.quantization import QuantizationName
from loraplex.engine.model.tokenizer import Tokenizer


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: Required[list[int]]
    cache_salt: str  # prefix-cache blocks are shared only between requests with the same salt


class TextPrompt(TypedDict, total=False):
    prompt: Required[str]
    cache_salt: str


Prompt = str | TextPrompt | TokensPrompt
Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class _Encoded:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


class LLM:
    """Loads a model once and runs batches of prompts through the continuous-batching engine.

    `quantization`: None, "int8" (per output channel), "int4" (group-wise) or "fp8" (e4m3 per output channel): the
    decoder layers' projections are quantized at load from the 16/32-bit checkpoint, and an untied lm_head to int8
    with int8 and int4; embeddings and LoRA adapters stay in `dtype`. On a CPU with AVX-512 VNNI or AMX, int8 and
    int4 also round activations to 8 bits per token (kernels/quant.py's int8_activations; decision 0039).
    A GPTQ or AWQ 4-bit checkpoint, or an FP8 one, is recognized from its config and served as it is (leave
    `quantization` unset).
    `options` are EngineConfig fields: max_model_len, kv_budget, block_size, max_num_seqs,
    max_num_batched_tokens, seed, device, num_threads, served_model_name, tensor_parallel_size.

    With `tensor_parallel_size` N > 1 the model is split over N ranks, each its own process (engine/parallel);
    `close()` (or leaving a `with LLM(...)` block) stops them, as does the end of the program.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: DTypeName = "auto",
        quantization: QuantizationName | None = None,
        **options: Any,
    ) -> None:
        if "gpu_memory_utilization" in options:  # vLLM's name for the same budget
            options["kv_budget"] = float(options.pop("gpu_memory_utilization"))
        speculative = options.get("speculative_config")
        if isinstance(speculative, str | dict):  # vLLM's shape: a dict (or its JSON)
            options["speculative_config"] = SpeculativeConfig.parse(speculative)
        self.engine = EngineCore(EngineConfig(model=Path(model), dtype=dtype, quantization=quantization, **options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks) and adapter loaders; nothing runs after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        fairness_key: str | Sequence[str] = "",
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        `lora_request`: one adapter for every prompt, or one per prompt (None runs the base model). `fairness_key`
        (whose request it is: keys share the engine fairly) and `priority` (lower first): one value, or one per prompt.
        """
        prompt_list: list[Prompt] = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        encoded = [self._encode(p) for p in prompt_list]
        return self._generate(
            encoded,
            self._params_for(len(encoded), sampling_params),
            self._loras_for(len(encoded), lora_request),
            _each(len(encoded), fairness_key, str, "fairness keys"),
            _each(len(encoded), priority, int, "priorities"),
        )

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        dimensions: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """The embedding of every prompt (an embedding model's: its sentence-transformers pooling, engine/core/
        pooling.py), in the order of `prompts`: each output's `embedding`, its first `dimensions` components."""
        prompt_list: list[Prompt] = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        encoded = [self._encode(p) for p in prompt_list]
        loras = self._loras_for(len(encoded), lora_request)
        request_ids: list[str] = []
        try:
            for prompt, lora in zip(encoded, loras, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(
                    request_id,
                    prompt.token_ids,
                    prompt=prompt.text,
                    lora=lora,
                    cache_salt=prompt.cache_salt,
                    pooling=self.engine.pooling_state(dimensions),
                )
                request_ids.append(request_id)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finished = self._run(request_ids)
        return [finished[request_id] for request_id in request_ids]

    def _encode(self, prompt: Prompt) -> _Encoded:
        if isinstance(prompt, str):
            return _Encoded(prompt, self.engine.tokenizer.encode(prompt))
        salt = prompt.get("cache_salt")
        if "prompt_token_ids" in prompt:
            return _Encoded(None, list(prompt["prompt_token_ids"]), salt)  # type: ignore[typeddict-item]
        if "prompt" in prompt:
            text: str = prompt["prompt"]
            return _Encoded(text, self.engine.tokenizer.encode(text), salt)
        raise ValueError("a prompt is a str, {'prompt': str} or {'prompt_token_ids': [...]}")

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        cache_salt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (with `chat_template_kwargs` as further template
        variables, e.g. `enable_thinking`), then generate."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations: list[list[Message]] = [list(messages)] if single else [list(c) for c in messages]  # type: ignore[arg-type]
        tokenizer = self.engine.tokenizer
        encoded: list[_Encoded] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, template_kwargs=chat_template_kwargs
            )
            # The template writes any BOS itself; encoding must not add a second one.
            encoded.append(_Encoded(text, tokenizer.encode(text, add_special_tokens=False), cache_salt))
        return self._generate(
            encoded, self._params_for(len(encoded), sampling_params), self._loras_for(len(encoded), lora_request)
        )

    def _generate(
        self,
        encoded: list[_Encoded],
        params_list: list[SamplingParams],
        loras: list[AdapterRef | None],
        keys: list[str] | None = None,
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        keys = keys if keys is not None else [""] * len(encoded)
        priorities = priorities if priorities is not None else [0] * len(encoded)
        request_ids: list[str] = []
        choices: list[list[str]] = []  # per prompt, its choices' request ids (n of them)
        try:
            for prompt, params, lora, key, priority in zip(encoded, params_list, loras, keys, priorities, strict=True):
                leader = str(next(self._ids))
                ids = [leader] + [f"{leader}.{j}" for j in range(1, params.n)]
                for j, request_id in enumerate(ids):
                    self.engine.add_request(
                        request_id,
                        prompt.token_ids,
                        params.choice(j),
                        prompt=prompt.text,
                        lora=lora,
                        cache_salt=prompt.cache_salt,
                        prefill_after=leader if j else None,
                        fairness_key=key,
                        priority=priority,
                    )
                    request_ids.append(request_id)
                choices.append(ids)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finished = self._run(request_ids)
        return [_merged([finished[i] for i in ids]) for ids in choices]

    def _params_for(
        self, count: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {count} prompts but {len(params)} sampling params")
        return params

    def _loras_for(
        self, count: int, lora_request: LoRARequest | Sequence[LoRARequest | None] | None
    ) -> list[AdapterRef | None]:
        requests = [lora_request] * count if not isinstance(lora_request, Sequence) else list(lora_request)
        if len(requests) != count:
            raise ValueError(f"got {count} prompts but {len(requests)} lora requests")
        resolved: dict[tuple[str, str], AdapterRef] = {}  # each adapter's files are hashed once per call
        refs: list[AdapterRef | None] = []
        for lora in requests:
            if lora is None:
                refs.append(None)
                continue
            key = (lora.name, str(lora.path))
            if key not in resolved:
                resolved[key] = self.engine.resolve_lora(lora)
            refs.append(resolved[key])
        return refs

    def _run(self, request_ids: list[str]) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        while wanted - finished.keys():
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("the engine stopped with requests unfinished")
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
        return finished


def _each(count: int, value: Any, kind: type, what: str) -> list[Any]:
    """`value` for each of `count` prompts: one value for all, or a sequence of one per prompt."""
    if isinstance(value, kind) and not isinstance(value, bool):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"got {count} prompts but {len(values)} {what}")
    return values


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """The choices of one prompt as one output, as vLLM returns n > 1: the first choice's request, every choice's
    completion (index j), and the cached tokens of the prompt once (the first choice's)."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    completions = [dataclasses.replace(out.outputs[0], index=j) for j, out in enumerate(outputs)]
    error = next((out.error for out in outputs if out.error), None)
    return dataclasses.replace(first, outputs=completions, error=error)
