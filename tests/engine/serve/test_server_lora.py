"""LoRA adapters through the engine's OpenAI-compatible server, on a real uvicorn socket, as vLLM's users drive it:
`--lora name=path` at start, /v1/load_lora_adapter and /v1/unload_lora_adapter at run time, and `model` naming
an adapter in completions and chat.

One tiny random Llama, real PEFT adapters made against it, and one server for the module. Greedy outputs with
ignore_eos are compared with the offline `LLM` running the same adapters (the engine's numbers are checked
against peft in test_lora_correctness), so a request that ran the wrong weights, or none, shows up as other text.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from _support.adapters import make_peft_adapter
from _support.checkpoints import tiny_spec
from _support.engine_server import running_engine_server
from _support.waiting import poll
from click.testing import CliRunner
from litestar import Litestar

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.server import create_engine_app, load_lora_modules
from loraplex.engine.tools.demo import write_random_model
from loraplex.platform.cli import main

pytestmark = pytest.mark.unit

TINY = tiny_spec()
MODEL = "tiny"
MAX_MODEL_LEN = 256
PROMPT = "The adapter says"
MAX_TOKENS = 12
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}

ADAPTERS: dict[str, dict[str, Any]] = {
    "first": {"seed": 1, "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "second": {"seed": 2, "r": 16, "lora_alpha": 8, "target_modules": "all-linear"},
    "third": {"seed": 3, "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
}


@dataclass(frozen=True)
class Setup:
    base: Path
    adapters: dict[str, Path]
    expected: dict[str | None, str]  # the offline engine's greedy text for PROMPT, by adapter (None: the base model)
    root: Path  # scratch space for adapters made by single tests


@dataclass(frozen=True)
class Server:
    url: str
    engine: AsyncEngine
    setup: Setup

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=30)

    def complete(self, model: str) -> str:
        response = self.client().completions.create(model=model, prompt=PROMPT, **GREEDY)
        assert response.model == model
        assert response.choices[0].finish_reason == "length"
        text: str = response.choices[0].text
        return text

    def load(self, name: str, path: Path | str) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

    def unload(self, name: str) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/unload_lora_adapter", json={"lora_name": name})

    def state(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/state")
        assert response.status_code == 200
        body: dict[str, Any] = response.json()
        return body

    def model_ids(self) -> list[str]:
        return [card.id for card in self.client().models.list().data]

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics").text
        match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


def _config(model_path: Path) -> EngineConfig:
    return EngineConfig(
        model=model_path,
        device="cpu",
        kv_budget=4 * 2**20,
        max_model_len=MAX_MODEL_LEN,
        served_model_name=MODEL,
        num_threads=2,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("server-lora")
    base = write_random_model(root / "base", TINY)
    adapters = {name: make_peft_adapter(base, root / name, **spec) for name, spec in ADAPTERS.items()}
    num_threads = torch.get_num_threads()
    llm = LLM(base, device="cpu", kv_budget=4 * 2**20, max_model_len=MAX_MODEL_LEN, num_threads=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected: dict[str | None, str] = {None: llm.generate(PROMPT, params)[0].outputs[0].text}
    for name, path in adapters.items():
        expected[name] = llm.generate(PROMPT, params, lora_request=LoRARequest(name, path))[0].outputs[0].text
    torch.set_num_threads(num_threads)
    assert len(set(expected.values())) == len(expected), "every adapter must change this prompt's greedy text"
    return Setup(base, adapters, expected, root)


def _running_server(
    config: EngineConfig, lora_modules: Sequence[LoRARequest]
) -> contextlib.AbstractContextManager[tuple[str, AsyncEngine]]:
    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine, await load_lora_modules(engine, lora_modules))

    return running_engine_server(config, app)


@pytest.fixture(scope="module")
def server(setup: Setup) -> Iterator[Server]:
    with _running_server(_config(setup.base), [LoRARequest("first", setup.adapters["first"])]) as (url, engine):
        yield Server(url, engine, setup)


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _variant(setup: Setup, of: str, name: str) -> Path:
    """A valid copy of adapter `of` whose files hash differently (the config gains trailing whitespace)."""
    folder = setup.root / name
    shutil.copytree(setup.adapters[of], folder)
    with (folder / CONFIG_FILE).open("a") as config:
        config.write("\n" * (1 + len(name)))
    return folder


def _sse_events(body: str) -> list[str]:
    assert body.endswith("data: [DONE]\n\n")
    return [event.removeprefix("data: ") for event in body.split("\n\n")[:-1]]


# --- requests with an adapter ------------------------------------------------------------------------------------


def test_adapter_named_at_start_runs_its_weights(server: Server) -> None:
    expected = server.setup.expected
    assert server.complete("first") == expected["first"]
    assert server.complete(MODEL) == expected[None]
    assert expected["first"] != expected[None]


def test_chat_with_an_adapter_echoes_its_name_and_differs_from_the_base(server: Server) -> None:
    messages: list[Any] = [{"role": "user", "content": "Hello there"}]
    answers = {}
    for model in (MODEL, "first"):
        response = server.client().chat.completions.create(model=model, messages=messages, **GREEDY)
        assert response.model == model
        answers[model] = response.choices[0].message.content
    assert answers["first"] != answers[MODEL]


def test_streaming_with_an_adapter_matches_the_offline_engine(server: Server) -> None:
    stream = server.client().completions.create(model="first", prompt=PROMPT, stream=True, **GREEDY)
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {"first"}
    assert "".join(chunk.choices[0].text for chunk in chunks) == server.setup.expected["first"]


def test_unknown_model_is_404_model_not_found(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="firstt", prompt=PROMPT, max_tokens=1)
    error = info.value.response.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


# --- load and unload ---------------------------------------------------------------------------------------------


def test_loading_an_adapter_serves_it(server: Server) -> None:
    response = server.load("second", server.setup.adapters["second"])
    assert response.status_code == 200, response.text
    assert "second" in response.text
    assert server.complete("second") == server.setup.expected["second"]
    assert server.complete("first") == server.setup.expected["first"]  # the others are untouched


def test_loading_a_name_again_with_new_content_runs_only_the_new_weights(server: Server) -> None:
    adapters, expected = server.setup.adapters, server.setup.expected
    assert server.load("swap", adapters["third"]).status_code == 200
    assert server.complete("swap") == expected["third"]
    old_digest = server.state()["adapters"]["swap"]["digest"]
    assert old_digest in server.engine.adapter_states()  # its weights are in memory

    assert server.load("swap", adapters["second"]).status_code == 200
    for _ in range(2):  # the old weights are resident, or just were: never served again under this name
        assert server.complete("swap") == expected["second"]
    state = server.state()["adapters"]["swap"]
    assert state["digest"] != old_digest
    assert state["source"] == str(adapters["second"])
    # No name refers to the old content any more: the engine dropped it.
    assert poll(lambda: old_digest not in server.engine.adapter_states())


def test_unloaded_adapter_is_gone(server: Server) -> None:
    assert server.load("temporary", server.setup.adapters["third"]).status_code == 200
    assert server.complete("temporary") == server.setup.expected["third"]

    response = server.unload("temporary")
    assert response.status_code == 200, response.text
    assert "temporary" not in server.model_ids()
    assert "temporary" not in server.state()["adapters"]
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="temporary", prompt=PROMPT, max_tokens=1)
    assert info.value.response.json()["error"]["code"] == "model_not_found"

    again = server.unload("temporary")
    assert again.status_code == 404
    error = _error(again)
    assert error["param"] == "lora_name"
    assert "temporary" in error["message"]


def test_unloading_an_adapter_in_use_lets_its_requests_finish_then_frees_it(server: Server) -> None:
    assert server.load("busy", _variant(server.setup, "third", "busy")).status_code == 200
    digest = server.state()["adapters"]["busy"]["digest"]
    body = {"model": "busy", "prompt": PROMPT, "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]

    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line)
        assert server.state()["num_running"] == 1
        assert server.unload("busy").status_code == 200
        assert digest in server.engine.adapter_states()  # still running: its weights stay
        rest = [line for line in lines if line]
    events = [line.removeprefix("data: ") for line in (first, *rest)]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1])
    assert text == whole  # it finished with the weights it started with
    assert poll(lambda: digest not in server.engine.adapter_states())


def _broken_dora(setup: Setup) -> Path:
    folder = setup.root / "dora"
    shutil.copytree(setup.adapters["first"], folder, dirs_exist_ok=True)
    config = json.loads((folder / CONFIG_FILE).read_text())
    config["use_dora"] = True
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return folder


def _broken_truncated(setup: Setup) -> Path:
    folder = setup.root / "truncated"
    shutil.copytree(setup.adapters["first"], folder, dirs_exist_ok=True)
    weights = (folder / WEIGHTS_FILE).read_bytes()
    (folder / WEIGHTS_FILE).write_bytes(weights[: len(weights) // 2])
    return folder


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (_broken_dora, ["DoRA"]),
        (_broken_truncated, [WEIGHTS_FILE]),
        (lambda setup: setup.root / "no-such-folder", ["does not exist"]),
    ],
    ids=["dora", "truncated-safetensors", "missing-folder"],
)
def test_a_broken_adapter_is_refused_and_not_registered(
    server: Server, make: Callable[[Setup], Path], words: list[str]
) -> None:
    response = server.load("broken", make(server.setup))
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "lora_path"
    for word in words:
        assert word in error["message"]
    assert "broken" not in server.model_ids()
    assert "broken" not in server.state()["adapters"]


def test_a_broken_reload_keeps_the_name_on_its_old_weights(server: Server) -> None:
    response = server.load("first", _broken_dora(server.setup))
    assert response.status_code == 400
    assert server.complete("first") == server.setup.expected["first"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_name": MODEL, "lora_path": "."}, "lora_name"),
        ({"lora_name": "", "lora_path": "."}, "lora_name"),
        ({"lora_name": "x", "lora_path": ""}, "lora_path"),
        ({"lora_name": "x"}, "lora_path"),
    ],
)
def test_bad_load_requests_are_400_naming_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body)
    assert response.status_code == 400
    assert _error(response)["param"] == param


# --- an adapter that fails when its request needs it -------------------------------------------------------------


def test_an_adapter_whose_files_changed_fails_its_requests_with_400(server: Server) -> None:
    folder = _variant(server.setup, "first", "changing")
    assert server.load("changing", folder).status_code == 200
    shutil.copyfile(server.setup.adapters["second"] / WEIGHTS_FILE, folder / WEIGHTS_FILE)  # after validation

    body = {"model": "changing", "prompt": PROMPT, "max_tokens": 4}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert "changing" in error["message"] and "changed" in error["message"]

    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as stream:
        assert stream.status_code == 200
        events = _sse_events(stream.read().decode())
    failure, done = events  # nothing was generated: the error event is the whole stream
    assert done == "[DONE]"
    assert json.loads(failure)["error"]["type"] == "invalid_request_error"
    assert "changed" in json.loads(failure)["error"]["message"]
    assert server.complete(MODEL) == server.setup.expected[None]  # nothing else suffered


def test_a_load_that_fails_through_no_fault_of_the_adapter_is_500(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert server.load("unlucky", _variant(server.setup, "second", "unlucky")).status_code == 200

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated packing bug")

    monkeypatch.setattr("loraplex.engine.lora.manager.layout_adapter", fail)
    body = {"model": "unlucky", "prompt": PROMPT, "max_tokens": 4}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 500
    assert _error(response)["type"] == "server_error"


# --- what an operator sees ---------------------------------------------------------------------------------------


def test_models_lists_the_base_model_and_every_adapter(server: Server) -> None:
    assert server.load("listed", server.setup.adapters["second"]).status_code == 200
    cards = {card.id: card for card in server.client().models.list().data}
    assert next(iter(cards)) == MODEL
    assert {MODEL, "first", "listed"} <= set(cards)
    base = cards[MODEL]
    assert base.model_extra is not None and base.model_extra["parent"] is None
    for name, source in (("first", "first"), ("listed", "second")):
        card = cards[name]
        assert card.object == "model"
        assert card.owned_by == "loraplex"
        assert card.model_extra is not None
        assert card.model_extra["parent"] == MODEL
        assert card.model_extra["root"] == str(server.setup.adapters[source])
        assert server.client().models.retrieve(name).model_dump() == card.model_dump()


def test_state_reports_each_adapter_and_keeps_the_pool(server: Server) -> None:
    server.complete("first")
    state = server.state()
    first = state["adapters"]["first"]
    assert first["digest"].startswith("sha256:")
    assert first["state"] in ("resident", "loaded")
    assert first["source"] == str(server.setup.adapters["first"])
    assert state["model"] == MODEL
    assert state["pool"]["num_pages"] > 0
    assert set(state["pool"]["by_kind"]) == {"kv", "adapter"}
    if first["state"] == "resident":
        assert state["pool"]["by_kind"]["adapter"] > 0


def test_metrics_count_requests_by_adapter_and_resident_adapters(server: Server) -> None:
    labels = '{finish_reason="length",lora_name="first"}'
    before = server.metric("loraplex_engine_lora_requests_total", labels)
    server.complete("first")
    assert server.metric("loraplex_engine_lora_requests_total", labels) == before + 1
    assert server.metric("loraplex_engine_lora_adapters_resident") >= 1
    assert server.metric("loraplex_engine_lora_adapters_registered") == len(server.state()["adapters"])


# --- the command line --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lora", "words"),
    [
        ("bad={root}/no-such-folder", ["'bad'", "does not exist"]),
        ("dora={dora}", ["'dora'", "DoRA"]),
        (f"{MODEL}={{first}}", [f"'{MODEL}'", "base model"]),
    ],
    ids=["missing", "invalid", "base-name"],
)
def test_serve_refuses_to_start_with_a_bad_adapter(setup: Setup, lora: str, words: list[str]) -> None:
    spec = lora.format(root=setup.root, dora=_broken_dora(setup), first=setup.adapters["first"])
    num_threads = torch.get_num_threads()
    args = ["engine", "serve", "--model", str(setup.base), "--served-model-name", MODEL, "--device", "cpu"]
    args += ["--kv-budget", "4MiB", "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "2", "--port", "0"]
    result = CliRunner().invoke(main, [*args, "--lora", f"first={setup.adapters['first']}", "--lora", spec])
    torch.set_num_threads(num_threads)
    assert result.exit_code == 1, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("Error:")]
    for word in words:
        assert word in line


def test_serve_refuses_a_lora_option_without_a_path(setup: Setup) -> None:
    result = CliRunner().invoke(main, ["engine", "serve", "--model", str(setup.base), "--lora", "just-a-name"])
    assert result.exit_code == 2
    assert "NAME=PATH" in result.output
