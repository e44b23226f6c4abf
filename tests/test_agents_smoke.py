"""Opt-in (`make agents-smoke`, which installs them from npm): the real agent CLIs, one turn each, against
`loraplex dev` serving a random Qwen3 of a long context (Codex CLI's prompt is about 10k tokens, Claude Code's about
48k). `codex exec` through the Responses API with a config.toml model provider (docs/agents.md), `claude -p` through
the Messages API with the ANTHROPIC_* variables: each request arrives and is billed to the tenant, and each client
takes the stream to its end. A random model writes gibberish until its limit: Codex prints it and exits 0; Claude
Code says the answer ran past its CLAUDE_CODE_MAX_OUTPUT_TOKENS, which is its reading of `stop_reason:
max_tokens`."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / "build" / "agents" / "node_modules" / ".bin"
MODEL = "smoke-qwen3"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("LPX_AGENTS_SMOKE") or not (BIN / "codex").exists() or not (BIN / "claude").exists(),
        reason="opt-in: make agents-smoke (installs @openai/codex and @anthropic-ai/claude-code from npm)",
    ),
]


def _request(url: str, method: str = "GET", body: Any = None, token: str | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _model(path: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from _support.checkpoints import make_checkpoint
    from _support.family_chat import write_family_tokenizer

    make_checkpoint(path, "qwen3", max_position_embeddings=131072)
    write_family_tokenizer(path, "qwen3")
    return path


def test_codex_and_claude_code_run_a_turn(tmp_path: Path) -> None:
    model = _model(tmp_path / MODEL)
    port = 18000 + secrets.randbelow(2000)
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env |= {
        "LORAPLEX_ENGINE_MODEL": str(model),
        "LORAPLEX_ENGINE_MAX_MODEL_LEN": "65536",
        "LORAPLEX_ENGINE_KV_BUDGET": "512MiB",
    }
    loraplex = Path(sys.executable).with_name("loraplex")
    server = subprocess.Popen(
        [str(loraplex), "dev", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _request(f"{url}/healthz")
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "loraplex dev did not start"
                time.sleep(0.5)
        admin = (tmp_path / ".loraplex" / "admin_token").read_text().strip()
        tenant = _request(f"{url}/admin/tenants", "POST", {"name": "agents"}, admin)["id"]
        key = _request(f"{url}/admin/tenants/{tenant}/api-keys", "POST", {"name": "k"}, admin)["key"]
        home = tmp_path / "home"
        (home / ".codex").mkdir(parents=True)
        (home / ".codex" / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "loraplex"\n\n[model_providers.loraplex]\nname = "loraplex"\n'
            f'base_url = "{url}/v1"\nenv_key = "LPX_API_KEY"\nwire_api = "responses"\n'
        )
        agent_env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(home / ".codex"), "LPX_API_KEY": key}
        codex = subprocess.run(
            [str(BIN / "codex"), "exec", "--skip-git-repo-check", "Say hi"],
            env=agent_env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        assert codex.returncode == 0, codex.stdout + codex.stderr
        assert codex.stdout.strip(), codex.stderr
        claude_env = agent_env | {
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_AUTH_TOKEN": key,
            "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "32",
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        claude = subprocess.run(
            [str(BIN / "claude"), "-p", "Say hi", "--max-turns", "1"],
            env=claude_env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        printed = claude.stdout + claude.stderr
        assert claude.returncode == 0 or "output token maximum" in printed, printed
        usage = _request(f"{url}/v1/usage?limit=100", token=key)["data"]
        ids = [row["request_id"] for row in usage]
        assert any(i.startswith("resp_") for i in ids) and any(i.startswith("msg_") for i in ids), ids
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
