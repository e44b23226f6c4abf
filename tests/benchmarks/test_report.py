"""benchmarks/report.py: docs/benchmarks.md and its plots from the results files, whatever of them there are."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import report
import report_data
from report_data import BENCHMARKS
from serve import summary_document
from serve_stats import RequestRecord, Slo, summarize

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUITE_PLOTS = ("rate", "adapters", "pool_budget", "prefix_cache")


def summary(tokens_per_s: float, ttft_s: float, tpot_s: float, cached: int = 0) -> dict[str, Any]:
    """A serve summary as result files hold it, made by serve_stats and serve.py's own layout from ten requests: the
    fixture keeps the shape the suite's file has."""
    output_tokens = 64
    duration = 10 * output_tokens / tokens_per_s
    records = []
    for i in range(10):
        record = RequestRecord(conversation=i, turn=0, model="lora-0", scheduled_s=0.0, sent_s=0.0, ok=True)
        record.ttft_s = ttft_s * (1 + i / 10)
        record.e2e_s = record.ttft_s + tpot_s * (output_tokens - 1)
        record.prompt_tokens, record.output_tokens, record.cached_tokens = 100, output_tokens, cached
        records.append(record)
    return summary_document(summarize(records, duration, Slo(ttft_ms=1000, tpot_ms=200)))


