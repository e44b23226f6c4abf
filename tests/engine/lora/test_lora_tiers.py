"""Adapter tiers and scheduling: loads never stall others, failures stay with their requests, S3 sources,
content digests as identity, the per-step adapter cap, and a bounded wait for cold adapters."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _support.adapters import make_peft_adapter
from _support.services import S3Server, s3_client

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.lora import AdapterError
from loraplex.engine.lora.manager import AdapterManager

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def base(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama-gqa")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tier-adapters")
    specs: dict[str, dict[str, Any]] = {
        "a": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        "b": {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        "c": {"r": 4, "lora_alpha": 8, "target_modules": ["o_proj", "down_proj"]},
        "d": {"r": 32, "lora_alpha": 32, "target_modules": ["gate_proj", "up_proj"]},
    }
    return {name: make_peft_adapter(base, root / name, seed=i, **spec) for i, (name, spec) in enumerate(specs.items())}


def _core(base: Path, **options: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=base, dtype="float32", device="cpu", kv_budget=8 * 2**20, **options))


def _drain(core: EngineCore, on_step: Callable[[], None] | None = None) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output
        if on_step is not None:
            on_step()
    return finished


def _tokens(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> list[int]:
    return llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=lora)[0].outputs[0].token_ids


@pytest.mark.unit
def test_a_loading_adapter_stalls_nobody(
    base: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    original = AdapterManager._load

    def slow_load(self: AdapterManager, ref: Any) -> Any:
        release.wait(timeout=30)  # the load is "slow" until the test says otherwise
        return original(self, ref)

    monkeypatch.setattr(AdapterManager, "_load", slow_load)
    core = _core(base)
    ref = core.resolve_lora(LoRARequest("a", adapters["a"]))
    core.add_request("lora", [5, 6, 7], GREEDY, lora=ref)
    core.add_request("base", [5, 6, 7], GREEDY)
    finished: dict[str, RequestOutput] = {}
    for _ in range(20):
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output
        if "base" in finished:
            break
    assert "base" in finished and "lora" not in finished  # the base request ran while the adapter loaded
    assert core.requests["lora"].num_computed_tokens == 0  # waiting, not failed
    release.set()
    finished.update(_drain(core))
    assert finished["lora"].outputs[0].finish_reason == "length"


@pytest.mark.unit
def test_a_failed_load_fails_only_its_requests(base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(adapters["b"], broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    core = _core(base)
    ref = core.resolve_lora(LoRARequest("broken", broken))  # hashed while still valid
    config["use_dora"] = True
    (broken / "adapter_config.json").write_text(json.dumps(config))
    good = core.resolve_lora(LoRARequest("a", adapters["a"]))
    core.add_request("bad-1", [3, 4], GREEDY, lora=ref)
    core.add_request("bad-2", [3, 4, 5], GREEDY, lora=ref)
    core.add_request("ok", [3, 4], GREEDY, lora=good)
    core.add_request("base", [3, 4], GREEDY)
    finished = _drain(core)
    for name in ("bad-1", "bad-2"):
        assert finished[name].outputs[0].finish_reason == "error"
        assert finished[name].error is not None and "broken" in finished[name].error
    # The files changed after they were named: the digest check catches it before anything is served.
    assert "changed" in (finished["bad-1"].error or "")
    assert finished["ok"].outputs[0].finish_reason == "length"
    assert finished["base"].outputs[0].finish_reason == "length"


@pytest.mark.unit
def test_an_unsupported_adapter_is_refused_by_name(base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    dora = tmp_path / "dora"
    shutil.copytree(adapters["b"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    config["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(config))
    llm = LLM(base, dtype="float32", device="cpu", kv_budget=8 * 2**20)
    (output,) = llm.generate({"prompt_token_ids": [3, 4]}, GREEDY, lora_request=LoRARequest("dora", dora))
    assert output.outputs[0].finish_reason == "error"
    assert output.error is not None and "use_dora" in output.error


@pytest.mark.unit
def test_new_content_under_an_old_name_never_serves_the_old_weights(
    base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    llm = LLM(base, dtype="float32", device="cpu", kv_budget=8 * 2**20)
    prompt = [9, 8, 7, 6]
    folder = tmp_path / "same-name"
    shutil.copytree(adapters["a"], folder)
    first = _tokens(llm, prompt, LoRARequest("same", folder))
    shutil.rmtree(folder)
    shutil.copytree(adapters["b"], folder)
    second = _tokens(llm, prompt, LoRARequest("same", folder))
    assert second == _tokens(llm, prompt, LoRARequest("b", adapters["b"]))
    assert first == _tokens(llm, prompt, LoRARequest("a", adapters["a"]))
    assert first != second
    digests = {entry.ref.digest for entry in llm.engine.adapters.entries.values()}
    assert len(digests) == 2  # "a"/"same" share content and digest, "b"/"same" too


@pytest.mark.unit
def test_adapter_cap_per_step_and_a_bounded_wait(base: Path, adapters: dict[str, Path]) -> None:
    core = _core(base, max_adapters_per_batch=2)
    refs = {name: core.resolve_lora(LoRARequest(name, path)) for name, path in adapters.items()}
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    core.add_request("a-0", [1, 2, 3], long, lora=refs["a"])
    core.add_request("b-0", [1, 2, 3], long, lora=refs["b"])
    cold = core.add_request("c-0", [1, 2, 3], GREEDY, lora=refs["c"])  # a third adapter: over the cap
    arrivals = iter(range(1, 60))
    adapters_per_step: list[int] = []
    steps = {"now": 0, "loaded": -1, "started": -1}

    def keep_a_busy() -> None:
        # Requests of an already running adapter keep arriving; they must not overtake c-0 once it can run.
        steps["now"] += 1
        adapters_per_step.append(len(core.scheduler._running_adapters))
        assert cold.adapter is not None
        if steps["loaded"] < 0 and cold.adapter.host is not None:
            steps["loaded"] = steps["now"]
        if steps["started"] < 0 and cold.num_computed_tokens > 0:
            steps["started"] = steps["now"]
        index = next(arrivals, None)
        if index is not None and steps["started"] < 0:
            core.add_request(f"a-{index}", [1, 2, 3], long, lora=refs["a"])

    finished = _drain(core, keep_a_busy)
    assert max(adapters_per_step) <= 2
    assert finished["c-0"].outputs[0].finish_reason == "length"
    assert 0 <= steps["loaded"] <= steps["started"]
    # Once loaded, c-0 waits only for the requests already running to drain (12 tokens at most), not for the
    # newer requests of adapter a that keep arriving behind it.
    assert steps["started"] - steps["loaded"] <= 13


@pytest.fixture
def s3_adapter(s3_server: S3Server, s3_bucket: str, adapters: dict[str, Path]) -> str:
    client = s3_client(s3_server)
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        client.put_object(
            Bucket=s3_bucket, Key=f"tenants/t1/adapters/x/{file}", Body=(adapters["a"] / file).read_bytes()
        )
    return f"s3://{s3_bucket}/tenants/t1/adapters/x"


@pytest.mark.integration
def test_adapters_load_from_s3(
    base: Path, adapters: dict[str, Path], s3_server: S3Server, s3_adapter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    llm = LLM(base, dtype="float32", device="cpu", kv_budget=8 * 2**20, s3_endpoint_url=s3_server.endpoint_url)
    prompt = [11, 12, 13]
    from_s3 = _tokens(llm, prompt, LoRARequest("a-s3", s3_adapter))
    assert from_s3 == _tokens(llm, prompt, LoRARequest("a", adapters["a"]))
    with pytest.raises(AdapterError, match="could not read s3://"):
        llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=LoRARequest("nope", s3_adapter + "-missing"))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.unit
def test_digest_is_content_not_path(base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(adapters["c"], copy)
    core = _core(base)
    assert core.resolve_lora(LoRARequest("x", copy)).digest == core.resolve_lora(LoRARequest("y", adapters["c"])).digest


@pytest.mark.unit
def test_unload_waits_for_every_request_that_names_the_adapter(base: Path, adapters: dict[str, Path]) -> None:
    core = _core(base)
    ref = core.resolve_lora(LoRARequest("a", adapters["a"]))
    core.add_request("r", [1, 2, 3], GREEDY, lora=ref)
    assert not core.adapters.unload(ref.digest)  # still waiting for it
    _drain(core)
    assert core.adapters.unload(ref.digest)
    assert ref.digest not in core.adapters.entries
    assert core.pool.usage().by_kind["adapter"] == 0


@pytest.mark.unit
def test_host_tier_stays_within_its_budget(base: Path, adapters: dict[str, Path]) -> None:
    # Two slots for four adapters and a host budget of about one adapter: evicted adapters' host copies go too.
    core = _core(base, max_loras=2, max_adapters_per_batch=2, lora_host_budget=200_000)
    for name, path in adapters.items():
        core.add_request(name, [1, 2, 3], GREEDY, lora=core.resolve_lora(LoRARequest(name, path)))
    _drain(core)
    held = [e for e in core.adapters.entries.values() if e.host is not None]
    largest = max(e.host_bytes for e in held) if held else 0
    assert core.adapters._host_bytes <= max(200_000, largest)
    assert len(core.adapters.resident()) <= 2


def test_adapters_in_neither_tier_are_forgotten(base: Path, adapters: dict[str, Path]) -> None:
    """Every adapter an engine ever served must not stay in its table (each step walks it): one in neither tier that
    no request names is dropped, and a later request loads it again and gets the same answer."""
    core = _core(base, max_loras=1, max_adapters_per_batch=1, lora_host_budget=1)
    refs = {name: core.resolve_lora(LoRARequest(name, path)) for name, path in adapters.items()}
    answers: dict[str, list[list[int]]] = {name: [] for name in refs}
    for round_ in range(2):
        for name, ref in refs.items():
            core.add_request(f"{name}-{round_}", [1, 2, 3], GREEDY, lora=ref)
            answers[name].append(_drain(core)[f"{name}-{round_}"].outputs[0].token_ids)
            # One slot and no host budget: only the resident adapter is still known.
            assert len(core.adapters.entries) <= 1, sorted(e.ref.name for e in core.adapters.entries.values())
    assert all(first == again for first, again in answers.values()), answers
