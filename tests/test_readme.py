"""README.md stays true: `loraplex dev` prints a working curl line, the API tour runs as written, and the
configuration table lists every setting."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.platform.settings import ENV_PREFIX, Settings

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def dev_server(tmp_path: Path) -> Iterator[tuple[str, list[str], Path]]:
    """`loraplex dev` in a fresh folder, as a newcomer runs it; yields (url, printed lines, working dir)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    loraplex = Path(sys.executable).with_name("loraplex")
    process = subprocess.Popen(
        [str(loraplex), "dev", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError as exc:
                if process.poll() is not None:
                    output = process.stdout.read() if process.stdout else ""
                    raise AssertionError(f"loraplex dev exited: {output}") from exc
                time.sleep(0.2)
        else:
            raise AssertionError("loraplex dev did not answer /healthz within 60 s")
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "API docs:" in line:
                break
        yield url, lines, tmp_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.mark.slow
def test_dev_prints_url_token_and_a_working_curl(dev_server: tuple[str, list[str], Path]) -> None:
    url, lines, workdir = dev_server
    text = "\n".join(lines)
    assert url in text
    token = (workdir / ".loraplex" / "admin_token").read_text().strip()
    assert f"admin token: {token}" in text
    curl = next(line.strip() for line in lines if line.strip().startswith("curl") and "-X POST" in line)
    result = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=30, check=True)
    assert '"name":"acme"' in result.stdout.replace(" ", "")
    # The console's printed address goes straight to the sign-in form.
    console = next(line.split()[1] for line in lines if line.strip().startswith("console:"))
    assert console == f"{url}/console"
    with urllib.request.urlopen(console, timeout=10) as response:
        assert response.status == 200
        assert 'action="/console/sign-in"' in response.read().decode()


def tour_script(section: str) -> str:
    """The section's code blocks as one bash script, in order: bash as written, Python through the venv's python
    in the same shell (the tour says to run it there, where the shell's exports reach it)."""
    parts: list[str] = []
    for language, body in re.findall(r"```(bash|python)\n(.*?)```", section, re.S):
        parts.append(body if language == "bash" else f"{shlex.quote(sys.executable)} - <<'PYTHON'\n{body}PYTHON\n")
    return "".join(parts)


@pytest.mark.slow
def test_api_tour_runs_as_written(dev_server: tuple[str, list[str], Path]) -> None:
    url, _, workdir = dev_server
    section = README.split("## API tour", 1)[1].split("\n## ", 1)[0]
    # The tour runs at the repository root: the demo adapters are where it says.
    (workdir / "demo").symlink_to(REPO / "demo")
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", tour_script(section)],
        cwd=workdir,
        env={**os.environ, "LPX": url},
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    compact = result.stdout.replace(" ", "")
    assert '"invalid_api_key"' in result.stdout
    assert '"account_suspended"' in result.stdout
    assert '"status":"suspended"' in compact
    assert '"object":"endpoint"' in compact and '"name":"shouty"' in compact
    # The base model answers in ordinary case; the endpoint's adapter (demo/adapters/upper) in upper case.
    # curl prints no final newline: an answer's line may start right after the previous JSON.
    answers = dict(re.findall(r"(?:^|\})(loraplex-demo|shouty): (.*)$", result.stdout, re.M))
    assert set(answers) == {"loraplex-demo", "shouty"}, output
    for model, share in (("loraplex-demo", lambda s: s < 0.3), ("shouty", lambda s: s > 0.8)):
        letters = [c for c in answers[model] if c.isalpha()]
        assert letters and share(sum(c.isupper() for c in letters) / len(letters)), (model, answers[model])
    # The streamed answer is the non-streamed one (greedy), followed by its usage.
    assert answers["shouty"] in result.stdout.split(f"shouty: {answers['shouty']}", 1)[1], output
    # The thinking adapter's tiers: none thinks not at all, low less than high, and each answers.
    thought = {
        effort: int(tokens)
        for effort, tokens in re.findall(r"^thinker \((\w+)\): (\d+) reasoning tokens$", result.stdout, re.M)
    }
    assert set(thought) == {"none", "low", "high"}, output
    assert thought["none"] == 0 < thought["low"] < thought["high"], thought
    assert "  reasoning: None" in result.stdout, output  # none's
    answers_after_thinking = re.findall(r"^  answer: (.+)$", result.stdout, re.M)
    assert len(answers_after_thinking) == 3 and all(a.strip() for a in answers_after_thinking), output
    usage = re.search(r'"totals":\{[^}]*"requests":(\d+)', compact)
    assert usage is not None and int(usage.group(1)) == 6, output
    reasoning = re.search(r'"totals":\{[^}]*"reasoning_tokens":(\d+)', compact)
    assert reasoning is not None and int(reasoning.group(1)) == thought["low"] + thought["high"], output
    # The six requests are priced: the tenant's bill and the admin's report line agree.
    bill = re.search(r'"billing":\{[^}]*"cost_total":"([0-9.]+)"', compact)
    report = re.search(r'"rows":\[\{"tenant_name":"acme-tour"[^}]*"cost_total":"([0-9.]+)"', compact)
    assert bill is not None and report is not None, output
    assert bill.group(1) == report.group(1) and float(bill.group(1)) > 0, output
    # The Messages API on the same endpoint: a thinking block (held to its budget of 16), then the answer.
    assert re.search(
        r"(?:^|\})claude thinker: \['thinking', 'text'\], stop_reason (end_turn|max_tokens)$", result.stdout, re.M
    ), output


@pytest.mark.unit
def test_configuration_table_lists_every_setting() -> None:
    table = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(LORAPLEX_[A-Z0-9_]+)`", table))
    expected = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    assert documented == expected


@pytest.mark.unit
def test_makefile_has_the_readme_commands() -> None:
    makefile = (REPO / "Makefile").read_text()
    for target in ("dev:", "test:", "lint:"):
        assert re.search(rf"^{target}", makefile, re.M), target
    assert "torch==2.13.0" in makefile
    assert "make test" in (REPO / ".ci" / "run").read_text()


def _section_blocks(title: str) -> tuple[str, str]:
    section = README.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    shell = re.search(r"```bash\n(.*?)```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert shell is not None and python is not None
    return shell.group(1), python.group(1)


@pytest.mark.slow
def test_engine_tour_runs_as_written(tmp_path: Path) -> None:
    shell, python = _section_blocks("Engine")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    # The tour leaves its server running in the background; stop it when the block is done.
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shell + "kill %1\n"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"object":"chat.completion"' in result.stdout.replace(" ", "")
    ran = subprocess.run(
        [sys.executable, "-c", python], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.startswith("[")


@pytest.mark.slow
def test_adapter_tour_runs_as_written(tmp_path: Path) -> None:
    engine_shell, _ = _section_blocks("Engine")
    shell, python = _section_blocks("Adapters (LoRA)")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    setup = engine_shell.splitlines()[0] + "\n"  # the demo model the adapter tour builds on
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", setup + shell + "kill %1\n"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"model":"tuned"' in result.stdout.replace(" ", "")
    assert "tuned-2" in result.stdout
    ran = subprocess.run(
        [sys.executable, "-c", python], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.startswith("[")
