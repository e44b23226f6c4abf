"""The naive online baseline of the serving suite: an OpenAI-compatible streaming server on transformers + peft that
keeps exactly one adapter merged into the base weights at a time, as a first multi-LoRA deployment without a
multi-adapter kernel does.

Scheduling:
- the waiting requests of one adapter run together as one static batch (transformers' `generate`, left-padded,
  greedy) until its longest answer ends; requests that arrive meanwhile wait for a later batch, whatever their adapter;
- when a batch ends, the next one is the waiting requests (up to `--max-batch-size`) of the adapter of the oldest
  waiting request, merged into the base first if another one is (peft's unmerge, then merge);
- tokens stream per decode step (a `generate` streamer), so a client's TTFT and ITL are real.

Requests: /v1/chat/completions (the model's chat template) and /v1/completions (a text prompt), `model` the base's
name or an adapter's, `max_tokens`, `stream` with `stream_options.include_usage`, and `ignore_eos` (or `min_tokens`
at least `max_tokens`) to hold an answer to `max_tokens`. Sampling is greedy whatever the request says. A batch holds
requests that agree on holding to max_tokens, since `generate` suppresses end-of-sequence for a whole batch.

    .venv/bin/python benchmarks/naive_server.py --model DIR --lora NAME=PATH [--lora ...] [--port 8200]
        [--threads 2] [--max-batch-size 64]

As a library: `NaiveScheduler` with `create_app` (tests serve it in-process), `launched_naive_server` (the suite
starts it in a process of its own, as it does the engine), and `chat_prompt_ids` (the prompt a chat request
becomes, for peers that take token ids).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from litestar import Litestar, Response, get, post
from litestar.params import JSONBody
from litestar.response import Stream
from serve_launch import free_port, launched_server

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
SSE_MEDIA_TYPE = "text/event-stream"


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """The token ids a chat request's messages become: the tokenizer's chat template with the assistant's turn opened
    (the template writes any BOS itself)."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    reason: str  # OpenAI's finish_reason: "length" or "stop"


