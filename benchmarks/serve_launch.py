"""Servers a benchmark starts for a run of its own: a loraplex engine (serve.py's `--launch-engine`), or any server
command that answers /healthz (the suite's peers)."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from report_data import cpu_family

logger = logging.getLogger(__name__)

MAX_LOGGED_CHARS = 400  # of a launched command line


class EngineLaunchError(RuntimeError):
    """The engine (or another launched server) exited or did not become healthy at start; the message names its log."""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first), else what the platform module knows (the architecture)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(threads: int) -> dict[str, Any]:
    """What a results file records of the machine: architecture, CPU model, the vector extensions torch's CPU
    kernels use, the instruction-set level the native operators run at here (kernels/native.py: the best level
    this CPU has, and the one loaded), whether the CPU has AMX tiles, a `kind` naming all three in a few words (the
    headline table's row), threads, torch."""
    import torch  # here, not at import: the load generators that import this module need no torch

    from loraplex.kernels import native

    features = native.cpu_features()
    levels = native.levels_for(platform.machine(), features)
    isa_level = levels[0].name if levels else platform.machine()
    amx = "amx_tile" in features
    model = cpu_model()
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_level": isa_level,
        "native_level": native.status().level,
        "amx": amx,
        "kind": cpu_kind(model, isa_level, amx=amx),
        "threads": threads,
        "torch": torch.__version__,
    }


def cpu_kind(model: str, isa_level: str, *, amx: bool) -> str:
    """A machine kind in a few words, e.g. "Intel Xeon, x86-64-v4-bf16, AMX": the CPU's vendor and family, the
    level, AMX or not."""
    return f"{cpu_family(model)}, {isa_level}, {'AMX' if amx else 'no AMX'}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def launched_engine(
    model_dir: Path,
    loras: Sequence[str] = (),
    *,
    served_model_name: str | None = None,
    engine_args: Sequence[str] = (),
    startup_timeout_s: float = 300.0,
) -> Iterator[str]:
    """`loraplex engine serve --model model_dir` (with `--lora NAME=PATH` for each of `loras`) on a free local port;
    yields its base URL once /healthz answers 200 and stops it (SIGTERM, then SIGKILL) on exit."""
    port = free_port()
    cli = Path(sys.executable).with_name("loraplex")
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "loraplex.platform.cli"]
    command += ["engine", "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    for lora in loras:
        command += ["--lora", lora]
    if served_model_name is not None:
        command += ["--served-model-name", served_model_name]
    command += list(engine_args)
    with launched_server(command, port, name="engine", startup_timeout_s=startup_timeout_s) as url:
        yield url


@contextlib.contextmanager
def launched_server(
    command: Sequence[str], port: int, *, name: str = "server", startup_timeout_s: float = 300.0
) -> Iterator[str]:
    """Run `command`, a server that listens on 127.0.0.1:`port` (the engine, or a peer such as
    benchmarks/naive_server.py); yields its base URL once /healthz answers 200 and stops it (SIGTERM, then SIGKILL)
    on exit. Its output goes to a temporary log, kept and named in the error when it fails to start."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+b", prefix=f"loraplex-{name}-", suffix=".log", delete=False) as log:
        shown = shlex.join(command)
        if len(shown) > MAX_LOGGED_CHARS:  # thousands of --lora flags
            shown = f"{shown[:MAX_LOGGED_CHARS]} ... ({len(command)} arguments)"
        logger.info("starting %s (log: %s)", shown, log.name)
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if process.poll() is not None:
                    raise EngineLaunchError(f"the {name} exited with {process.returncode} at start; see {log.name}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise EngineLaunchError(
                        f"the {name} did not answer /healthz in {startup_timeout_s:g} s; see {log.name}"
                    )
                time.sleep(0.25)
            logger.info("%s ready at %s", name, url)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    os.unlink(log.name)
