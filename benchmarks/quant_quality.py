"""Quality of quantized base weights: perplexity of the demo model on its own text, per weight mode.

The text is the demo model's corpus as scripts/train_demo.py reads it (pydoc's help topics and the standard
library's module docstrings, each document as `<bos> blocks <eot>`, no upper-casing), one token stream; 64 windows
of 255 tokens (the model's context is 256) spread evenly over it. Every window runs through the engine's own step
path; perplexity is exp(mean negative log-likelihood) over the 64 x 254 next-token predictions. Also reports, per
mode, the mean cosine and top-1 agreement of its logits with float32's at those positions.

    .venv/bin/python benchmarks/quant_quality.py [--threads 2]

writes benchmarks/results/quant_quality.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.tools.demo import BOS_TOKEN, END_OF_TEXT_TOKEN
from loraplex.kernels.quant import int8_activations

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "quant_quality.json"
DEMO_MODEL = ROOT / "demo" / "model"
NUM_WINDOWS = 64
WINDOW = 255  # a prompt may not fill the whole 256-token context: one position stays for the sampled token

# (name, dtype: activations and unquantized weights, quantization)
MODES: list[tuple[str, str, str | None]] = [
    ("float32", "float32", None),
    ("bfloat16", "bfloat16", None),
    ("int8", "float32", "int8"),
    ("int4", "float32", "int4"),
    ("int8, bf16 activations", "bfloat16", "int8"),
    ("int4, bf16 activations", "bfloat16", "int4"),
]


def corpus_stream(llm: LLM) -> list[int]:
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_demo import load_documents

    tokenizer = llm.get_tokenizer()
    bos = tokenizer.encode(BOS_TOKEN, add_special_tokens=False)
    eot = tokenizer.encode(END_OF_TEXT_TOKEN, add_special_tokens=False)
    stream: list[int] = []
    for document in load_documents():
        stream += [*bos, *tokenizer.encode("\n\n".join(document.blocks()), add_special_tokens=False), *eot]
    return stream


def prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """float32 logits [len(prompt), vocab] at every prompt position, through the engine's step path."""
    core = llm.engine
    core.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=1))
    prepared = core.runner.prepare(core.scheduler.schedule())
    logits = core.model.compute_logits(core.model.forward(prepared.batch, core.runner.kv_caches))
    core.abort_request("probe")
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    results: dict[str, Any] = {"model": "demo/model", "windows": NUM_WINDOWS, "window_tokens": WINDOW, "modes": {}}
    # Whether int8 and int4 rounded activations to 8 bits per token (CPUs with VNNI or AMX; decision 0039).
    results["int8_activations"] = int8_activations()
    reference: torch.Tensor | None = None
    windows: list[list[int]] = []
    for name, dtype, quantization in MODES:
        llm = LLM(
            DEMO_MODEL,
            dtype=dtype,  # type: ignore[arg-type]
            quantization=quantization,  # type: ignore[arg-type]
            device="cpu",
            kv_budget=64 * 2**20,
            enable_prefix_caching=False,
            num_threads=args.threads,
        )
        if not windows:
            stream = corpus_stream(llm)
            step = (len(stream) - WINDOW) // (NUM_WINDOWS - 1)
            windows = [stream[i * step : i * step + WINDOW] for i in range(NUM_WINDOWS)]
            results["corpus_tokens"] = len(stream)
        started = time.perf_counter()
        nll, count, rows = 0.0, 0, []
        for window in windows:
            logits = prompt_logits(llm, window)
            rows.append(logits[:-1])
            targets = torch.tensor(window[1:])
            nll += float(F.cross_entropy(logits[:-1], targets, reduction="sum"))
            count += len(targets)
        logits_all = torch.cat(rows)
        if reference is None:
            reference = logits_all
        entry = {
            "dtype": dtype,
            "quantization": quantization,
            "perplexity": math.exp(nll / count),
            "predictions": count,
            "cosine_vs_float32": float(F.cosine_similarity(logits_all, reference, dim=-1).mean()),
            "top1_agreement_vs_float32": float((logits_all.argmax(-1) == reference.argmax(-1)).float().mean()),
            "weight_bytes": llm.engine.weight_bytes,
            "projection_bytes": llm.engine.model.projection_bytes(),
            "seconds": time.perf_counter() - started,
        }
        results["modes"][name] = entry
        print(f"{name:24s} ppl {entry['perplexity']:.3f}  top-1 {entry['top1_agreement_vs_float32']:.4f}", flush=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
