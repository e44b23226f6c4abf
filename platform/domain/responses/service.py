"""Stored responses: a request's input as the items GET .../input_items lists (each with an id), the conversation a
`previous_response_id` continues (every response of its chain: its input items, then its output as input), and
the row a response is stored as."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any

from loraplex.engine.serve import responses as responses_api
from loraplex.platform.domain.responses.models import StoredResponse
from loraplex.platform.ids import TenantId

_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(body: responses_api.ResponsesRequest) -> list[dict[str, Any]]:
    """`body.input` as stored input items: a string is one user message; messages get their parts as
    `input_text` (`output_text` in assistant turns); every item an id and `status: completed`."""
    raw = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    items = []
    for item in raw:
        kind = item.get("type", "message")
        stored = {key: value for key, value in item.items() if key != "id"}
        stored["type"] = kind
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content")
            parts = content if isinstance(content, list) else [{"type": part, "text": content}]
            stored["content"] = [{"type": p.get("type", part), "text": p.get("text", "")} for p in parts]
        stored["id"] = item.get("id") or f"{_PREFIXES.get(kind, 'item')}_{secrets.token_hex(12)}"
        stored.setdefault("status", "completed")
        items.append(stored)
    return items


def history(chain: list[StoredResponse]) -> list[dict[str, Any]]:
    """The conversation `chain` (oldest first) holds, as input items: each response's input, then its output."""
    items: list[dict[str, Any]] = []
    for row in chain:
        items += [{k: v for k, v in item.items() if k not in ("id", "status")} for item in row.input_items]
        items += responses_api.items_of(row.response)
    return items


def stored(
    tenant_id: TenantId,
    response: dict[str, Any],
    items: list[dict[str, Any]],
    now: datetime,
    retention_days: float,
) -> StoredResponse:
    return StoredResponse(
        id=response["id"],
        tenant_id=tenant_id,
        previous_response_id=response.get("previous_response_id"),
        input_items=items,
        response=response,
        status=response["status"],
        created_at=now,
        expires_at=now + timedelta(days=retention_days),
    )