def suite_document() -> dict[str, Any]:
    return {
        "machine": {"cpu": "x86_64", "cpu_model": "Test CPU 9000", "threads": 2, "torch": "2.13.0+cpu"},
        "commit": "abc1234",
        "date": "2026-12-04T10:00:00+00:00",
        "duration_s": 600.0,
        "quick": False,
        "models": {"small": {"parameters": 56_400_000, "hidden": 512, "layers": 8}, "large": None},
        "headline": [
            {
                "model": "small",
                "trace": {"num_requests": 200, "rate": 4.0, "num_adapters": 32},
                "loraplex": summary(400.0, 0.08, 0.03),
                "naive_online": summary(60.0, 2.5, 0.05),
                "peft_offline": {"best_batch_size": 64, "output_tokens_per_s": 120.0, "by_batch_size": {"64": 120.0}},
                "loraplex_over_naive": 400.0 / 60.0,
                "loraplex_over_peft_offline": 400.0 / 120.0,
            }
        ],
        "sweeps": {
            "adapters": [{"num_adapters": n, "summary": summary(400.0 - n, 0.08, 0.03 + n / 1000)} for n in (1, 8, 32)],
            "rank_mix": [
                {"ranks": ranks, "num_adapters": n, "summary": summary(380.0 - n, 0.08, 0.04)}
                for ranks in ("8", "8-64")
                for n in (8, 32)
            ],
            "rate": [{"rate": r, "summary": summary(100.0 * r, 0.05 * r, 0.02 * r)} for r in (1.0, 2.0, 4.0, 8.0)],
            "rate_capacity": {"concurrency": 8, "summary": summary(700.0, 0.4, 0.15)},
            "prefix_cache": [
                {"enabled": True, "summary": summary(300.0, 0.1, 0.03, cached=90)},
                {"enabled": False, "summary": summary(250.0, 0.5, 0.03)},
            ],
            "pool_budget": [
                {"budget_mib": b, "unified_resident": b // 8, "padded_resident": b // 16} for b in (64, 128, 256)
            ],
        },
        "stages_s": {"headline: small model": 200.0},
    }


def with_saturation(platform_overhead: dict[str, Any]) -> dict[str, Any]:
    """platform_overhead.json with the figures its newer runs add (throughput at saturation with CPU per unit, the
    platform's own work), whether or not the repository's file has them yet."""
    for setup in platform_overhead["setups"].values():
        setup["platform_work_p50_ms"] = 1.5
        setup["framework_p50_ms"] = 0.75
        setup["steps_p50_ms"] |= {"complete": 18.0, "_start": 0.9, "_answer": 16.5}  # the handler's spans
        cpu = {"platform": {"platform": 3.0, "engine": 2.5, "clients": 0.1}, "engine": {"platform": 0.0, "engine": 2.0}}
        setup["saturation"] = {
            "one_token": {
                "clients": 16,
                "seconds_per_window": 8.0,
                "unit": "requests_per_s",
                "platform": 45.0,
                "engine": 50.0,
                "ratio": 0.9,
                "cpu_ms_per_unit": cpu,
                "num_failed": 0,
                "rounds": [],
            },
            "chat": {
                "clients": 16,
                "seconds_per_window": 8.0,
                "unit": "tokens_per_s",
                "platform": 1950.0,
                "engine": 2000.0,
                "ratio": 0.97,
                "cpu_ms_per_unit": cpu,
                "num_failed": 0,
                "rounds": [],
            },
        }
        setup["steps_p50_ms"]["in_app"] = 20.0
    return platform_overhead


@pytest.fixture
def out(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "benchmarks"


def committed(name: str) -> str | None:
    """A results file as the last commit holds it (a benchmark running now may be rewriting the working copy), or
    the working copy outside a git checkout; None when there is neither."""
    shown = subprocess.run(
        ["git", "show", f"HEAD:benchmarks/results/{name}.json"], cwd=RESULTS, capture_output=True, text=True
    )
    if shown.returncode == 0:
        return shown.stdout
    path = RESULTS / f"{name}.json"
    return path.read_text() if path.exists() else None


def results_dir(tmp_path: Path, suite: dict[str, Any] | None) -> Path:
    """The repository's results files, plus a suite file when given."""
    directory = tmp_path / "results"
    directory.mkdir()
    for name in BENCHMARKS:
        if name != "suite" and (text := committed(name)) is not None:
            (directory / f"{name}.json").write_text(text)
    if suite is not None:
        (directory / "suite.json").write_text(json.dumps(suite))
    overhead = directory / "platform_overhead.json"
    overhead.write_text(json.dumps(with_saturation(json.loads(overhead.read_text()))))
    return directory


def headline_rows(page: str) -> list[str]:
    section = page.split("## Headline\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| comparison")]


def test_page_from_every_results_file_has_the_headline_table_and_plots(tmp_path: Path, out: tuple[Path, Path]) -> None:
    page_path, plots = out
    left_out = report.write_report(results_dir(tmp_path, suite_document()), page_path, plots)
    page = page_path.read_text()

    assert left_out == []
    assert page.startswith("<!-- Generated by benchmarks/report.py")
    assert "Regenerate: .venv/bin/python benchmarks/report.py" in page
    rows = headline_rows(page)
    assert any("naive online" in r and "**6.67x**" in r and "benchmarks/suite.py" in r for r in rows)
    assert any("transformers" in r and "benchmarks/engine_throughput.py" in r for r in rows)
    assert any("peft" in r and "benchmarks/lora_throughput.py" in r for r in rows)
    assert any("platform adds" in r and "benchmarks/platform_overhead.py" in r for r in rows)
    assert any(
        "at saturation" in r and "one-token requests, streamed chats" in r and "**0.90** / **0.97**" in r for r in rows
    )
    section = page.split("## What the platform adds per request\n", 1)[1].split("\n## ", 1)[0]
    assert "1.0 ms per request" in section  # embedded: its process's CPU less the engine's own (3.0 - 2.0)
    assert "of which the web framework" in section and "| 0.8 ms |" in section
    assert "closed loop, 8 clients" in page
    # The suite's machine and commit are the ones it records.
    assert re.search(
        r"\| `suite.json` \| .* \| Test CPU 9000, 2 threads, torch 2.13.0\+cpu \| abc1234 \(2026-12-04\) \|", page
    )

    for name in (*SUITE_PLOTS, "speculative"):
        png = plots / f"{name}.png"
        assert png.read_bytes().startswith(PNG_MAGIC), name
        assert 5_000 < png.stat().st_size < 200_000, name  # a real plot, and a small file
        assert f"](benchmarks/{name}.png)" in page  # linked relative to the page
    assert "# Benchmarks" in page and "(issue" not in page
    assert "## Not on this page" not in page


def test_without_any_results_the_page_names_the_commands_and_old_plots_go(
    tmp_path: Path, out: tuple[Path, Path]
) -> None:
    page_path, plots = out
    plots.mkdir(parents=True)
    (plots / "rate.png").write_bytes(PNG_MAGIC)  # from an earlier run whose results are gone
    empty = tmp_path / "nothing"

    left_out = report.write_report(empty, page_path, plots)
    page = " ".join(page_path.read_text().split())  # as read: lines folded anywhere

    assert "No results files: `make bench` measures them." in page
    assert "`.venv/bin/python benchmarks/suite.py` writes `benchmarks/results/suite.json`" in page
    assert "`.venv/bin/python benchmarks/engine_throughput.py --repeats 1 --batch-sizes 32,64` writes" in page
    assert any("benchmarks/suite.py" in line for line in left_out)
    assert list(plots.glob("*.png")) == []
    assert "![" not in page


def test_a_results_file_short_of_keys_loses_only_its_parts(tmp_path: Path, out: tuple[Path, Path]) -> None:
    page_path, plots = out
    suite = suite_document()
    del suite["sweeps"]["rate"]
    del suite["headline"][0]["naive_online"]
    directory = results_dir(tmp_path, suite)
    (directory / "fairness.json").write_text("{not json")
    (directory / "speculative.json").write_text(json.dumps({"rows": []}))

    left_out = report.write_report(directory, page_path, plots)
    page = page_path.read_text()

    assert not (plots / "rate.png").exists()
    assert (plots / "adapters.png").exists() and (plots / "pool_budget.png").exists()
    assert not (plots / "speculative.png").exists()
    assert "## Fair share under a flood" not in page
    assert "## Speculative decoding" not in page
    assert "## Many adapters" in page  # the suite's other parts, and the other files, still render
    section = page.split("## Not on this page\n", 1)[1]
    assert len(left_out) == sum(line.startswith("- ") for line in section.splitlines())
    not_here = " ".join(section.split())
    assert "Serving under load" in not_here and "the results file has no" in not_here
    assert "Fair share under a flood: no results file; `.venv/bin/python benchmarks/fairness.py" in not_here
    assert "Speculative decoding" in not_here


def test_paragraphs_fold_at_120_columns_and_never_open_a_block(tmp_path: Path, out: tuple[Path, Path]) -> None:
    page_path, plots = out
    report.write_report(results_dir(tmp_path, suite_document()), page_path, plots)
    lines = page_path.read_text().splitlines()
    prose = [line for line in lines if not line.startswith(("|", "!", "<"))]
    assert all(len(line) <= 120 or " " not in line.strip() for line in prose)
    # A paragraph's lines are full up to its last: no line broken early (text that had a newline of its own).
    assert all(len(line) > 60 for line, after in itertools.pairwise(prose) if line and after[:1].isalpha())
    folded = report.wrap(["word " * 23 + "- " + "word " * 30])
    assert all(not line.startswith("- ") for line in folded)
    assert " ".join(folded).split() == ("word " * 23 + "- " + "word " * 30).split()


def test_sweeps_a_partial_suite_run_left_empty_are_left_out(tmp_path: Path, out: tuple[Path, Path]) -> None:
    page_path, plots = out
    suite = suite_document()
    suite["headline"] = []
    suite["sweeps"] |= {"rate": [], "adapters": [], "rank_mix": []}  # as `suite.py --only prefix_cache,pool_budget`

    report.write_report(results_dir(tmp_path, suite), page_path, plots)
    page = " ".join(page_path.read_text().split())

    assert sorted(p.stem for p in plots.glob("*.png")) == ["pool_budget", "prefix_cache", "speculative"]
    assert "## Serving under load" not in page
    assert "the results file has no 'headline'" in page and "'sweeps.rate'" in page


def test_a_peer_that_served_nothing_shows_a_dash_not_a_ratio(tmp_path: Path, out: tuple[Path, Path]) -> None:
    page_path, plots = out
    suite = suite_document()
    entry = suite["headline"][0]
    failed = summarize([], 10.0, Slo(ttft_ms=1000, tpot_ms=200))
    entry["naive_online"] = summary_document(dataclasses.replace(failed, num_requests=200, num_errors=200))
    entry["loraplex_over_naive"] = None  # what suite_headline writes when the peer produced no tokens

    report.write_report(results_dir(tmp_path, suite), page_path, plots)
    page = page_path.read_text()

    assert any("naive online server" in r and "| **—** |" in r for r in headline_rows(page))
    assert "| naive online | 0 | 0.00 | — / — | — / — | 200 |" in page


def with_kind(document: dict[str, Any], kind: str, lora_over_base: float) -> dict[str, Any]:
    return {**document, "machine": {**(document.get("machine") or {}), "kind": kind}, "lora_over_base": lora_over_base}


def test_the_headline_keeps_a_row_per_kind_of_machine(tmp_path: Path, out: tuple[Path, Path]) -> None:
    page_path, plots = out
    directory = results_dir(tmp_path, suite_document())
    lora = json.loads((directory / "lora_throughput.json").read_text())
    (directory / "lora_throughput.json").write_text(
        json.dumps(with_kind(lora, "Intel Xeon, x86-64-v4-bf16, AMX", 0.61))
    )
    for slug, kind, ratio in [
        ("amd-epyc-x86-64-v4-bf16-no-amx", "AMD EPYC, x86-64-v4-bf16, no AMX", 0.87),
        ("intel-xeon-x86-64-v4-bf16-amx", "Intel Xeon, x86-64-v4-bf16, AMX", 0.5),  # older than the file itself
    ]:
        (directory / "machines" / slug).mkdir(parents=True)
        (directory / "machines" / slug / "lora_throughput.json").write_text(json.dumps(with_kind(lora, kind, ratio)))

    report.write_report(directory, page_path, plots)

    rows = [r for r in headline_rows(page_path.read_text()) if r.startswith("| with adapters / base model only")]
    assert len(rows) == 2
    assert "**0.61**" in rows[0] and "| Intel Xeon, x86-64-v4-bf16, AMX |" in rows[0]
    assert "**0.87**" in rows[1] and "| AMD EPYC, x86-64-v4-bf16, no AMX |" in rows[1]
    kept = json.loads((directory / "machines" / "intel-xeon-x86-64-v4-bf16-amx" / "lora_throughput.json").read_text())
    assert kept["lora_over_base"] == 0.61  # the new run replaced its kind's last


def test_a_file_without_a_recorded_kind_is_named_by_what_it_recorded() -> None:
    old = {"machine": {"cpu": "x86_64", "cpu_model": "AMD EPYC", "cpu_capability": "AVX512"}}
    assert report_data.machine_kind(old) == "AMD EPYC, AVX512 (level and AMX not recorded)"
    assert report_data.machine_kind({"machine": "x86_64"}) == "x86_64 (level not recorded)"
    assert report_data.machine_kind({}) == "machine not recorded"
    assert report_data.cpu_family("Intel(R) Xeon(R) Platinum 8488C") == "Intel Xeon"
