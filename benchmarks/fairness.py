"""Fair share under a flood: one tenant floods an engine, another sends short requests at a steady low rate.

Tenant A runs a closed loop of 48 concurrent long requests (1024-token prompts, 32 tokens out: as soon as one
ends the next is sent); tenant B sends a short request (32-token prompt, 8 tokens out) every 0.5 s. Both share one
engine (a random ~56M-parameter Llama on the CPU), in three runs with the same configuration:
- fcfs: the engine's `scheduling_policy="fcfs"`, first come, first served (vLLM's default);
- vtc: the default "fair" policy, each tenant its own fairness key (as the platform sends them): weighted VTC;
- b_alone: B's requests on an idle engine, the reference for B's latency.

Reported per run: B's time to first token (p50, p95, from submission), each tenant's share of the tokens computed
in the measured window (the engine's own books per fairness key: prompt tokens as their chunks run, generated
tokens as they come), the total tokens computed per second, and how many steps ran between two layers of another
(interleaved steps, docs/decisions/0053: B's newcomers during A's long prefill steps). A warms up for a few seconds
before B starts
and the window opens; A keeps flooding until every B request of the window has finished, so B's last requests see
the same load as its first.

    .venv/bin/python benchmarks/fairness.py [--duration 30] [--repeats 3] [--threads 2] [--max-num-batched-tokens 512]

writes benchmarks/results/fairness.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from serve_launch import machine

from loraplex.engine import SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_state import EngineState
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model

RESULTS = Path(__file__).parent / "results" / "fairness.json"


@dataclasses.dataclass(frozen=True)
class Load:
    a_concurrency: int = 48
    a_prompt: int = 1024
    a_output: int = 32
    b_interval_s: float = 0.5
    b_prompt: int = 32
    b_output: int = 8
    warmup_s: float = 4.0
    duration_s: float = 30.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


async def one_request(
    engine: AsyncEngine, key: str, prompt: list[int], params: SamplingParams, request_id: str
) -> float | None:
    """Run one request to its end; its time to first token."""
    sent = time.perf_counter()
    first: float | None = None
    async for output in engine.generate(prompt, params, request_id, fairness_key=key):
        if first is None and output.outputs[0].token_ids:
            first = time.perf_counter()
    return None if first is None else first - sent


async def run(model_dir: Path, load: Load, mode: str, seed: int = 0) -> dict[str, Any]:
    engine = await AsyncEngine.create(
        EngineConfig(
            model=model_dir,
            dtype="float32",
            device="cpu",
            kv_budget=3 * 2**30,
            max_model_len=2048,
            max_num_seqs=load.max_num_seqs,
            max_num_batched_tokens=load.max_num_batched_tokens,
            max_waiting_requests=None,
            max_waiting_tokens=None,
            scheduling_policy="fcfs" if mode == "fcfs" else "fair",
        )
    )
    rng = random.Random(seed)
    vocab = BENCHMARK_SPEC.vocab_size
    ids = iter(range(10**9))

    def tokens(count: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(count)]

    flooding = asyncio.Event()
    a_params = SamplingParams(temperature=0, max_tokens=load.a_output, ignore_eos=True)
    b_params = SamplingParams(temperature=0, max_tokens=load.b_output, ignore_eos=True)

    async def flood() -> None:
        while flooding.is_set():
            await one_request(engine, "A", tokens(load.a_prompt), a_params, f"a{next(ids)}")

    try:
        async for _ in engine.generate([5] * 300, SamplingParams(max_tokens=4, ignore_eos=True), "warm-up"):
            pass
        flooders: list[asyncio.Task[None]] = []
        if mode != "b_alone":
            flooding.set()
            flooders = [asyncio.create_task(flood()) for _ in range(load.a_concurrency)]
            await asyncio.sleep(load.warmup_s)
        window_end = time.perf_counter() + load.duration_s
        state_at_start = engine.state()
        b_requests: list[asyncio.Task[float | None]] = []
        while time.perf_counter() < window_end:
            prompt = tokens(load.b_prompt)
            b_requests.append(asyncio.create_task(one_request(engine, "B", prompt, b_params, f"b{next(ids)}")))
            await asyncio.sleep(load.b_interval_s)
        state_at_end = engine.state()
        ttfts = [t for t in await asyncio.gather(*b_requests) if t is not None]
        drained = time.perf_counter()
        flooding.clear()
        for task in flooders:
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)
    finally:
        await engine.shutdown()
    window = load.duration_s
    served = {tenant: _served(state_at_end, tenant) - _served(state_at_start, tenant) for tenant in ("A", "B")}
    total = sum(served.values())
    ttfts.sort()
    return {
        "mode": mode,
        "b_requests": len(b_requests),
        "b_ttft_p50_s": statistics.median(ttfts),
        "b_ttft_p95_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.95))],
        "b_ttft_max_s": ttfts[-1],
        "b_ttfts_s": [round(t, 4) for t in ttfts],
        "tokens_served": served,
        "share": {tenant: (n / total if total else 0.0) for tenant, n in served.items()},
        "tokens_per_s": total / window,
        "engine_tokens_per_step": (state_at_end.num_batched_tokens - state_at_start.num_batched_tokens)
        / max(1, state_at_end.num_steps - state_at_start.num_steps),
        "engine_steps_per_s": (state_at_end.num_steps - state_at_start.num_steps) / window,
        "interleaved_steps": state_at_end.num_interleaved_steps - state_at_start.num_interleaved_steps,
        "b_drained_after_window_s": drained - window_end,
    }


def _served(state: EngineState, key: str) -> int:
    return next((k.num_served_tokens for k in state.keys if k.fairness_key == key), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--duration", type=float, default=Load.duration_s, help="Seconds of B's arrivals measured.")
    parser.add_argument("--repeats", type=int, default=1, help="fcfs and vtc runs, alternated; medians reported.")
    parser.add_argument("--max-num-batched-tokens", type=int, default=Load.max_num_batched_tokens)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = Load(duration_s=args.duration, max_num_batched_tokens=args.max_num_batched_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(Path(tmp) / "model", dataclasses.replace(BENCHMARK_SPEC, torch_dtype="float32"))
        runs: dict[str, list[dict[str, Any]]] = {"fcfs": [], "vtc": []}
        for _ in range(args.repeats):
            for mode in ("fcfs", "vtc"):
                runs[mode].append(asyncio.run(run(model_dir, load, mode)))
        alone = asyncio.run(run(model_dir, load, "b_alone"))

    def median(mode: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[mode])

    fields = ("b_ttft_p50_s", "b_ttft_p95_s", "tokens_per_s")
    medians = {mode: {field: median(mode, field) for field in fields} for mode in runs}
    medians["vtc"]["b_share"] = statistics.median(r["share"]["B"] for r in runs["vtc"])
    result: dict[str, Any] = {
        "machine": machine(args.threads),
        "load": dataclasses.asdict(load),
        "repeats": args.repeats,
        "runs": {**runs, "b_alone": alone},
        "medians": medians,
        "b_p95_ttft_vtc_over_alone": medians["vtc"]["b_ttft_p95_s"] / alone["b_ttft_p95_s"],
        "b_p95_ttft_fcfs_over_alone": medians["fcfs"]["b_ttft_p95_s"] / alone["b_ttft_p95_s"],
        "throughput_vtc_over_fcfs": medians["vtc"]["tokens_per_s"] / medians["fcfs"]["tokens_per_s"],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
