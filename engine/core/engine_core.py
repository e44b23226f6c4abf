"""EngineCore: one model, one page pool, one scheduler. `step()` is schedule, run, postprocess.

Not thread-safe: one thread drives it (LLM does so directly, AsyncEngine from its engine thread).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.draft_model import DraftModel, DraftModelProposer
from loraplex.engine.core.engine_state import EngineState, snapshot
from loraplex.engine.core.output_processor import OutputProcessor
from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.core.pooling import (
    EMBEDDING_PARAMS,
    PoolingState,
    check_task,
    new_pooling_state,
    read_pooling_config,
)
from loraplex.engine.core.reasoning import ReasoningMarkers, ReasoningState
from loraplex.engine.core.reasoning_config import ReasoningConfig
from loraplex.engine.core.rejection_sampler import accepted_prefix
from loraplex.engine.core.request import Request, RequestStatus
from loraplex.engine.core.request_check import CheckedPrompt, check_prompt_text, check_request
from loraplex.engine.core.request_memory import RequestMemory
from loraplex.engine.core.row_sampler import RowSampler
from loraplex.engine.core.runner import ModelRunner
from loraplex.engine.core.sampler import Sampler, TokenLogprobs
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from loraplex.engine.core.speculator import Speculator
from loraplex.engine.core.structured_output import GrammarCompiler, GrammarState
from loraplex.engine.errors import RequestError
from loraplex.engine.lora.batch import LoraCompute
from loraplex.engine.lora.manager import AdapterEntry, AdapterManager, AdapterManagerConfig
from loraplex.engine.lora.ref import AdapterRef, LoRARequest
from loraplex.engine.memory.kv_cache import KVCacheManager
from loraplex.engine.memory.kv_groups import KVGroups
from loraplex.engine.memory.page_pool import PagePool, kv_page_elems
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.decoder import DecoderModel
from loraplex.engine.model.tensor_parallel import ShardPlan
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.model.weights import CheckpointTensors
from loraplex.engine.parallel.group import TensorParallelGroup
from loraplex.kernels import native
from loraplex.kernels.paths import operator_paths

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = config.resolve_device()
        path = Path(config.model)
        self.model_config = ModelConfig.from_dir(path)
        self.tokenizer = Tokenizer.from_dir(path)
        # An embedding model (sentence-transformers' modules.json, core/pooling.py) serves embedding requests only.
        self.pooling_config = read_pooling_config(path)
        self.dtype = config.resolve_dtype(self.model_config.torch_dtype, self.device)
        self.max_model_len = self._resolve_max_model_len()
        self.served_model_name = config.served_model_name or path.name

        size = config.tensor_parallel_size
        shards = [ShardPlan.make(self.model_config, rank, size) for rank in range(size)] if size > 1 else []
        # The other ranks start first, so they load their shards while this process loads its own.
        self.workers = (
            TensorParallelGroup.start(
                size=size,
                model=str(path),
                dtype=self.dtype,
                device=self.device,
                quantization=config.quantization,
                max_positions=self.max_model_len,
                block_size=config.block_size,
                num_threads=config.num_threads or max(1, (os.cpu_count() or 1) // size),
                max_loras=config.max_loras,
            )
            if size > 1
            else None
        )
        if self.workers is not None:
            weakref.finalize(self, self.workers.close)
        try:
            self._build(config, path, shards)
        except BaseException:
            self.close()
            raise
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.eos_token_ids = self.tokenizer.eos_token_ids | self.model_config.eos_token_ids
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.reasoning: ReasoningMarkers | None = None
        self.set_reasoning(config.reasoning)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_batched_tokens = 0
        self.num_preemptions = 0
        self.num_interleaved_steps = 0  # steps run inside another (step's `arrivals`)
        default_generator = torch.Generator(device=self.device)
        default_generator.manual_seed(config.seed)
        self.row_sampler = RowSampler(
            Sampler(), self.outputs, self.grammars, self.model_config.vocab_size, default_generator, self.device
        )

    def _build(self, config: EngineConfig, path: Path, shards: list[ShardPlan]) -> None:
        """Load this rank's model and make the pool, adapters, scheduler and runner (under tensor parallelism, with
        the other ranks loading and joining in step)."""
        started = time.perf_counter()
        self.model = DecoderModel(
            self.model_config,
            dtype=self.dtype,
            device=self.device,
            max_positions=self.max_model_len,
            quantization=config.quantization,
            shard=shards[0] if shards else None,
            comm=self.workers.comm if self.workers is not None else None,
        )
        self.model.load(CheckpointTensors(path))
        self.weight_bytes = self.model.weight_bytes()
        if self.workers is not None:
            self.workers.wait_loaded()
            self.weight_bytes += self.workers.worker_weight_bytes
        logger.info(
            "loaded %s (%s, weights %s, %.1f M parameters, %.1f MiB) in %.1f s",
            path,
            self.dtype,
            self.model.quantization_label or "unquantized",
            self.model_config.num_parameters() / 1e6,
            self.weight_bytes / 2**20,
            time.perf_counter() - started,
        )
        self.operator_paths = operator_paths(self.device, self.dtype, self.model.quantization_label)
        why = native.status().reason if self.device.type == "cpu" else "cuda"
        logger.info(
            "operators: %s (%s)", ", ".join(f"{name} {path}" for name, path in self.operator_paths.items()), why
        )

        spec = config.speculative_config
        # Before the pool, which a fractional kv_budget sizes from the memory the weights leave free.
        draft = (
            DraftModel.load(
                spec.model,
                target=self.model_config,
                tokenizer=self.tokenizer,
                max_model_len=self.max_model_len,
                dtype=self.dtype,
                device=self.device,
            )
            if spec is not None and spec.model is not None
            else None
        )
        if draft is not None:  # the draft's weights are the engine's too: they take memory the pool cannot have
            self.weight_bytes += draft.model.weight_bytes()
        self.kv_groups = KVGroups.of([self.model_config.window(i) for i in range(self.model_config.num_layers)])
        self.pool = self._create_pool()
        if self.workers is not None:
            self.workers.connect(self.pool.num_pages)
        c = self.model.config  # this rank's heads under tensor parallelism
        kv_caches = self.pool.kv_layers(c.num_layers, c.num_kv_heads, config.block_size, c.head_dim, self.kv_groups)
        self.kv = KVCacheManager(
            self.pool, config.block_size, prefix_caching=config.enable_prefix_caching, groups=self.kv_groups
        )
        self.adapters = AdapterManager(
            self.pool,
            self.model_config,
            AdapterManagerConfig(
                max_loras=config.max_loras,
                max_rank=config.max_lora_rank,
                host_budget_bytes=config.lora_host_budget,
                s3_endpoint_url=config.s3_endpoint_url,
                s3_region=config.s3_region,
                s3_access_key_id=config.s3_access_key_id,
                s3_secret_access_key=config.s3_secret_access_key,
            ),
            reserved_pages=self._pages_for_one_request(),
            shards=shards,
            mirror=self.workers,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                watermark_pages=max(1, self.pool.num_pages // 100),
                max_adapters_per_batch=config.max_adapters_per_batch,
                policy=config.scheduling_policy,
            ),
            RequestMemory(self.kv, self.adapters),
            speculator=Speculator(
                spec,
                knee_tokens=config.speculative_knee_tokens,
                use_clock=config.speculative_use_clock,
                proposer=DraftModelProposer(
                    spec,
                    draft,
                    pool=self.pool,
                    block_size=config.block_size,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    adapters=self.adapters,
                )
                if draft is not None
                else None,
            )
            if spec is not None
            else None,
        )
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            block_size=config.block_size,
            device=self.device,
            lora=LoraCompute(self.adapters, self.device),
            workers=self.workers,
            num_groups=self.kv_groups.num_groups,
        )

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's limit of {limit}")
        return self.config.max_model_len

    def _pages_for_one_request(self) -> int:
        """Pages one request of the longest context may hold at once (every block in every KV group, less what the
        sliding windows give back)."""
        return self.kv_groups.pages_for_tokens(
            self.max_model_len, self.config.block_size, self.config.max_num_batched_tokens
        )

    def _create_pool(self) -> PagePool:
        """This rank's pool: pages of its KV heads, with a slot per layer of a KV group (every layer, without sliding
        windows); the budget is per rank (a fraction on a CPU is shared out, since the ranks share its memory).
        Every rank gets the same number of pages."""
        c = self.model.config
        block_size = self.config.block_size
        page_elems = kv_page_elems(c.num_kv_heads, block_size, c.head_dim)
        page_bytes = self.kv_groups.num_slots * page_elems * torch.empty(0, dtype=self.dtype).element_size()
        budget = self.config.kv_budget
        if isinstance(budget, float):
            if self.device.type == "cuda":
                free = torch.cuda.mem_get_info(self.device)[0]
            else:
                free = psutil.virtual_memory().available // self.config.tensor_parallel_size
            budget = int(free * budget)
        num_pages = budget // page_bytes
        needed = self._pages_for_one_request()
        if num_pages < needed:
            raise ValueError(
                f"the KV budget holds {num_pages * block_size} tokens but one request may need {self.max_model_len}: "
                "raise kv_budget or lower max_model_len"
            )
        logger.info(
            "page pool: %d pages of %d KiB (%d tokens in each of %d KV groups)",
            num_pages,
            page_bytes // 1024,
            num_pages * block_size // self.kv_groups.num_groups,
            self.kv_groups.num_groups,
        )
        return PagePool(
            num_pages=num_pages,
            num_layers=self.kv_groups.num_slots,
            page_elems=page_elems,
            dtype=self.dtype,
            device=self.device,
        )

    # --- requests ------------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int] | CheckedPrompt,
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        lora: AdapterRef | None = None,
        cache_salt: str | None = None,
        prefill_after: str | None = None,
        fairness_key: str = "",
        fairness_weight: float = 1.0,
        priority: int = 0,
        pooling: PoolingState | None = None,
    ) -> Request:
        """Validate and queue a request; raises RequestError (ContextLengthExceeded) for bad input. A prompt a
        caller has checked already comes as the `CheckedPrompt` (and no `params`) and is not checked again. With
        `lora`, the request waits (not fails) while its adapter loads; a failed load finishes it with an error.

        `cache_salt` keeps the request's prefix-cache blocks apart from those of requests with another salt (the
        platform gives each tenant its own); the adapter's digest does the same between adapters.

        `fairness_key` and `fairness_weight` share the engine fairly between keys (the platform's tenants), `priority`
        orders admission before that (lower first): see the scheduler.

        With `pooling` (`pooling_state`) it is an embedding request (core/pooling.py): its prompt runs like any, and
        it finishes when the prompt is done, its output's `embedding` the pooled vector; it needs no `params`.

        One request is one choice: an n-choice request is n of them (`SamplingParams.choice`), each after the first
        with `prefill_after` naming the first, so the prompt is prefilled once and its blocks shared."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.check_task(embedding=pooling is not None)
        if pooling is not None and params is None and not isinstance(prompt_token_ids, CheckedPrompt):
            params = EMBEDDING_PARAMS  # an embedding request generates nothing
        checked = self.checked(prompt_token_ids, params)
        params = checked.params
        if params.n != 1:
            raise RequestError("a request is one choice: add n requests (SamplingParams.choice)", param="n")
        if not (isinstance(fairness_weight, int | float) and 0 < fairness_weight < float("inf")):
            raise RequestError(
                f"fairness_weight must be a positive number, got {fairness_weight!r}", param="fairness_weight"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestError(f"priority must be an integer, got {priority!r}", param="priority")
        long_rope = self.model.long_rope_for(len(checked.token_ids))
        if long_rope:  # their K/V differ from the same tokens' under the short factors
            cache_salt = f"{cache_salt or ''}\x00longrope"
        request = Request(
            request_id=request_id,
            long_rope=long_rope,
            prompt_token_ids=list(checked.token_ids),
            sampling_params=params,
            max_tokens=checked.max_tokens,
            prompt=prompt,
            adapter=self.adapters.request(lora) if lora is not None else None,
            cache_salt=cache_salt,
            grammar=GrammarState(checked.grammar, self.model_config.vocab_size)
            if checked.grammar is not None
            else None,
            reasoning=self._reasoning_state(checked),
            prefill_after=self.requests.get(prefill_after) if prefill_after is not None else None,
            fairness_key=fairness_key,
            fairness_weight=float(fairness_weight),
            priority=priority,
            pooling=pooling,
        )
        self.requests[request_id] = request
        self.outputs.add(request)
        self.scheduler.add(request)
        return request

    def check_task(self, *, embedding: bool) -> None:
        """RequestError unless the model does that: an embedding model embeds only, any other model generates only."""
        check_task(self.pooling_config, embedding=embedding)

    def pooling_state(self, dimensions: int | None) -> PoolingState:
        """A new embedding request's pooling, as the model pools (RequestError if it does not embed)."""
        return new_pooling_state(self.pooling_config, dimensions, self.model_config.hidden_size)

    def set_reasoning(self, reasoning: ReasoningConfig | None) -> None:
        """Serve the model as a reasoning model with these settings (None: as none) from the next request on; requests
        already in the engine keep theirs. Unlike the engine's other settings, these need nothing but the tokenizer,
        so an operator may change them without a restart (the platform does when an admin edits a base model)."""
        markers = (
            ReasoningMarkers.of(reasoning, lambda text: self.tokenizer.encode(text, add_special_tokens=False))
            if reasoning is not None
            else None
        )
        # Two reference swaps: a request checked in between sees one or the other, and either runs.
        self.config = dataclasses.replace(self.config, reasoning=reasoning)
        self.reasoning = markers

    def _reasoning_state(self, checked: CheckedPrompt) -> ReasoningState | None:
        """Where a reasoning request's think block starts (reasoning.py): read from its prompt."""
        if not checked.params.reasoning or self.reasoning is None:
            return None
        phase = self.reasoning.initial_phase(
            checked.token_ids, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        )
        return ReasoningState.start(self.reasoning, checked.params.thinking_token_budget, phase)

    def checked(self, prompt: list[int] | CheckedPrompt, params: SamplingParams | None) -> CheckedPrompt:
        """`prompt` as checked: itself if it is a CheckedPrompt already (with no `params`: it carries its own), else
        what `check_request` makes of it and `params`."""
        if isinstance(prompt, CheckedPrompt):
            if params is not None:
                raise TypeError("a CheckedPrompt carries its own sampling params")
            return prompt
        if params is None:
            raise TypeError("a prompt needs its sampling params")
        return self.check_request(list(prompt), params)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> CheckedPrompt:
        """request_check.check_request against this engine; reads only immutable state: any thread may call it."""
        return check_request(
            prompt_token_ids,
            params,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            reasoning=self.reasoning is not None,
            grammars=self.grammars,
        )

    def check_prompt_text(self, text: str, param: str = "prompt") -> None:
        """request_check.check_prompt_text against this engine; reads only immutable state."""
        check_prompt_text(self.tokenizer, self.max_model_len, text, param)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and give back all its pages; returns its final output (None if unknown)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return self._finalize(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ------------------------------------------------------------------------------------------------

    def resolve_lora(self, lora: LoRARequest) -> AdapterRef:
        """Name and content digest of an adapter (reads its files to hash them; any thread may call it)."""
        return self.adapters.resolve(lora.name, lora.path)

    def step(
        self,
        arrivals: Callable[[], bool] | None = None,
        deliver: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run one step; outputs of every request that got a new token or finished. Raises WorkerFailed once a
        tensor-parallel rank has died.

        Interleaved steps (issue 37; docs/decisions/0053): with `arrivals` (adds the requests submitted since it was
        last called; True if there were any) and `deliver`, a step that computes a prompt chunk longer than the
        scheduler's yielded limit asks for arrivals between its layers. When a newcomer of another, at least as
        urgent, key can start, a short step of the newcomers runs there (Scheduler.schedule_within), to its
        end, its outputs handed to `deliver` at once; then the paused step goes on from the next layer. The short step
        writes K/V only into its own requests' pages and the paused step's requests are left as they are, so both
        compute exactly what they would apart. Not under tensor parallelism (the other ranks run one forward at a
        time in lockstep) nor with a speculator (its proposals are made for the step as scheduled)."""
        self.check_workers()
        outputs = self._fail_requests_of(self.adapters.poll())
        sched = self.scheduler.schedule()
        self.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            if not outputs and self.scheduler.waiting:
                self.adapters.wait_for_loads(timeout=0.01)  # nothing runnable: the queue waits on adapter loads
            return outputs
        outputs += self._run(sched, self._interleaver(sched, arrivals, deliver))
        return outputs

    def _interleaver(
        self,
        outer: SchedulerOutput,
        arrivals: Callable[[], bool] | None,
        deliver: Callable[[RequestOutput], None] | None,
    ) -> Callable[[], None] | None:
        """What `outer`'s forward calls between its layers (see `step`), or None where no step may run inside it."""
        if arrivals is None or deliver is None or self.workers is not None or self.scheduler.speculator is not None:
            return None
        if not self.scheduler.may_interleave(outer):
            return None

        def between_layers() -> None:
            if not arrivals():
                return
            inner = self.scheduler.schedule_within(outer)
            if inner.is_empty:
                return
            self.num_interleaved_steps += 1
            for output in self._run(inner, None):
                deliver(output)

        return between_layers

    def _run(self, sched: SchedulerOutput, between_layers: Callable[[], None] | None) -> list[RequestOutput]:
        """Compute a scheduled step, sample its rows and book them; their outputs."""
        started = time.perf_counter()
        outputs: list[RequestOutput] = []
        prepared = self.runner.prepare(sched)
        logits = self.runner.execute(prepared, between_layers)
        self.scheduler.update_from_output(sched)
        self.num_steps += 1
        self.num_batched_tokens += sched.num_batched_tokens
        for request, _, _, _ in prepared.pooled_rows:
            if request.is_prefilled:  # its prompt is done: the vector is ready, nothing is generated
                assert request.pooling is not None
                request.pooling.finish(request.num_prompt_tokens)
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                outputs.append(self._finalize(request))

        rows, proposals = prepared.sample_requests, prepared.spec_token_ids
        num_emitted = 0
        for request, proposal, drawn in zip(
            rows, proposals, self.row_sampler.sample(rows, proposals, logits), strict=True
        ):
            if not proposal:
                outputs.append(self._emit(request, drawn))
                num_emitted += 1
                continue
            # Speculative sampling for a deterministic proposer (rejection_sampler.py): keep the proposals while
            # they are what the row drew at their position, then emit the draw after them.
            kept = accepted_prefix(proposal, [token for token, _ in drawn])
            outputs.append(self._emit(request, drawn[: kept + 1], num_proposed=len(proposal)))
            num_emitted += kept + 1
        speculator = self.scheduler.speculator
        # Decode steps only: a prompt chunk's tokens cost far less each than a decoding row's, and a speculative
        # token costs what a decoding row's does.
        if speculator is not None and all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in sched.scheduled):
            speculator.observe_step(
                sched.num_batched_tokens,
                time.perf_counter() - started,
                num_rows=len(rows),
                num_emitted=num_emitted,
                speculated=sched.speculation_asked,
            )
        return outputs

    def _emit(
        self, request: Request, token_ids: list[tuple[int, TokenLogprobs | None]], *, num_proposed: int = 0
    ) -> RequestOutput:
        """Hand a row's new tokens to the output processor, in order, until one ends the request; book a speculating
        row's kept proposals (their K/V were computed this step) and its outcome."""
        status: RequestStatus | None = None
        num_emitted = 0
        for token_id, token_logprobs in token_ids:
            num_emitted += 1
            status = self.outputs.process_token(request, token_id, token_logprobs)
            if status is not None:
                break
        if num_proposed:
            num_accepted = len(token_ids) - 1
            assert self.scheduler.speculator is not None  # only a speculator's rows propose
            self.scheduler.speculator.verified(
                request, proposed=num_proposed, accepted=num_accepted, emitted=num_emitted
            )
            if status is None:
                self.scheduler.book_verified(request, num_accepted)
        if status is None:
            return self.outputs.make_output(request)
        self.scheduler.finish(request, status)
        return self._finalize(request)

    def _fail_requests_of(self, failed: list[AdapterEntry]) -> list[RequestOutput]:
        """Finish the waiting requests of adapters that failed to load, with the load's error."""
        outputs: list[RequestOutput] = []
        for entry in failed:
            for request in [r for r in self.scheduler.waiting if r.adapter is entry]:
                request.error = f"adapter {entry.ref.name} could not be loaded: {entry.error}"
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
                outputs.append(self._finalize(request))
            self.adapters.forget(entry)  # a later request retries the load
        return outputs

    def _finalize(self, request: Request) -> RequestOutput:
        output = self.outputs.make_output(request)
        self.outputs.remove(request.request_id)
        del self.requests[request.request_id]
        return output

    def state(self) -> EngineState:
        return snapshot(self)

    # --- tensor parallelism's other ranks ------------------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the other tensor-parallel ranks (none without tensor parallelism)."""
        return self.workers.pids if self.workers is not None else []

    @property
    def workers_alive(self) -> bool:
        """False once another tensor-parallel rank has died (known at once, even while a step waits on it)."""
        return self.workers is None or self.workers.failure is None

    def check_workers(self) -> None:
        """Raise WorkerFailed once another tensor-parallel rank has died (the engine cannot step without it)."""
        if self.workers is not None:
            self.workers.check()

    def on_worker_failure(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from another thread) when another tensor-parallel rank dies; never without them."""
        if self.workers is not None:
            self.workers.on_failure(callback)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and the adapter loaders; the engine serves nothing after."""
        if self.workers is not None:
            self.workers.close()
        adapters = getattr(self, "adapters", None)  # absent when the build failed before it
        if adapters is not None:
            adapters.shutdown()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request uses (vLLM's reset_prefix_cache); returns how many."""
        return self.kv.prefix_cache.clear() if self.kv.prefix_cache is not None else 0
