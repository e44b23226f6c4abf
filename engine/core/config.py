"""EngineConfig: every knob of one engine, validated once, before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from loraplex.engine.core.reasoning_config import ReasoningConfig
from loraplex.engine.core.speculative_config import SpeculativeConfig
from loraplex.engine.model.quantization import QUANTIZATIONS, QuantizationName

if TYPE_CHECKING:
    import torch

DTypeName = Literal["auto", "float32", "float16", "bfloat16"]
_DTYPE_NAMES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: Path
    dtype: DTypeName = "auto"  # auto: the checkpoint's torch_dtype, but float32 on a CPU for half checkpoints
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # The page pool: bytes (int) or a fraction (0, 1] of the memory free after the weights load.
    kv_budget: int | float = 0.5
    block_size: int = 16  # tokens per KV block (one page)
    max_num_seqs: int = 256  # requests running at once
    max_num_batched_tokens: int = 4096  # token budget of one step (prefill chunks + decodes)
    max_num_partial_prefills: int = 4  # requests whose prompt is split over steps at once
    # "fair": admission by priority, then the least-served fairness key (weighted VTC), then arrival; "fcfs": arrival
    # alone, as vLLM's default.
    scheduling_policy: Literal["fair", "fcfs"] = "fair"
    # The waiting queue's bounds: past either, a new request is refused (EngineOverloaded; the server's 503) instead
    # of piling up. Tokens are those of the waiting requests' prompts. None: unbounded.
    max_waiting_requests: int | None = 1024
    max_waiting_tokens: int | None = 1_048_576
    # Reuse the K/V of full blocks a request's tokens start with (chained hashes; salted per tenant, per adapter).
    enable_prefix_caching: bool = True
    seed: int = 0  # default generator of unseeded sampling
    num_threads: int | None = None  # CPU threads for torch; default: torch's choice
    served_model_name: str | None = None
    # None: weights in `dtype`. int8 (per output channel) or int4 (group-wise, with zero points): the four
    # projections of every layer are quantized at load (round to nearest), an untied lm_head to int8; embeddings,
    # norms and LoRA adapters stay in `dtype`, which is also the activations' dtype (on a CPU with VNNI or AMX the
    # quantized matmuls round their inputs to 8 bits per token: decision 0039).
    quantization: QuantizationName | None = None
    # LoRA: adapters resident in the pool at once, the largest rank accepted, distinct adapters per step, the
    # host-memory tier's budget (bytes), and where s3:// adapters are read from (None: AWS's endpoint).
    max_loras: int = 64
    max_lora_rank: int = 128
    max_adapters_per_batch: int = 32
    lora_host_budget: int = 2 * 2**30
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    # S3 credentials for adapters (None: boto3's chain, e.g. AWS_ACCESS_KEY_ID); the embedded mode passes the
    # platform's own, so the engine reads the bucket the platform writes.
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = field(default=None, repr=False)
    # Speculative decoding (vLLM's --speculative-config; None: off). A step grows to at most
    # `speculative_knee_tokens` tokens with proposals, and only with those likely enough to be kept to pay for their
    # tokens at the measured step cost (speculation_policy.py), so a busy batch does not speculate at all.
    speculative_config: SpeculativeConfig | None = None
    speculative_knee_tokens: int = 128
    # False: speculation decides from each row's acceptance and the step's room alone, never from the clock (no
    # measured step cost, no gate), so how many proposals are verified does not depend on the machine's speed or
    # load. Answers are the same either way; tests that count proposals use it.
    speculative_use_clock: bool = True
    # Reasoning models (vLLM's --reasoning-parser, with per-tier thinking budgets): the think block is followed per
    # request, split from the answer, counted, and held to the request's budget (reasoning.py). None: off.
    reasoning: ReasoningConfig | None = None
    # Tensor parallelism (vLLM's --tensor-parallel-size): the model split over this many ranks, one process each
    # (engine/parallel; one CUDA device each, or CPU processes). 1: not split.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPE_NAMES):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, not {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None, 'int8', 'int4' or 'fp8', not {self.quantization!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be one of 8, 16, 32, 64, 128")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be positive")
        if isinstance(self.kv_budget, float) and not 0 < self.kv_budget <= 1:
            raise ValueError("kv_budget as a fraction must be in (0, 1]")
        if isinstance(self.kv_budget, int) and self.kv_budget <= 0:
            raise ValueError("kv_budget in bytes must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.speculative_knee_tokens < 1:
            raise ValueError("speculative_knee_tokens must be at least 1")
        if self.max_num_partial_prefills < 1:
            raise ValueError("max_num_partial_prefills must be at least 1")
        if self.scheduling_policy not in ("fair", "fcfs"):
            raise ValueError(f"scheduling_policy must be 'fair' or 'fcfs', not {self.scheduling_policy!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1 (or None: unbounded)")
        if self.max_waiting_tokens is not None and self.max_waiting_tokens < 1:
            raise ValueError("max_waiting_tokens must be at least 1 (or None: unbounded)")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be at least 1")
        if self.max_loras < 1 or self.max_adapters_per_batch < 1:
            raise ValueError("max_loras and max_adapters_per_batch must be at least 1")
        if not 1 <= self.max_lora_rank <= 1024:
            raise ValueError("max_lora_rank must be between 1 and 1024")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be a positive integer")
        if self.tensor_parallel_size > 1 and self.speculative_config is not None and self.speculative_config.model:
            raise ValueError("a draft model (speculative_config.model) runs with tensor_parallel_size 1 only")

    def resolve_device(self) -> torch.device:
        import torch  # here, not at the top: the platform reads configs without loading torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            dtype: torch.dtype = getattr(torch, self.dtype)
            return dtype
        # Half-precision matmuls are slow on most CPUs; auto keeps them for accelerators.
        if device.type == "cpu" and checkpoint_dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return checkpoint_dtype


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_BUDGET_FORMS = "must be a fraction in (0, 1] or a size in bytes such as 2GiB"


def parse_memory_budget(value: str) -> int | float:
    """A page pool budget as people write it: `0.5` -> 0.5 (a fraction of free memory), `2GiB` -> 2147483648 bytes.
    Raise ValueError otherwise. The engine's --kv-budget and the platform's LORAPLEX_ENGINE_KV_BUDGET read it."""
    text = value.strip().upper().replace(" ", "")
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        if 0 < number <= 1:
            return number
        if number > 1 and number.is_integer():
            return int(number)
        raise ValueError(_BUDGET_FORMS)
    digits = text.rstrip("KMGIB")
    unit = text[len(digits) :]
    if unit not in _UNITS or not digits:
        raise ValueError(_BUDGET_FORMS)
    try:
        size = float(digits) * _UNITS[unit]
    except ValueError:
        raise ValueError(_BUDGET_FORMS) from None
    if size < 1:
        raise ValueError("must be a positive size")
    return int(size)
