"""The topic sections of docs/benchmarks.md, one part per results file: what was measured, its figures, its plot.

A part renders from its results file (and may read others through `Results`); it raises `KeyError` and the like
when the file lacks what it needs, and benchmarks/report.py then leaves the part out with a line that names the
command writing the file. The suite's parts (the serving sweeps) are in report_suite.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import report_platform
import report_plots
import report_protocols
import report_suite
from report_data import PYTHON, Results, machine_kind, mib, ms, num, pct, table, writes, x
from report_plots import Plots

Render = Callable[[dict[str, Any], Results, Plots], list[str]]


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    file: str  # the results file it reads (its stem)
    render: Render


@dataclasses.dataclass(frozen=True, slots=True)
class Section:
    title: str
    parts: tuple[Part, ...]


def _model_words(parameters: float, hidden: int, layers: int) -> str:
    return f"a random Llama of {parameters / 1e6:.1f}M parameters (hidden {hidden}, {layers} layers)"


FAMILIES = ("qwen3", "gemma3", "phi3")
FAMILY_RUNS = tuple(f"engine_throughput_{family}" for family in FAMILIES)


def engine(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    model, workload = doc["model"], doc["workload"]
    words = _model_words(model["parameters"], model["hidden"], model["layers"])
    lines = [
        f"{workload['requests']} requests submitted at once to {words}"
        f", {num(workload['prompt_tokens'])} prompt and {num(workload['useful_output_tokens'])} output tokens in all"
        " (`ignore_eos`), greedy; against transformers' `generate` in static batches, its best batch size kept. The"
        " compute limit is the workload's FLOPs over the rate torch reaches on a 2048² matmul in the same run.",
        "",
    ]
    rows = []
    # A family's ratio is over Llama's measured on the same kind of machine (the last of each kind is kept).
    llama_ratios = {kind: run.get("loraplex_over_transformers") for kind, run in results.kinds("engine_throughput")}
    family_ratios: list[str] = []
    for name in ("engine_throughput", "engine_throughput_bfloat16", *FAMILY_RUNS):
        run = doc if name == "engine_throughput" else results.get(name)
        if run is None or run.get("transformers") is None:
            continue
        transformers = run["transformers"]
        family, kind = run["model"].get("family", "llama"), machine_kind(run)
        if family != "llama" and (llama_ratio := llama_ratios.get(kind)):
            family_ratios.append(f"{family} {run['loraplex_over_transformers'] / llama_ratio:.2f} ({kind})")
        rows.append(
            [
                f"{family}, {run['model']['dtype']}",
                num(run["loraplex"]["tokens_per_s"]),
                f"{num(transformers['best_tokens_per_s'])} (batch {transformers['best_batch_size']})",
                f"**{x(run['loraplex_over_transformers'])}**",
                f"{run['loraplex_fraction_of_limit']:.2f}",
                kind,
            ]
        )
    header = ["model, weights", "loraplex tok/s", "transformers tok/s (best batch)", "loraplex / transformers"]
    lines += table([*header, "fraction of the compute limit", "machine"], rows)
    if family_ratios:
        lines += [
            "",
            "Other families: random checkpoints of this shape written by transformers; their ratio over Llama's on "
            "the same kind of machine: "
            + ", ".join(family_ratios)
            + f" (`{PYTHON} benchmarks/engine_throughput.py --family <family> --batch-sizes 32`).",
        ]
    runs = doc.get("runs", {}).get("loraplex_tokens_per_s")
    if runs and len(runs) > 1:
        lines += ["", f"float32: the best of {len(runs)} alternating runs of each side (all in the results file)."]
    lines += ["", writes("engine_throughput") + ";", writes("engine_throughput_bfloat16") + "."]
    return lines


def pairs_words(doc: dict[str, Any]) -> str:
    """The median LoRA / base ratio over a lora_throughput run's alternating pairs, in words; "" with one pair."""
    median = doc.get("lora_over_base_median_of_pairs")
    num_pairs = len(doc.get("pairs", []))
    return f"median of {num_pairs} alternating pairs: {median:.2f}" if median is not None and num_pairs > 1 else ""


