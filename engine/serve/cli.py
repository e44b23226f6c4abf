"""The `loraplex engine ...` commands: serve one engine, write a demo model or adapter. The platform's CLI mounts
this group; it needs nothing of the platform."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click

from loraplex.engine.core.config import parse_memory_budget
from loraplex.engine.core.reasoning_config import (
    DEFAULT_CLOSING_TEXT,
    DEFAULT_REASONING_BUDGETS,
    DEFAULT_REASONING_EFFORT,
    REASONING_EFFORTS,
    REASONING_PARSERS,
    ReasoningConfig,
    format_reasoning_budgets,
    parse_reasoning_budgets,
)
from loraplex.engine.core.speculative_config import SpeculativeConfig
from loraplex.engine.serve.tool_calls import TOOL_CALL_PARSERS


def configure_logging(level: str = "INFO") -> None:
    """The one log format of loraplex's commands."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group("engine")
def engine() -> None:
    """The data plane: one engine process per base model and GPU."""


@engine.command("serve")
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="A Hugging Face model folder (config.json, *.safetensors, tokenizer.json).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8100, show_default=True, help="Port to bind.")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
    default="auto",
    show_default=True,
    help="Weight and KV dtype; auto is the checkpoint's (float32 for half checkpoints on a CPU).",
)
@click.option(
    "--quantization",
    type=click.Choice(["int8", "int4", "fp8"]),
    default=None,
    help="Quantize the decoder layers' weights at load (round to nearest): int8 per output channel, int4 in groups "
    "of 128 with zero points (an untied lm_head becomes int8 in both), fp8 (e4m3) per output channel. On CPUs with "
    "AVX-512 VNNI or AMX int8 and int4 round activations to 8 bits per token for integer matmuls "
    "(LORAPLEX_INT8_ACTIVATIONS=0 keeps them float). Embeddings and LoRA adapters stay in --dtype. GPTQ and AWQ "
    "4-bit checkpoints and FP8 ones (quant_method fp8 or compressed-tensors) are recognized from their config and "
    "served as they are: leave this unset for them.",
)
@click.option(
    "--max-model-len", type=click.IntRange(min=1), default=None, help="Context length cap (default: the model's)."
)
@click.option(
    "--kv-budget",
    default=None,
    help="Page pool size: bytes (2GiB, 512MiB) or a fraction of the memory free after loading (default 0.5).",
)
@click.option(
    "--gpu-memory-utilization",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="vLLM's name for --kv-budget as a fraction.",
)
@click.option(
    "--tensor-parallel-size",
    "-tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Split the model over this many ranks, one process each (one CUDA device each, or CPU processes), as "
    "Megatron does, with LoRA split as S-LoRA does; --kv-budget is then per rank.",
)
@click.option(
    "--role",
    type=click.Choice(["prefill", "decode", "both"]),
    default="both",
    show_default=True,
    help="What the platform sends this engine, announced in the fleet registry: prompts to prefill (their KV blocks "
    "then pinned for a decode engine to fetch), decodes (starting from a prefill engine's blocks), or both.",
)
@click.option(
    "--kv-transfer-ttl",
    type=click.FloatRange(0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds a prefill's KV blocks stay pinned for a decode engine to fetch (KV transfer needs --api-key).",
)
@click.option(
    "--kv-fetch-timeout",
    type=click.FloatRange(0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds a fetch of KV blocks from a peer may take before the request computes them itself.",
)
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV block (8 to 128).")
@click.option("--max-num-seqs", type=int, default=256, show_default=True, help="Requests running at once.")
@click.option("--max-num-batched-tokens", type=int, default=4096, show_default=True, help="Token budget of one step.")
@click.option(
    "--scheduling-policy",
    type=click.Choice(["fair", "fcfs"]),
    default="fair",
    show_default=True,
    help="fair: priority, then the least-served fairness key (weighted VTC); fcfs: arrival order alone.",
)
@click.option(
    "--max-waiting-requests",
    type=click.IntRange(min=0),
    default=1024,
    show_default=True,
    help="Requests the queue holds before new ones are refused with 503 overloaded (0: unbounded).",
)
@click.option(
    "--max-waiting-tokens",
    type=click.IntRange(min=0),
    default=1_048_576,
    show_default=True,
    help="Prompt tokens the queue holds before new requests are refused with 503 overloaded (0: unbounded).",
)
@click.option(
    "--speculative-config",
    default=None,
    metavar="JSON",
    help='Speculative decoding, in vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\', or \'{"method": "draft_model", "model": PATH, '
    '"num_speculative_tokens": 4}\'. Each step speculates only in the room a busy batch leaves, and only where '
    "speculating steps were measured faster; answers are the same as without it.",
)
@click.option(
    "--speculative-knee-tokens",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Largest step (tokens) speculation may grow a step to; within it, the measured step cost decides.",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(REASONING_PARSERS),
    default=None,
    help="The model reasons in a <think> block (vLLM's parser names): chat answers carry it as reasoning_content, "
    "usage counts its tokens, output grammars start after it, and reasoning_effort tiers bound it.",
)
@click.option(
    "--reasoning-budgets",
    default=None,
    metavar="TIER=TOKENS,...",
    help="Thinking-token budget of each reasoning_effort tier, e.g. none=0,low=64,medium=256,high=1024 "
    f"(tiers left out keep {format_reasoning_budgets(DEFAULT_REASONING_BUDGETS)}). Needs --reasoning-parser.",
)
@click.option(
    "--default-reasoning-effort",
    type=click.Choice(REASONING_EFFORTS),
    default=None,
    help=f"The tier of a request without reasoning_effort (default: {DEFAULT_REASONING_EFFORT}).",
)
@click.option(
    "--reasoning-closing-text",
    default=None,
    metavar="TEXT",
    help="Text forced before </think> when a row spends its budget (default: a short 'time is up' sentence).",
)
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=True,
    show_default=True,
    help="Reuse the KV of full blocks a prompt starts with (kept apart per cache_salt and per adapter).",
)
@click.option("--served-model-name", default=None, help="The model name clients send (default: the folder's name).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of unseeded sampling.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--num-threads", type=int, default=None, help="CPU threads for torch (default: torch's choice).")
@click.option(
    "--lora",
    "lora_modules",
    multiple=True,
    metavar="NAME=PATH",
    help="Serve a LoRA adapter as model NAME: a folder PEFT's save_pretrained wrote, or s3://bucket/prefix. "
    "Repeatable; more can be loaded at run time with POST /v1/load_lora_adapter.",
)
@click.option(
    "--max-loras",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Adapters resident in the pool at once.",
)
@click.option(
    "--max-lora-rank",
    type=click.IntRange(1, 1024),
    default=128,
    show_default=True,
    help="The largest adapter rank accepted.",
)
@click.option(
    "--max-adapters-per-batch",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Distinct adapters in one step.",
)
@click.option("--s3-endpoint-url", default=None, help="S3 endpoint for s3:// adapters (MinIO, SeaweedFS, AWS).")
@click.option(
    "--adapter-root",
    "adapter_roots",
    multiple=True,
    metavar="FOLDER|s3://BUCKET/PREFIX",
    help="Accept a request's own adapter (the `lora_adapter` field: name, source, digest) from under this folder or "
    "S3 prefix. Repeatable; without it the field is refused. Name only places a trusted caller (the platform) "
    "writes to: any client that reaches this server can make it read adapters there.",
)
@click.option("--redis-url", default=None, help="Register this engine in the fleet's Redis registry (redis://...).")
@click.option(
    "--redis-prefix",
    default="loraplex:",
    show_default=True,
    help="Prefix of the registry's keys (the platform's Redis key prefix).",
)
@click.option("--engine-id", default=None, help="This engine's id in the registry (default: hostname:port).")
@click.option(
    "--public-url",
    default=None,
    help="The URL the platform calls this engine at (default: http://host:port, the hostname for 0.0.0.0).",
)
@click.option(
    "--base-model-name",
    default=None,
    help="The platform's name of the base model, for the registry; also accepted as `model` (default: the served "
    "model name).",
)
@click.option(
    "--api-key",
    envvar="LORAPLEX_ENGINE_API_KEY",
    default=None,
    help="Require this bearer token on every /v1 route (vLLM's --api-key); the platform sends its "
    "LORAPLEX_ENGINE_API_KEY. Read from LORAPLEX_ENGINE_API_KEY when not given, which keeps it out of `ps`.",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(TOOL_CALL_PARSERS),
    default=None,
    help="How tool_choice auto finds calls in the model's text (vLLM's option): hermes (Hermes, Qwen) or llama3_json "
    "(Llama 3.1+). Default: the one the chat template's format calls for, else hermes.",
)
def engine_serve(
    model_path: Path,
    host: str,
    port: int,
    dtype: str,
    quantization: str | None,
    max_model_len: int | None,
    kv_budget: str | None,
    gpu_memory_utilization: float | None,
    tensor_parallel_size: int,
    role: str,
    kv_transfer_ttl: float,
    kv_fetch_timeout: float,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    scheduling_policy: str,
    max_waiting_requests: int,
    max_waiting_tokens: int,
    speculative_config: str | None,
    speculative_knee_tokens: int,
    reasoning_parser: str | None,
    reasoning_budgets: str | None,
    default_reasoning_effort: str | None,
    reasoning_closing_text: str | None,
    enable_prefix_caching: bool,
    served_model_name: str | None,
    seed: int,
    device: str,
    num_threads: int | None,
    lora_modules: tuple[str, ...],
    max_loras: int,
    max_lora_rank: int,
    max_adapters_per_batch: int,
    s3_endpoint_url: str | None,
    adapter_roots: tuple[str, ...],
    redis_url: str | None,
    redis_prefix: str,
    engine_id: str | None,
    public_url: str | None,
    base_model_name: str | None,
    api_key: str | None,
    tool_call_parser: str | None,
) -> None:
    """Serve one model and its LoRA adapters over OpenAI-compatible HTTP (/v1/completions, /v1/chat/completions,
    /v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter); with --redis-url, register it in the fleet."""
    from dataclasses import fields

    import torch

    from loraplex.engine.core.config import EngineConfig
    from loraplex.engine.errors import CheckpointError, WorkerFailed
    from loraplex.engine.lora.ref import S3_SCHEME, LoRARequest
    from loraplex.engine.serve.kv_transfer import KVTransferConfig
    from loraplex.engine.serve.lora_registry import AdapterRoots
    from loraplex.engine.serve.registration import RegistrationConfig, default_engine_id, default_public_url
    from loraplex.engine.serve.server import serve

    if kv_budget is not None and gpu_memory_utilization is not None:
        raise click.UsageError("give --kv-budget or --gpu-memory-utilization, not both")
    budget: int | float = 0.5 if gpu_memory_utilization is None else gpu_memory_utilization
    if kv_budget is not None:
        try:
            budget = parse_memory_budget(kv_budget)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--kv-budget") from None
    loras: list[LoRARequest] = []
    for spec in lora_modules:
        name, _, path = spec.partition("=")
        if not name.strip() or not path.strip():
            raise click.BadParameter(f"{spec!r} is not NAME=PATH", param_hint="--lora")
        loras.append(LoRARequest(name.strip(), path.strip()))
    if device != "auto":
        try:
            resolved = torch.device(device)
        except RuntimeError:
            raise click.BadParameter(f"{device!r} is not a torch device", param_hint="--device") from None
        if resolved.type == "cuda" and not torch.cuda.is_available():
            raise click.BadParameter("CUDA is not available on this machine", param_hint="--device")
    # A relative folder means the one it names now, not wherever the server's working directory is later.
    roots = [root if root.startswith(S3_SCHEME) else str(Path(root).absolute()) for root in adapter_roots]
    try:
        AdapterRoots(roots)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--adapter-root") from None
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("must not be empty", param_hint="--api-key")
    registration = None
    fleet_options = {"--engine-id": engine_id, "--public-url": public_url, "--base-model-name": base_model_name}
    if redis_url is None:
        if given := [option for option, value in fleet_options.items() if value is not None]:
            raise click.UsageError(f"{', '.join(given)} only matter with --redis-url")
    else:
        if port == 0 and (engine_id is None or public_url is None):
            raise click.UsageError("with --port 0 and --redis-url, give --engine-id and --public-url")
        try:
            registration = RegistrationConfig(
                redis_url=redis_url,
                engine_id=engine_id or default_engine_id(port),
                url=public_url or default_public_url(host, port),
                base_model=base_model_name,
                prefix=redis_prefix,
                role=role,
            )
        except ValueError as exc:
            # RegistrationConfig's messages start with the field's name: point at the option that set it.
            field_options = {"redis_url": "--redis-url", "engine_id": "--engine-id", "url": "--public-url"}
            option = next((o for f, o in field_options.items() if str(exc).startswith(f)), "--base-model-name")
            raise click.BadParameter(str(exc), param_hint=option) from None
    try:
        speculation = None if speculative_config is None else SpeculativeConfig.parse(speculative_config)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--speculative-config") from None
    reasoning = _reasoning_config(reasoning_parser, reasoning_budgets, default_reasoning_effort, reasoning_closing_text)
    try:
        config = EngineConfig(
            model=model_path,
            dtype=dtype,  # type: ignore[arg-type]  # click.Choice checked it
            quantization=quantization,  # type: ignore[arg-type]  # click.Choice checked it
            device=device,
            max_model_len=max_model_len,
            kv_budget=budget,
            tensor_parallel_size=tensor_parallel_size,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            scheduling_policy=scheduling_policy,  # type: ignore[arg-type]  # click.Choice checked it
            max_waiting_requests=max_waiting_requests or None,
            max_waiting_tokens=max_waiting_tokens or None,
            speculative_config=speculation,
            speculative_knee_tokens=speculative_knee_tokens,
            reasoning=reasoning,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            num_threads=num_threads,
            served_model_name=served_model_name,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_adapters_per_batch=max_adapters_per_batch,
            s3_endpoint_url=s3_endpoint_url,
        )
    except ValueError as exc:
        # EngineConfig's messages start with the field's name; point at the option that set it.
        message = str(exc)
        field = next((f.name for f in fields(EngineConfig) if message.startswith(f.name)), None)
        hint = f"--{field.replace('_', '-')}" if field else None
        raise click.BadParameter(message, param_hint=hint) from None

    configure_logging()
    try:
        asyncio.run(
            serve(
                config,
                host=host,
                port=port,
                lora_modules=loras,
                adapter_roots=roots,
                registration=registration,
                api_key=api_key,
                tool_call_parser=tool_call_parser,
                kv_transfer=KVTransferConfig(
                    public_url=public_url or default_public_url(host, port),
                    api_key=api_key,
                    ttl_s=kv_transfer_ttl,
                    fetch_timeout_s=kv_fetch_timeout,
                ),
            )
        )
    except (CheckpointError, ValueError, WorkerFailed) as exc:
        # A bad model folder, a context or budget the model and memory cannot honour, an adapter that cannot be
        # served (LoraModuleError names it), or a model the ranks cannot split: the message says which.
        raise click.ClickException(str(exc)) from None


def _reasoning_config(
    parser: str | None, budgets: str | None, default_effort: str | None, closing_text: str | None
) -> ReasoningConfig | None:
    """The reasoning flags as one config; a budget, tier or closing text without a parser is a usage error."""
    if parser is None:
        given = {
            "--reasoning-budgets": budgets,
            "--default-reasoning-effort": default_effort,
            "--reasoning-closing-text": closing_text,
        }
        if named := [option for option, value in given.items() if value is not None]:
            raise click.UsageError(f"{', '.join(named)} need --reasoning-parser")
        return None
    try:
        parsed = parse_reasoning_budgets(budgets) if budgets is not None else {}
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--reasoning-budgets") from None
    try:
        return ReasoningConfig(
            parser=parser,
            budgets=parsed,
            default_effort=default_effort or DEFAULT_REASONING_EFFORT,
            closing_text=DEFAULT_CLOSING_TEXT if closing_text is None else closing_text,
        )
    except ValueError as exc:
        hint = "--reasoning-closing-text" if "closing text" in str(exc) else "--reasoning-budgets"
        raise click.BadParameter(str(exc), param_hint=hint) from None


@engine.command("demo-model")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--size",
    type=click.Choice(["demo", "benchmark"]),
    default="demo",
    show_default=True,
    help="demo: 4M parameters, quick on a laptop; benchmark: the ~56M-parameter model of benchmarks/.",
)
def engine_demo_model(path: Path, size: str) -> None:
    """Write a random Llama checkpoint with a real tokenizer into PATH (no download needed)."""
    import dataclasses

    from loraplex.engine.tools.demo import BENCHMARK_SPEC, DEMO_SPEC, write_random_model

    if path.exists() and any(path.iterdir()):
        raise click.ClickException(f"{path} is not empty")
    spec = DEMO_SPEC if size == "demo" else dataclasses.replace(BENCHMARK_SPEC, torch_dtype="float32")
    written = write_random_model(path, spec)
    click.echo(f"wrote a random {spec.num_parameters / 1e6:.1f}M-parameter {spec.architecture} model to {written}")


@engine.command("demo-adapter")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--model", "model_path", type=click.Path(path_type=Path), required=True, help="The base model folder.")
@click.option("--rank", type=int, default=8, show_default=True, help="LoRA rank.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
def engine_demo_adapter(path: Path, model_path: Path, rank: int, seed: int) -> None:
    """Write a random LoRA adapter for MODEL into PATH, in PEFT's format (all linear layers)."""
    from loraplex.engine.errors import CheckpointError
    from loraplex.engine.model.config import ModelConfig
    from loraplex.engine.tools.demo_adapter import write_random_adapter

    if path.exists() and any(path.iterdir()):
        raise click.ClickException(f"{path} is not empty")
    try:
        config = ModelConfig.from_dir(model_path)
        written = write_random_adapter(path, config, rank=rank, seed=seed, init_std=0.05)
    except (CheckpointError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote a random rank-{rank} LoRA adapter for {model_path} to {written}")
