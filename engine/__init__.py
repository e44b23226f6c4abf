"""loraplex data plane: model, memory pool, scheduler, engine server.

The public face: `from loraplex.engine import LLM, SamplingParams` is the offline API, `AsyncEngine` the one the
server and the platform drive, and the rest is what callers outside the engine (the platform, the CLI) name. Other
callers import only this package, `loraplex.engine.lora` (reading and validating PEFT adapters) and
`loraplex.engine.serve` (the HTTP server and its commands), never the modules inside. Importing this package stays
cheap: the names load on first use, so the platform can import it without pulling in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.engine.core.config import EngineConfig, parse_memory_budget
    from loraplex.engine.core.outputs import CompletionOutput, RequestOutput
    from loraplex.engine.core.reasoning_config import (
        MAX_THINKING_BUDGET,
        REASONING_EFFORTS,
        REASONING_PARSERS,
        ReasoningConfig,
        parse_reasoning_budgets,
    )
    from loraplex.engine.core.sampling_params import SamplingParams, StructuredOutputsParams
    from loraplex.engine.core.speculative_config import SpeculativeConfig
    from loraplex.engine.errors import CheckpointError, EngineError, RequestError
    from loraplex.engine.lora.manager import AdapterState
    from loraplex.engine.lora.ref import AdapterRef, LoRARequest
    from loraplex.engine.model.config import ModelConfig
    from loraplex.engine.model.quantization import QUANTIZATIONS, QuantizationName
    from loraplex.engine.serve.async_engine import AsyncEngine
    from loraplex.engine.serve.llm import LLM

__all__ = [
    "LLM",
    "MAX_THINKING_BUDGET",
    "QUANTIZATIONS",
    "REASONING_EFFORTS",
    "REASONING_PARSERS",
    "AdapterRef",
    "AdapterState",
    "AsyncEngine",
    "CheckpointError",
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "LoRARequest",
    "ModelConfig",
    "QuantizationName",
    "ReasoningConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "parse_memory_budget",
    "parse_reasoning_budgets",
]

_WHERE = {
    "LLM": "loraplex.engine.serve.llm",
    "AsyncEngine": "loraplex.engine.serve.async_engine",
    "EngineConfig": "loraplex.engine.core.config",
    "parse_memory_budget": "loraplex.engine.core.config",
    "CompletionOutput": "loraplex.engine.core.outputs",
    "RequestOutput": "loraplex.engine.core.outputs",
    "SamplingParams": "loraplex.engine.core.sampling_params",
    "StructuredOutputsParams": "loraplex.engine.core.sampling_params",
    "SpeculativeConfig": "loraplex.engine.core.speculative_config",
    "ReasoningConfig": "loraplex.engine.core.reasoning_config",
    "REASONING_EFFORTS": "loraplex.engine.core.reasoning_config",
    "MAX_THINKING_BUDGET": "loraplex.engine.core.reasoning_config",
    "REASONING_PARSERS": "loraplex.engine.core.reasoning_config",
    "parse_reasoning_budgets": "loraplex.engine.core.reasoning_config",
    "CheckpointError": "loraplex.engine.errors",
    "EngineError": "loraplex.engine.errors",
    "RequestError": "loraplex.engine.errors",
    "AdapterState": "loraplex.engine.lora.manager",
    "AdapterRef": "loraplex.engine.lora.ref",
    "LoRARequest": "loraplex.engine.lora.ref",
    "ModelConfig": "loraplex.engine.model.config",
    "QUANTIZATIONS": "loraplex.engine.model.quantization",
    "QuantizationName": "loraplex.engine.model.quantization",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'loraplex.engine' has no attribute {name!r}")
