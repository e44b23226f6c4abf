"""The engine's faces: the offline `LLM`, the `AsyncEngine` thread, the OpenAI-compatible HTTP server (protocol,
serving, the adapter name registry, the edge guards), the other wire protocols (protocols/: Responses, Messages),
Prometheus metrics, fleet registration, and the `loraplex engine ...` commands.

May import: engine.core and everything below it. Nothing in the engine imports engine.serve; the platform does,
through the names below (loaded on first use, like the engine package's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.engine.serve.chat_messages import ChatMessage
    from loraplex.engine.serve.cli import configure_logging, engine
    from loraplex.engine.serve.http_edge import GuardedRequest, refuse_nul_bytes
    from loraplex.engine.serve.protocol import RESERVED_TEMPLATE_VARIABLES, completion_limit
    from loraplex.engine.serve.protocols import messages, responses
    from loraplex.engine.serve.registration import ENGINE_KEY, ENGINES_SET, FleetRecord, engine_record
    from loraplex.engine.serve.server import create_engine_app, serve
    from loraplex.engine.serve.tool_calls import NamedToolChoice, ToolDefinition

__all__ = [
    "ENGINES_SET",
    "ENGINE_KEY",
    "RESERVED_TEMPLATE_VARIABLES",
    "ChatMessage",
    "FleetRecord",
    "GuardedRequest",
    "NamedToolChoice",
    "ToolDefinition",
    "completion_limit",
    "configure_logging",
    "create_engine_app",
    "engine",
    "engine_record",
    "messages",
    "refuse_nul_bytes",
    "responses",
    "serve",
]

_WHERE = {
    "configure_logging": "loraplex.engine.serve.cli",
    "engine": "loraplex.engine.serve.cli",
    "GuardedRequest": "loraplex.engine.serve.http_edge",
    "refuse_nul_bytes": "loraplex.engine.serve.http_edge",
    "ChatMessage": "loraplex.engine.serve.chat_messages",
    "RESERVED_TEMPLATE_VARIABLES": "loraplex.engine.serve.protocol",
    "NamedToolChoice": "loraplex.engine.serve.tool_calls",
    "ToolDefinition": "loraplex.engine.serve.tool_calls",
    "completion_limit": "loraplex.engine.serve.protocol",
    "ENGINE_KEY": "loraplex.engine.serve.registration",
    "ENGINES_SET": "loraplex.engine.serve.registration",
    "FleetRecord": "loraplex.engine.serve.registration",
    "engine_record": "loraplex.engine.serve.registration",
    "create_engine_app": "loraplex.engine.serve.server",
    "serve": "loraplex.engine.serve.server",
}


# Modules the platform uses whole: the Messages and Responses APIs' converters (their shapes and writing).
_MODULES = {
    "messages": "loraplex.engine.serve.protocols.messages",
    "responses": "loraplex.engine.serve.protocols.responses",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'loraplex.engine.serve' has no attribute {name!r}")
