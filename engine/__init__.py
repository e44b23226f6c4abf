"""loraplex data plane: model, memory pool, scheduler, engine server.

`from loraplex.engine import LLM, SamplingParams` is the offline API; importing this package stays cheap (the
names load on first use), so the platform can import engine submodules without pulling in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.engine.adapter_ref import LoRARequest
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm import LLM
    from loraplex.engine.outputs import CompletionOutput, RequestOutput
    from loraplex.engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams"]

_WHERE = {
    "LLM": "loraplex.engine.llm",
    "LoRARequest": "loraplex.engine.adapter_ref",
    "AsyncEngine": "loraplex.engine.async_engine",
    "EngineConfig": "loraplex.engine.config",
    "CompletionOutput": "loraplex.engine.outputs",
    "RequestOutput": "loraplex.engine.outputs",
    "SamplingParams": "loraplex.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'loraplex.engine' has no attribute {name!r}")
