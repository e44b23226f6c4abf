"""Schemathesis over the platform's own OpenAPI document: every operation, with bodies, queries and paths that fit
the schema and with ones that break it, must answer something other than a 5xx.

The platform is test_completions' (embedded engine on the tiny checkpoint, real Postgres, Redis and S3; its
fixtures imported, so this module starts one of its own). Admin operations get the admin token, the rest a
tenant's key. Generation is derandomized, so a run is repeatable and bounded: `EXAMPLES` cases per operation and
mode. For a longer hunt, LORAPLEX_FUZZ_EXAMPLES raises the count and LORAPLEX_FUZZ_RANDOM=1 draws new cases.
"""

from __future__ import annotations

import os
import time
from typing import Any

import hypothesis
import hypothesis.errors
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode

from . import test_completions
from .test_completions import ADMIN, Owner, Platform

pytestmark = [pytest.mark.integration, pytest.mark.slow]

settings = test_completions.settings
platform = test_completions.platform
adapter_dir = test_completions.adapter_dir
owner = test_completions.owner

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "25"))


def _fuzz(url: str, operation: Any, mode: GenerationMode, headers: dict[str, str], failures: list[str]) -> int:
    """Run `EXAMPLES` generated cases of one operation; returns how many were sent, adds each 5xx to `failures`."""
    num_calls = 0

    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=os.environ.get("LORAPLEX_FUZZ_RANDOM") is None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        nonlocal num_calls
        num_calls += 1
        response = case.call(base_url=url, headers={**(case.headers or {}), **headers}, timeout=60)
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {response.text[:300]}\n  {case.as_curl_command()}")

    try:
        run()
    except hypothesis.errors.Unsatisfiable:  # nothing to break: an operation without parameters or body
        assert mode is GenerationMode.NEGATIVE, operation.path
    return num_calls


def test_no_operation_answers_a_server_error(platform: Platform, owner: Owner) -> None:
    schema = schemathesis.openapi.from_url(f"{platform.url}/schema/openapi.json")
    failures: list[str] = []
    num_calls = 0
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        admin = operation.path.startswith("/admin") or operation.path == "/metrics"
        headers = ADMIN if admin else owner.tenant.headers
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            num_calls += _fuzz(platform.url, operation, mode, headers, failures)
    elapsed = time.monotonic() - started
    assert num_calls > 0
    assert not failures, f"{len(failures)} server errors in {num_calls} calls ({elapsed:.0f} s):\n" + "\n".join(
        failures[:20]
    )
