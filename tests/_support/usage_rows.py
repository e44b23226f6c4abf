"""Usage rows as the recorder writes them, for tests that seed the ledger directly (billing, the console)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any


def usage_row(tenant_id: uuid.UUID | str, started_at: datetime, **changes: Any) -> dict[str, Any]:
    """One finished request of `tenant_id` on the base model llama-a, lasting 2 s, with no tokens unless `changes`
    say otherwise; `changes` may set any column."""
    row: dict[str, Any] = {
        "request_id": f"chatcmpl-{uuid.uuid4().hex}",
        "tenant_id": uuid.UUID(str(tenant_id)),
        "api_key_id": None,
        "endpoint_id": None,
        "adapter_id": None,
        "adapter_digest": None,
        "model": "llama-a",
        "base_model": "llama-a",
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "completion_tokens": 0,
        "status": "ok",
        "started_at": started_at,
        "finished_at": started_at + timedelta(seconds=2),
    }
    row.update(changes)
    return row
