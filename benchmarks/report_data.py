"""What benchmarks/report.py reads: the results files, where each came from, and how a figure is written on the page.

A results file is one benchmark's JSON in benchmarks/results/, named by the script that writes it. Sections of the
page read the parsed documents through `Results.get`; a file that is missing or does not parse reads as None, and a
section that finds a key missing raises `KeyError` (or `TypeError`, `IndexError` where a value has another shape),
which the page turns into one line naming the command that writes the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# What a section may raise when its results file has another shape than it expects: the section is left out.
SHAPE_ERRORS = (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError, AttributeError)

PYTHON = ".venv/bin/python"
MACHINES = "machines"  # results/machines/<kind>/<name>.json: the last result of each kind of machine


@dataclasses.dataclass(frozen=True, slots=True)
class Benchmark:
    command: str  # writes the results file, with the repeats its figures need
    what: str  # what it measures, in a few words


# Every results file the page reads, with the command that wrote it: for the ones `make bench` runs, its arguments
# (fewer repeats than the scripts' defaults, to fit in 20 minutes on 2 cores); for the others, their docstrings'.
BENCHMARKS: dict[str, Benchmark] = {
    "suite": Benchmark(f"{PYTHON} benchmarks/suite.py", "online serving: latency under load, adapters, pool, cache"),
    "engine_throughput": Benchmark(
        f"{PYTHON} benchmarks/engine_throughput.py --repeats 1 --batch-sizes 32,64",
        "offline throughput against transformers",
    ),
    "engine_throughput_bfloat16": Benchmark(
        f"{PYTHON} benchmarks/engine_throughput.py --dtype bfloat16", "the same in bfloat16"
    ),
    **{
        f"engine_throughput_{family}": Benchmark(
            f"{PYTHON} benchmarks/engine_throughput.py --family {family} --batch-sizes 32",
            f"the same on a random {family} checkpoint",
        )
        for family in ("qwen3", "gemma3", "phi3")
    },
    "moe_throughput": Benchmark(
        f"{PYTHON} benchmarks/moe_throughput.py", "mixture-of-experts bases: against transformers, expert LoRA, dense"
    ),
    "sliding_window_memory": Benchmark(
        f"{PYTHON} benchmarks/sliding_window_memory.py", "KV memory with sliding windows against full attention"
    ),
    "lora_throughput": Benchmark(
        f"{PYTHON} benchmarks/lora_throughput.py --repeats 1 --batch-sizes 64",
        "offline multi-LoRA throughput against peft",
    ),
    "quant_throughput": Benchmark(
        f"{PYTHON} benchmarks/quant_throughput.py --rounds 2 --requests 32 --modes float32,bfloat16,int8,int4,fp8",
        "quantized weights: speed and memory",
    ),
    "quant_quality": Benchmark(f"{PYTHON} benchmarks/quant_quality.py", "quantized weights: perplexity"),
    "prefix_cache": Benchmark(f"{PYTHON} benchmarks/prefix_cache.py", "prefix cache on a multi-turn chat trace"),
    "speculative": Benchmark(f"{PYTHON} benchmarks/speculative.py --repeats 7", "speculative decoding"),
    "structured_output": Benchmark(
        f"{PYTHON} benchmarks/structured_output.py --repeats 3", "cost of grammar-constrained output"
    ),
    "fairness": Benchmark(f"{PYTHON} benchmarks/fairness.py --duration 30 --repeats 3", "fair share under a flood"),
    "reasoning": Benchmark(f"{PYTHON} benchmarks/reasoning.py --repeats 9", "reasoning effort tiers"),
    "platform_overhead": Benchmark(
        f"{PYTHON} benchmarks/platform_overhead.py --setup all --requests 100", "what the platform adds per request"
    ),
    "tensor_parallel": Benchmark(
        f"{PYTHON} benchmarks/tensor_parallel.py", "tensor parallelism: bytes moved, step time TP=1 against TP=2"
    ),
    "kv_transfer": Benchmark(
        f"{PYTHON} benchmarks/kv_transfer.py", "KV blocks fetched from another engine against recomputed"
    ),
    "protocol_overhead": Benchmark(
        f"{PYTHON} benchmarks/protocol_overhead.py", "what the agent protocols add over chat completions"
    ),
}


def command(name: str) -> str:
    known = BENCHMARKS.get(name)
    return known.command if known is not None else f"{PYTHON} benchmarks/{name}.py"


def writes(name: str) -> str:
    """`command` → `file`, as the page says where a figure comes from."""
    return f"`{command(name)}` → `benchmarks/results/{name}.json`"


@dataclasses.dataclass(frozen=True, slots=True)
class Provenance:
    """Where a results file came from: its machine in words, and the commit and date it was measured at (from the
    file itself when it records them; otherwise the last commit that changed the file, or None outside git)."""

    machine: str
    commit: str | None
    date: str | None
    committed: bool  # False: the commit is the file's last in git, and the file has changed since (a new run)


class Results:
    """The parsed results files of one directory, read once each."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._documents: dict[str, dict[str, Any] | None] = {}

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def get(self, name: str) -> dict[str, Any] | None:
        """The document, or None when the file is missing, unreadable or not a JSON object."""
        if name not in self._documents:
            self._documents[name] = self._read(name)
        return self._documents[name]

    def _read(self, name: str) -> dict[str, Any] | None:
        path = self.path(name)
        return _read_document(path) if path.exists() else None

    def names(self) -> list[str]:
        """The results files present, by name."""
        return sorted(p.stem for p in self.directory.glob("*.json") if self.get(p.stem) is not None)

    def kinds(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        """(machine kind, document) of `name`: the results file itself first, then the last one kept of each other
        kind of machine (`machines/<kind>/<name>.json`, written by `keep`), by kind."""
        found: list[tuple[str, dict[str, Any]]] = []
        if (current := self.get(name)) is not None:
            found.append((machine_kind(current), current))
        kept = []
        for path in sorted((self.directory / MACHINES).glob(f"*/{name}.json")):
            document = _read_document(path)
            if document is not None and (kind := machine_kind(document)) not in (k for k, _ in found):
                kept.append((kind, document))
        return found + sorted(kept, key=lambda entry: entry[0])

    def keep(self, name: str) -> Path | None:
        """Keep the results file as its machine kind's last (`machines/<kind slug>/<name>.json`), where the file
        records its kind: the headline keeps a row per kind of machine measured. Returns the copy's path."""
        document = self.get(name)
        if document is None or not isinstance(document.get("machine"), dict) or not document["machine"].get("kind"):
            return None
        slug = re.sub(r"[^a-z0-9]+", "-", str(document["machine"]["kind"]).lower()).strip("-")
        target = self.directory / MACHINES / slug / f"{name}.json"
        text = self.path(name).read_text()
        if not target.exists() or target.read_text() != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return target

    def provenance(self, name: str) -> Provenance:
        document = self.get(name) or {}
        commit, date = document.get("commit"), document.get("date")
        if isinstance(date, str):
            date = date[:10]  # the day of an ISO timestamp
        committed = True
        if not commit:
            commit, date, committed = _git_last_commit(self.path(name))
        return Provenance(machine_words(document), commit, date, committed)


def machine_kind(document: dict[str, Any]) -> str:
    """The kind of machine a results file was measured on, as the headline names it: the `kind` recorded
    (benchmarks/serve_launch.py's machine()), else what older files recorded: the CPU's vendor and family and its
    SIMD level, saying that the level and AMX were not."""
    recorded = document.get("machine")
    machine: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    if kind := machine.get("kind"):
        return str(kind)
    cpu = machine.get("cpu_model") or machine.get("cpu") or (recorded if isinstance(recorded, str) else None)
    if not cpu:
        return "machine not recorded"
    family = cpu_family(str(cpu))
    capability = machine.get("cpu_capability") or document.get("cpu_capability")
    return f"{family}, {capability} (level and AMX not recorded)" if capability else f"{family} (level not recorded)"


def cpu_family(model: str) -> str:
    """The vendor and family of a CPU model name ("Intel Xeon", "AMD EPYC"): the rest of the name (model number,
    frequency, "(R)" marks) varies within a kind."""
    words = [w for w in model.replace("(R)", "").replace("(TM)", "").split() if w not in ("Processor", "CPU")]
    return " ".join(words[:2]) if words else "unknown CPU"


def _read_document(path: Path) -> dict[str, Any] | None:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("%s: not read (%s)", path, exc)
        return None
    if not isinstance(document, dict):
        logger.warning("%s: not a JSON object", path)
        return None
    return document


def machine_words(document: dict[str, Any]) -> str:
    """The machine a results file names, in a few words: CPU model or architecture, SIMD level, threads, torch."""
    recorded = document.get("machine")  # a dict in most files, the architecture's name in the kernel benchmarks'
    machine: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    cpu = machine.get("cpu_model") or machine.get("cpu") or machine.get("processor") or recorded
    parts = [cpu] if isinstance(cpu, str) and cpu else []
    if capability := machine.get("cpu_capability") or document.get("cpu_capability"):
        parts.append(str(capability))
    threads = machine.get("threads") or document.get("threads")
    if threads:
        parts.append(f"{threads} thread{'' if threads == 1 else 's'}")
    torch_version = machine.get("torch") or document.get("torch")
    if torch_version:
        parts.append(f"torch {torch_version}")
    return ", ".join(parts) or "not recorded"


def _git_last_commit(path: Path) -> tuple[str | None, str | None, bool]:
    """(short hash, date, unchanged since) of the last commit that changed `path`; Nones outside a git checkout."""
    try:
        logged = subprocess.run(
            ["git", "log", "-1", "--format=%h %cs", "--", path.name],
            cwd=path.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", path.name],
            cwd=path.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None, None, True
    if logged.returncode != 0 or not logged.stdout.strip():
        return None, None, True
    commit, _, date = logged.stdout.strip().partition(" ")
    return commit, date or None, not status.stdout.strip()


# Figures as the page writes them.


def x(value: float | None) -> str:
    """A ratio: 1.92x; None (a ratio over nothing: the other side produced no output) as a dash."""
    return "—" if value is None else f"{value:.2f}x"


def num(value: float, digits: int = 0) -> str:
    """A count or rate with thousands separators: 1,935 or 2.19."""
    return f"{value:,.{digits}f}"


def ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f} ms" if value < 100 else f"{value:,.0f} ms"


def pct(value: float, signed: bool = False) -> str:
    if signed and round(value * 100, 1) == 0:
        return "±0.0%"
    return f"{value * 100:+.1f}%" if signed else f"{value * 100:.1f}%"


def mib(num_bytes: float) -> str:
    value = num_bytes / 2**20
    return f"{value:,.0f} MiB" if value >= 100 else f"{value:.1f} MiB"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def latency(summary: dict[str, Any], metric: str, stat: str) -> float | None:
    """A latency of a serve summary (benchmarks/serve_stats.Summary as a dict), in ms; None when no request had it."""
    stats = summary[metric]
    return None if stats is None else float(stats[stat])
