"""loraplex data plane: model, memory pool, scheduler, engine server.

`from loraplex.engine import LLM, SamplingParams` is the offline API; importing this package stays cheap (the
names load on first use), so the platform can import engine submodules without pulling in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.engine.core.config import EngineConfig
    from loraplex.engine.core.outputs import CompletionOutput, RequestOutput
    from loraplex.engine.core.sampling_params import SamplingParams
    from loraplex.engine.lora.ref import LoRARequest
    from loraplex.engine.serve.async_engine import AsyncEngine
    from loraplex.engine.serve.llm import LLM

__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams"]

_WHERE = {
    "LLM": "loraplex.engine.serve.llm",
    "LoRARequest": "loraplex.engine.lora.ref",
    "AsyncEngine": "loraplex.engine.serve.async_engine",
    "EngineConfig": "loraplex.engine.core.config",
    "CompletionOutput": "loraplex.engine.core.outputs",
    "RequestOutput": "loraplex.engine.core.outputs",
    "SamplingParams": "loraplex.engine.core.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'loraplex.engine' has no attribute {name!r}")
