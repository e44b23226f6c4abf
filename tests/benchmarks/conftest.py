"""The benchmarks are scripts that import their siblings (`import serve_trace`): their tests import them the same
way, with benchmarks/ on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