def lora(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    adapters = doc["adapters"]
    ranks = adapters["ranks"]
    by_rank = " / ".join(f"{count}" for count in ranks.values())
    peft = doc.get("peft")  # None: run with --skip-peft
    lines = [
        f"**Offline, against peft**: the offline batch spread over {adapters['count']} adapters of ranks"
        f" {' / '.join(ranks)} ({by_rank} adapters) on all linear layers, each request's adapter drawn with Zipf"
        f" popularity ({adapters['distinct_adapters_in_trace']} distinct in the batch); against loraplex on the same"
        " batch without adapters, and peft's mixed-adapter `generate(adapter_names=...)` in static batches.",
        "",
    ]
    rows = [
        ["loraplex, each request its adapter", num(doc["loraplex_lora"]["tokens_per_s"])],
        ["loraplex, base model only", num(doc["loraplex_base_only"]["tokens_per_s"])],
    ]
    if peft is not None:
        rows.append([f"peft, best batch ({peft['best_batch_size']})", num(peft["best_tokens_per_s"])])
    lines += table(["", "output tok/s"], rows)
    pairs = f" ({words})" if (words := pairs_words(doc)) else ""
    versus_peft = f"loraplex / peft: **{x(doc['lora_over_peft'])}**; " if peft is not None else ""
    lines += [
        "",
        f"{versus_peft}with adapters / base only: **{doc['lora_over_base']:.2f}**{pairs}. On a CPU LoRA is bound by"
        " reading adapter weights in many small matmuls (docs/decisions/0025-benchmark-investigations.md).",
        "",
        writes("lora_throughput") + ".",
    ]
    return lines


def residency(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    pool = doc["residency"]
    pages = " / ".join(str(p) for p in pool["pages_by_rank"].values())
    ranks = " / ".join(pool["pages_by_rank"])
    return [
        f"The multi-LoRA benchmark's {doc['adapters']['count']} adapters, most popular first, in a"
        f" {mib(pool['pool_bytes'])} pool: **{pool['resident_rank_proportional']}** fit with pages in proportion to"
        f" rank ({pages} pages for ranks {ranks}), **{pool['resident_padded_to_max_rank']}** if every adapter took"
        f" the largest rank's pages ({writes('lora_throughput')}).",
    ]


def prefix_cache(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    trace = doc["trace"]
    lines = [
        f"**Multi-turn chat in the engine**: {trace['tenants']} tenants, each with its own"
        f" {trace['system_prompt_tokens']}-token system prompt and cache salt, {trace['conversations']} conversations;"
        " every turn resends the whole history plus a new question, as chat clients do. *chat*: conversations start"
        " apart and users pause between turns; *burst*: all at once, no pauses (a stress case). The same trace with"
        " the prefix cache and without it; tenants' bills at cached input"
        f" {doc['prices_per_mtok_usd']['cached_input']} against input {doc['prices_per_mtok_usd']['input']} USD per"
        " 1M tokens.",
        "",
    ]
    rows = []
    for pattern in ("chat", "burst"):
        run = doc[pattern]
        cache, none = run["with_prefix_cache"], run["without_prefix_cache"]
        rows.append(
            [
                pattern,
                f"{num(cache['prompt_tokens'])} ({cache['turns']} turns)",
                f"{cache['cached_fraction']:.2f}",
                f"{ms(cache['ttft_mean_s'] * 1000)} / {ms(none['ttft_mean_s'] * 1000)}",
                f"**{run['ttft_ratio_mean']:.2f}**",
                f"{ms(cache['ttft_p50_s'] * 1000)} / {ms(none['ttft_p50_s'] * 1000)}",
                f"{cache['seconds']:.1f} / {none['seconds']:.1f} s",
                f"{pct(run['tenant_saving_fraction'])} less",
            ]
        )
    header = ["pattern", "prompt tokens", "from cache", "mean TTFT, cache / none", "ratio", "p50 TTFT"]
    lines += table([*header, "wall time", "tenants pay"], rows)
    return [*lines, "", writes("prefix_cache") + "."]


def _weights(mode: dict[str, Any], int8_activations: bool = False) -> tuple[str, str]:
    activations = {"float32": "float32", "bfloat16": "bf16", "float16": "fp16"}.get(mode["dtype"], mode["dtype"])
    if mode["quantization"] in ("int8", "int4") and int8_activations:  # fp8 is weight-only
        activations = f"int8 per token (from {activations})"
    return mode["quantization"] or activations, activations


def quant_quality(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    modes = doc["modes"]
    bf16_bytes = modes["bfloat16"]["projection_bytes"]
    rows = []
    for mode in modes.values():
        weights, activations = _weights(mode)
        rows.append(
            [
                weights,
                activations,
                f"{mode['perplexity']:.3f}",
                f"{mode['top1_agreement_vs_float32']:.3f}",
                f"{mode['cosine_vs_float32']:.7f}",
                f"{mode['projection_bytes'] / bf16_bytes:.3f}",
            ]
        )
    lines = [
        f"**Quality**: the demo model's perplexity on its own corpus ({doc['windows']} windows of"
        f" {doc['window_tokens']} tokens), and how often its next-token choice agrees with float32's.",
        "",
    ]
    lines += table(
        ["weights", "activations", "perplexity", "top-1 agreement", "logits' cosine", "projection bytes / bf16"], rows
    )
    return [*lines, "", writes("quant_quality") + "."]


def _share(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"  # the bf16 mode, the reference, was not run


def quant_throughput(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    modes = doc["modes"]
    integer = bool(doc.get("int8_activations"))
    unquantized = {m["dtype"]: m["tokens_per_s"] for m in modes.values() if m["quantization"] is None}
    rows = []
    for mode in modes.values():
        weights, activations = _weights(mode, integer)
        runs = ", ".join(num(r) for r in mode.get("tokens_per_s_runs", []))
        # A bf16 checkpoint's bf16 tensors stay backed by the file's mapped pages: their RSS is not comparable.
        load = mib(mode["load_peak_rss_bytes"]) if mode["dtype"] == "float32" else "—"
        rows.append(
            [
                weights,
                activations,
                f"{num(mode['tokens_per_s'])} ({runs})" if runs else num(mode["tokens_per_s"]),
                x(mode["tokens_per_s"] / unquantized[mode["dtype"]]),
                _share(mode.get("weight_bytes_over_bf16"), 2),
                _share(mode.get("projection_bytes_over_bf16"), 3),
                load,
            ]
        )
    lines = [
        f"**Speed and memory with LoRA active**: the multi-LoRA batch ({doc['workload']['requests']} requests,"
        f" {doc['adapters']['distinct_in_trace']} adapters in use) per weight mode, the best of the runs listed;"
        " the checkpoint is written in bf16.",
        "",
    ]
    header = ["weights", "activations", "tok/s (runs)", "vs unquantized, same activations", "weight bytes / bf16"]
    lines += table([*header, "projection bytes / bf16", "peak RSS while loading"], rows)
    if integer:
        why = (
            "This CPU multiplies int8 natively (VNNI or AMX), so int8 and int4 round each quantized matmul's input to"
            " 8 bits per token and multiply in integers (int4 requantized to int8 rows per call); the logits move a"
            " little more than weight-only"
            " (docs/decisions/0039-int8-activations-where-the-cpu-has-int8-dot-products.md)."
        )
    else:
        why = (
            "On a CPU without int8 dot products (VNNI, AMX), quantized weights buy memory (more adapters and KV pages"
            " beside the base model), not speed: the CPU path widens each weight tile to float32 before its matmul."
        )
    lines += [
        "",
        f"{why} An untied lm_head is int8 in both modes; embeddings stay in the activations' dtype, so this small"
        f" model's whole-weight ratios are well above its projections'. {writes('quant_throughput')}.",
    ]
    if "bfloat16" in unquantized and unquantized["bfloat16"] < unquantized.get("float32", 0.0):
        lines[-1] += (
            " Here bf16 ran slower than float32 (docs/decisions/0028-cpu-quantized-matmul-findings.md has the"
            " measurements behind that on CPUs without bf16 instructions)."
        )
    return lines


METHOD_WORDS = {"ngram": "n-gram", "draft": "draft model"}


def speculative(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    rows = doc["rows"]
    lines = [
        f"{doc['model']}, greedy, {doc['max_tokens']} tokens out. *copy*: the answer repeats its prompt (edits,"
        " summaries); *chat*: first turns. n-gram prompt lookup and a one-layer draft model against no speculation,"
        f" the runs alternating; a ratio is the median over {doc['repeats']} repeats of a run over the run without"
        " speculation beside it. *A/A*: a second engine without speculation (this machine's noise). Output is the"
        " same token for token.",
        "",
    ]
    table_rows = []
    for row in rows:
        acceptance = row["ngram_acceptance"]
        table_rows.append(
            [
                row["workload"],
                str(row["concurrency"]),
                num(row["off_tokens_per_s"]),
                x(row["off_again_vs_off"]),
                f"**{x(row['ngram_vs_off'])}**",
                " / ".join(f"{a['acceptance_rate']:.2f}" for a in acceptance.values()),
                f"**{x(row['draft_vs_off'])}**",
            ]
        )
    header = ["workload", "at once", "off tok/s", "A/A", "n-gram / off", "n-gram acceptance (base / adapter)"]
    lines += table([*header, "draft / off"], table_rows)
    concurrency = sorted({row["concurrency"] for row in rows})
    ratios: dict[str, list[float]] = {}
    for method in ("ngram", "draft"):
        for workload in ("copy", "chat"):
            by_concurrency = {r["concurrency"]: r[f"{method}_vs_off"] for r in rows if r["workload"] == workload}
            ratios[f"{METHOD_WORDS[method]}, {workload}"] = [by_concurrency[c] for c in concurrency]
    noise = [r["off_again_vs_off"] for r in rows]
    figure = report_plots.speculative(concurrency, ratios, noise)
    lines += ["", plots.save("speculative", figure, "speculative decoding: speed-up against concurrency")]
    lines += [
        "",
        "n-gram lookup pays most when few requests decode at once; the load-adaptive policy stops speculating as the"
        " batch fills. The draft model does not pay on this CPU and its gate keeps it mostly off"
        f" (docs/decisions/0031-draft-model-proposer.md). {writes('speculative')}.",
    ]
    return lines


def structured_output(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    best = doc["tokens_per_s"]["best"]
    runs = doc["tokens_per_s"]["runs"]
    requests = doc["workload"]["requests"]
    rows = []
    for count, tokens_per_s in best.items():
        run_figures = " / ".join(num(r["tokens_per_s"]) for r in runs.get(count, []))
        cost = doc["cost_vs_unconstrained"].get(count)
        rows.append(
            [
                f"{count} of {requests}",
                f"{num(tokens_per_s)} ({run_figures})",
                "—" if cost is None else f"**{pct(-cost, signed=True)}**",
                pct(doc["mask_share_of_time"][count]),
            ]
        )
    compile_times = doc["compile"]
    lines = [
        f"The offline batch with some of its {requests} requests under a JSON schema they cannot finish within"
        " `max_tokens`, so every constrained row is masked at every step and the runs compare like for like.",
        "",
    ]
    lines += table(["requests under the schema", "best tok/s (runs)", "throughput", "masks' share of the time"], rows)
    lines += [
        "",
        f"Compiling a schema with nested objects, arrays, enums, bounds, anyOf and a pattern:"
        f" {ms(compile_times['schema_cold_s'] * 1000)} cold, {compile_times['schema_cached_s'] * 1000:.2f} ms"
        f" cached; an engine's first grammar also builds the vocabulary's tables once"
        f" ({compile_times['compiler_setup_s']:.2f} s). {writes('structured_output')}.",
    ]
    return lines


def fairness(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    load, medians, runs = doc["load"], doc["medians"], doc["runs"]
    alone = runs["b_alone"]
    lines = [
        f"Tenant A floods one engine ({load['a_concurrency']} concurrent requests of {load['a_prompt']} prompt"
        f" tokens, {load['a_output']} out); tenant B sends a short request every {load['b_interval_s']} s."
        f" *fcfs*: first come, first served (vLLM's default); *vtc*: loraplex's default fair policy, one fairness"
        f" key per tenant. Medians of {doc['repeats']} alternating runs of {load['duration_s']:.0f} s.",
        "",
    ]
    rows = []
    for mode in ("fcfs", "vtc"):
        median = medians[mode]
        share = median.get("b_share", runs[mode][0]["share"]["B"] if runs[mode] else 0.0)
        rows.append(
            [
                mode,
                f"{median['b_ttft_p50_s']:.2f} s",
                f"{median['b_ttft_p95_s']:.2f} s",
                f"{share:.3f}",
                num(median["tokens_per_s"]),
            ]
        )
    rows.append(["B alone", f"{alone['b_ttft_p50_s']:.3f} s", f"{alone['b_ttft_p95_s']:.3f} s", "1", "—"])
    lines += table(["policy", "B's TTFT p50", "B's TTFT p95", "B's share of tokens", "tokens/s"], rows)
    lines += [
        "",
        f"B's p95 over its time alone: **{doc['b_p95_ttft_vtc_over_alone']:.1f}x** under VTC,"
        f" {doc['b_p95_ttft_fcfs_over_alone']:.0f}x under FCFS; throughput VTC / FCFS"
        f" **{x(doc['throughput_vtc_over_fcfs'])}**. {_in_flight(runs['vtc'])} {writes('fairness')}.",
    ]
    return lines


def _in_flight(vtc_runs: list[dict[str, Any]]) -> str:
    """What B waits for under VTC: the step in flight, or (interleaved steps, decision 0053) one of its layers."""
    counted = [r for r in vtc_runs if "interleaved_steps" in r]
    if not counted:  # measured before interleaved steps
        return (
            "On a CPU a step costs in proportion to its tokens, so B waits for the step in flight; smaller steps"
            " (`--max-num-batched-tokens`) trade throughput for B's latency."
        )
    taken = sum(r["interleaved_steps"] for r in counted)
    sent = sum(r["b_requests"] for r in counted)
    return (
        f"B's requests start between two layers of the flood's step in flight, in a short step of their own"
        f" (interleaved steps, decision 0053: {taken} such steps for {sent} requests of B), so B waits for one"
        " layer of it, not the whole step."
    )


def reasoning(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    rows = [
        [
            tier,
            str(t["budget"]),
            f"{t['mean_reasoning_tokens']:.1f} / {t['max_reasoning_tokens']}",
            f"{t['rows_at_budget']} of {t['rows']}",
            f"{t['mean_answer_tokens']:.1f}",
            f"{t['usd_per_1k_requests']:.4f}",
        ]
        for tier, t in doc["tiers"].items()
    ]
    lines = [
        "What each effort tier spends on the demo model's `think` adapter (the demo budgets; reasoning tokens include"
        " the markers and any forced closing text), billed at the README tour's prices:",
        "",
    ]
    header = ["tier", "budget", "reasoning tokens (mean / max)", "cut at the budget", "answer tokens (mean)"]
    lines += table([*header, "USD per 1k requests"], rows)
    overhead = doc["overhead"]
    ratio = overhead["ratio_to_off"]
    lines += [
        "",
        f"Following think blocks in the engine ({overhead['rows']} requests at once, {overhead['max_tokens']} tokens"
        f" out): **{x(ratio['followed'])}** of the throughput without a parser, **{x(ratio['budget_64'])}** with a"
        f" budget of 64 ({num(overhead['tokens_per_s']['off'])} tok/s without), within this machine's noise."
        f" {writes('reasoning')}.",
    ]
    return lines


def tensor_parallel_runs(doc: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """The runs by (tensor_parallel_size, threads per rank)."""
    return {(run["tensor_parallel_size"], run["threads_per_rank"]): run for run in doc["runs"]}


def tensor_parallel(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    model = doc["model"]
    runs = sorted(tensor_parallel_runs(doc).values(), key=lambda r: (r["tensor_parallel_size"], -r["threads_per_rank"]))
    batches = [step["batch"] for step in runs[0]["decode"]]
    rows = [
        [
            f"TP={run['tensor_parallel_size']}, {run['threads_per_rank']} "
            + ("threads" if run["threads_per_rank"] > 1 else "thread")
            + " per rank",
            *[ms(step["step_ms"]) for step in run["decode"]],
            ms(run["prefill"]["step_ms"]),
        ]
        for run in runs
    ]
    split = next(run for run in runs if run["tensor_parallel_size"] > 1)
    step = split["decode"][0]
    per_token = split["prefill"]["all_reduce_bytes_per_token"]
    hidden_bytes = doc["expected_all_reduce_bytes_per_token"] / (2 * model["num_layers"] + 1)
    lines = [
        f"The benchmark model ({model['num_layers']} layers, hidden {model['hidden_size']}, {model['dtype']}) split"
        " over ranks that are processes of this machine, "
        + ("joined by gloo" if doc["device"] == "cpu" else f"one GPU each ({doc['device']}), joined by NCCL")
        + ". Decode step time by batch,"
        f" and one prefill of {split['prefill']['tokens']} tokens:",
        "",
    ]
    lines += table(["engine", *[f"decode, batch {b}" for b in batches], "prefill"], rows)
    lines += [
        "",
        f"Per rank the collectives move **{num(per_token)} bytes per token** all-reduced"
        f" ({per_token / hidden_bytes:.0f} hidden vectors: after each layer's o and down projections and the"
        f" embedding) and {num(step['gather_bytes_per_step'])} bytes of logits per sampling row. On a CPU each"
        " collective costs a fixed latency, so a small batch runs slower split than whole (decision 0040)."
        f" {writes('tensor_parallel')}.",
    ]
    return lines


def kv_transfer(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    model = doc["model"]
    rows = [
        [
            num(r["prompt_tokens"]),
            ms(1000 * r["recompute_s"]),
            ms(1000 * r["transfer_s"]),
            ms(1000 * r["fetch_s"]),
            x(r["recompute_s"] / r["transfer_s"]),
        ]
        for r in doc["prefill_decode"]
    ]
    lines = [
        f"Two engine processes of the benchmark model ({model['dtype']}), one thread each. K/V is"
        f" {num(doc['kv_bytes_per_token'])} bytes per prompt token ({num(doc['prefill_decode'][0]['bytes_per_token'])}"
        " on the wire). A decode from a prefill engine's blocks against computing the prompt, median of"
        f" {doc['repeats']}:",
        "",
    ]
    lines += table(["prompt tokens", "recompute", "from the prefill's KV", "of which the fetch", "speed-up"], rows)
    turns = [
        [
            num(t["history_tokens"]),
            ms(1000 * t["ttft_recompute_s"]),
            ms(1000 * t["ttft_prefix_pull_s"]),
            x(t["ttft_recompute_s"] / t["ttft_prefix_pull_s"]),
        ]
        for t in doc["chat_turns"]
    ]
    lines += [
        "",
        f"A chat turn (history and a {doc['chat_turns'][0]['question_tokens']}-token question) that moves replica:"
        " time to first token with the history pulled from the first replica, against recomputed:",
        "",
    ]
    lines += table(["history tokens", "TTFT, recompute", "TTFT, prefix pulled", "speed-up"], turns)
    lines += ["", f"Decision 0043 says how blocks travel and are checked. {writes('kv_transfer')}."]
    return lines


def sliding_window_memory(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    rows = []
    for name, shape in doc["shapes"].items():
        at = {point["tokens"]: point for point in shape["at"]}
        rows.append(
            [
                f"{name} ({shape['layers']} layers, window {num(shape['window'])})",
                f"**{at[8192]['held_over_full']:.3f}**",
                f"{at[8192]['bound_over_full']:.3f}",
                f"{at[32768]['held_over_full']:.3f}",
            ]
        )
    probe = doc["engine"]
    lines = [
        "KV one Gemma 3 sequence (5 sliding layers : 1 global) holds once prefilled, over full attention's, from the"
        " engine's page books; the bound holds exactly each window.",
        "",
    ]
    lines += table(["shape", "8k tokens", "bound at 8k", "32k tokens"], rows)
    lines += [
        "",
        f"A real engine (random 6-layer Gemma 3) holds {probe['held_over_full']:.3f} of its windowless pages at"
        f" {num(probe['tokens'])} tokens. {writes('sliding_window_memory')}.",
    ]
    return lines


def moe(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    rows = [
        [
            f"{shape['experts']} experts of {shape['expert_intermediate']}, top-{shape['top_k']}",
            f"{shape['loraplex']['tokens_per_s']:.0f}",
            f"**{x(shape['over_transformers'])}** ({shape['transformers']['best_tokens_per_s']:.0f})",
            f"**{shape['lora_over_base']:.2f}** ({shape['loraplex_lora']['tokens_per_s']:.0f})",
            f"{shape['over_dense']:.2f}",
        ]
        for shape in doc["shapes"].values()
    ]
    dense, adapters = doc["dense"]["tokens_per_s"], doc["adapters"]
    lines = [
        f"Random Qwen3-MoE checkpoints with the offline benchmark's attention and vocabulary,"
        f" {doc['workload']['requests']} of its requests, useful tokens/s; each shape's active MLP per token equals"
        f" the dense model's ({dense:.0f} tok/s for the dense Qwen3 of that shape). LoRA: {adapters['count']}"
        f" adapters on {adapters['targets']} (peft's target_parameters), Zipf popularity.",
        "",
    ]
    lines += table(["experts", "loraplex tok/s", "over transformers", "LoRA / base", "MoE / dense"], rows)
    lines += [
        "",
        "At these batch sizes a decode step touches nearly every expert, so an MoE layer reads all its experts'"
        " weights where the dense model reads one MLP: MoE / dense is about the ratio of bytes read."
        f" {writes('moe_throughput')}.",
    ]
    return lines


SECTIONS: tuple[Section, ...] = (
    Section("Serving under load", (Part("suite", report_suite.headline), Part("suite", report_suite.rate))),
    Section("Offline throughput", (Part("engine_throughput", engine),)),
    Section("Mixture-of-experts bases", (Part("moe_throughput", moe),)),
    Section("Many adapters", (Part("suite", report_suite.adapters), Part("lora_throughput", lora))),
    Section("Adapter pool", (Part("suite", report_suite.pool_budget), Part("lora_throughput", residency))),
    Section("Prefix cache", (Part("suite", report_suite.prefix_cache), Part("prefix_cache", prefix_cache))),
    Section("Sliding windows", (Part("sliding_window_memory", sliding_window_memory),)),
    Section("Quantized weights", (Part("quant_quality", quant_quality), Part("quant_throughput", quant_throughput))),
    Section("Speculative decoding", (Part("speculative", speculative),)),
    Section("Structured outputs", (Part("structured_output", structured_output),)),
    Section("Fair share under a flood", (Part("fairness", fairness),)),
    Section("Reasoning effort tiers", (Part("reasoning", reasoning),)),
    Section("What the platform adds per request", (Part("platform_overhead", report_platform.platform_overhead),)),
    Section("Tensor parallelism", (Part("tensor_parallel", tensor_parallel),)),
    Section("KV transfer between engines", (Part("kv_transfer", kv_transfer),)),
    Section("Agent protocols", (Part("protocol_overhead", report_protocols.protocol_overhead),)),
)