@dataclasses.dataclass(eq=False)
class NaiveJob:
    """One request between the HTTP handler (event loop) and the scheduler thread: the thread puts each token id,
    then a `Finished` or the exception that failed its batch, on `queue` through `loop`."""

    adapter: str | None  # None: the base model
    prompt_ids: list[int]
    max_tokens: int
    hold: bool  # ignore end-of-sequence: the answer is exactly max_tokens long
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[int | Finished | BaseException] = dataclasses.field(default_factory=asyncio.Queue)
    num_tokens: int = 0  # tokens put so far (scheduler thread)
    done: bool = False  # (scheduler thread)

    def put(self, item: int | Finished | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def emit(self, token: int) -> None:
        self.num_tokens += 1
        self.put(token)

    def finish(self, item: Finished | BaseException) -> None:
        if not self.done:
            self.done = True
            self.put(item)


class _BatchStreamer:
    """`generate`'s streamer for one batch: hands each decode step's tokens to the batch's jobs, ending each at its
    own max_tokens, or at an end-of-sequence token unless it holds to max_tokens."""

    def __init__(self, jobs: Sequence[NaiveJob], eos_ids: frozenset[int]) -> None:
        self.jobs = jobs
        self.eos_ids = eos_ids

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:  # generate hands the prompts over first
            return
        for job, token in zip(self.jobs, value.tolist(), strict=True):
            if job.done:
                continue
            if not job.hold and token in self.eos_ids:
                job.finish(Finished("stop"))
                continue
            job.emit(token)
            if job.num_tokens >= job.max_tokens:
                job.finish(Finished("length"))

    def end(self) -> None:
        for job in self.jobs:
            job.finish(Finished("stop"))


class NaiveScheduler:
    """The model (a PeftModel holding every adapter, or the bare base without adapters), the waiting requests in
    arrival order, and the thread that runs them a batch at a time. Only that thread touches the model."""

    def __init__(
        self, model: Any, tokenizer: Any, base_name: str, adapters: Sequence[str], max_batch_size: int
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.model = model
        self.tokenizer = tokenizer
        self.base_name = base_name
        self.adapters = frozenset(adapters)
        self.max_batch_size = max_batch_size
        eos = model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.merged: str | None = None
        self.num_batches = 0  # batches started
        self.num_switches = 0  # merges of an adapter into the base
        self._waiting: list[NaiveJob] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @classmethod
    def load(
        cls, model_dir: Path, loras: Sequence[tuple[str, Path]], *, max_batch_size: int, base_name: str | None = None
    ) -> NaiveScheduler:
        """The base model in float32 from `model_dir` and every adapter of `loras` (name, folder) through peft."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        if loras:
            from peft import PeftModel

            (first, first_path), *rest = loras
            model = PeftModel.from_pretrained(model, first_path, adapter_name=first)
            for name, path in rest:
                model.load_adapter(str(path), adapter_name=name)
        model.eval()
        return cls(model, tokenizer, base_name or model_dir.name, [name for name, _ in loras], max_batch_size)

    # --- the scheduler thread ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="naive-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(30)

    def submit(self, job: NaiveJob) -> None:
        with self._cond:
            self._waiting.append(job)
            self._cond.notify()

    def _next_batch(self) -> list[NaiveJob] | None:
        """The waiting requests of the oldest one's adapter (and hold), oldest first; None when stopping."""
        with self._cond:
            while not self._waiting and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            key = (self._waiting[0].adapter, self._waiting[0].hold)
            batch = [job for job in self._waiting if (job.adapter, job.hold) == key][: self.max_batch_size]
            taken = {id(job) for job in batch}
            self._waiting = [job for job in self._waiting if id(job) not in taken]
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._generate(batch)
            except Exception as exc:  # the batch's requests fail; the server goes on
                logger.exception("a batch of %d failed", len(batch))
                for job in batch:
                    job.finish(exc)

    def _activate(self, adapter: str | None) -> None:
        """Merge `adapter` into the base weights (None: the bare base), unmerging the one merged before."""
        if adapter == self.merged:
            return
        if self.merged is not None:
            self.model.unmerge_adapter()
        if adapter is not None:
            self.model.set_adapter(adapter)
            self.model.merge_adapter()
            self.num_switches += 1
        self.merged = adapter

    def _generate(self, batch: list[NaiveJob]) -> None:
        self.num_batches += 1
        adapter, hold = batch[0].adapter, batch[0].hold
        self._activate(adapter)
        width = max(len(job.prompt_ids) for job in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros(len(batch), width, dtype=torch.int64)
        for row, job in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            mask[row, width - len(job.prompt_ids) :] = 1
        max_new = max(job.max_tokens for job in batch)
        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "do_sample": False, "pad_token_id": self.pad_id}
        if hold:
            kwargs["min_new_tokens"] = max_new
        streamer = _BatchStreamer(batch, self.eos_ids)
        # A peft model with nothing merged still adds its active adapter: the base runs with adapters disabled.
        bare = self.model.disable_adapter() if adapter is None and self.adapters else contextlib.nullcontext()
        with torch.inference_mode(), bare:
            self.model.generate(input_ids=ids, attention_mask=mask, streamer=streamer, **kwargs)
        streamer.end()


# --- HTTP ------------------------------------------------------------------------------------------------------------


def _error(status: int, message: str, param: str | None = None) -> Response[Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return Response(body, status_code=status)


def _job_of(scheduler: NaiveScheduler, data: dict[str, Any], chat: bool) -> NaiveJob | Response[Any]:
    model = data.get("model")
    if model != scheduler.base_name and model not in scheduler.adapters:
        return _error(404, f"The model `{model}` does not exist.", "model")
    max_tokens = data.get("max_completion_tokens") or data.get("max_tokens") or DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return _error(400, "max_tokens must be a positive integer", "max_tokens")
    if chat:
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        ):
            return _error(400, "messages must be a list of {role, content} with text content", "messages")
        prompt_ids = chat_prompt_ids(scheduler.tokenizer, messages)
    else:
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            return _error(400, "prompt must be a string", "prompt")
        prompt_ids = list(scheduler.tokenizer(prompt)["input_ids"])
    hold = bool(data.get("ignore_eos")) or (data.get("min_tokens") or 0) >= max_tokens
    adapter = None if model == scheduler.base_name else str(model)
    return NaiveJob(adapter, prompt_ids, max_tokens, hold, asyncio.get_running_loop())


async def _texts(scheduler: NaiveScheduler, job: NaiveJob) -> AsyncIterator[tuple[str, int]]:
    """(new text, tokens so far) as tokens arrive; a token whose text is still an incomplete character waits for
    the next one, or for the end of the answer."""
    ids: list[int] = []
    sent = text = ""
    while True:
        item = await job.queue.get()
        if isinstance(item, BaseException):
            raise item
        if not isinstance(item, Finished):
            ids.append(item)
            text = scheduler.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if text.endswith("\ufffd"):
                continue
        delta, sent = text[len(sent) :], text
        if delta:
            yield delta, len(ids)
        if isinstance(item, Finished):
            return


def _chunk(chat: bool, rid: str, created: int, model: str, text: str | None, finish: str | None) -> dict[str, Any]:
    if chat:
        delta = {"role": "assistant", "content": text} if text is not None else {}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


async def _complete(scheduler: NaiveScheduler, data: dict[str, Any], chat: bool) -> Response[Any]:
    job = _job_of(scheduler, data, chat)
    if isinstance(job, Response):
        return job
    scheduler.submit(job)
    model, rid, created = str(data["model"]), f"naive-{uuid.uuid4().hex}", int(time.time())

    def usage(num_tokens: int) -> dict[str, int]:
        prompt = len(job.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": num_tokens, "total_tokens": prompt + num_tokens}

    if not data.get("stream"):
        parts = [text async for text, _ in _texts(scheduler, job)]
        answer = "".join(parts)
        finish = "length" if job.num_tokens >= job.max_tokens else "stop"
        choice = {"index": 0, "finish_reason": finish}
        choice |= {"message": {"role": "assistant", "content": answer}} if chat else {"text": answer}
        kind = "chat.completion" if chat else "text_completion"
        body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
        return Response({**body, "usage": usage(job.num_tokens)})
    include_usage = bool((data.get("stream_options") or {}).get("include_usage"))

    async def events() -> AsyncIterator[bytes]:
        try:
            async for text, _ in _texts(scheduler, job):
                yield f"data: {json.dumps(_chunk(chat, rid, created, model, text, None))}\n\n".encode()
        except Exception as exc:  # the batch failed: an error event ends the stream
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n".encode()
            return
        num_tokens = job.num_tokens
        finish = "length" if num_tokens >= job.max_tokens else "stop"
        yield f"data: {json.dumps(_chunk(chat, rid, created, model, None, finish))}\n\n".encode()
        if include_usage:
            closing: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion"}
            closing |= {"created": created, "model": model, "choices": [], "usage": usage(num_tokens)}
            yield f"data: {json.dumps(closing)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return Stream(events(), media_type=SSE_MEDIA_TYPE)


def create_app(scheduler: NaiveScheduler) -> Litestar:
    """The HTTP app; it starts the scheduler's thread at startup and stops it at shutdown."""

    @get("/healthz", sync_to_thread=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @get("/v1/models", sync_to_thread=False)
    def models() -> dict[str, Any]:
        names = [scheduler.base_name, *sorted(scheduler.adapters)]
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "naive"} for name in names]}

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(data: JSONBody[dict[str, Any]]) -> Response[Any]:
        return await _complete(scheduler, data, chat=True)

    @post("/v1/completions", status_code=200)
    async def completions(data: JSONBody[dict[str, Any]]) -> Response[Any]:
        return await _complete(scheduler, data, chat=False)

    return Litestar(
        [healthz, models, chat_completions, completions],
        on_startup=[scheduler.start],
        on_shutdown=[scheduler.stop],
        openapi_config=None,
    )


@contextlib.contextmanager
def launched_naive_server(
    model_dir: Path, loras: Sequence[tuple[str, Path]], *, threads: int | None = None, max_batch_size: int = 64
) -> Iterator[str]:
    """This server on a free local port in a process of its own; yields its base URL once it answers."""
    port = free_port()
    command = [sys.executable, str(Path(__file__).resolve()), "--model", str(model_dir), "--port", str(port)]
    command += ["--max-batch-size", str(max_batch_size)]
    command += ["--threads", str(threads)] if threads is not None else []
    for name, path in loras:
        command += ["--lora", f"{name}={path}"]
    with launched_server(command, port, name="naive-server") as url:
        yield url


def _lora(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, Path(path)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="A Hugging Face model folder.")
    parser.add_argument("--lora", type=_lora, action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--served-model-name", default=None, help="The base model's name (default: the folder's).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch.")
    parser.add_argument("--max-batch-size", type=int, default=64, help="Requests in one static batch at most.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    scheduler = NaiveScheduler.load(
        args.model, args.lora, max_batch_size=args.max_batch_size, base_name=args.served_model_name
    )
    import uvicorn

    uvicorn.run(create_app(scheduler), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
