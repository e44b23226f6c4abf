"""The engine server with `--speculative-config`: the OpenAI SDK gets the answer it gets without speculation, and
/metrics reports proposed, kept and emitted tokens per adapter; a bad config is refused before anything loads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from _support.engine_server import running_engine_server
from click.testing import CliRunner
from litestar import Litestar

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.speculative_config import SpeculativeConfig
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.cli import engine as engine_cli
from loraplex.engine.serve.server import create_engine_app

pytestmark = pytest.mark.unit

DEMO = Path(__file__).resolve().parents[3] / "demo" / "model"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
PROMPT = 'The "for" statement is used to iterate over the elements of a sequence. The "for" statement'


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, AsyncEngine]]:
    config = EngineConfig(
        model=DEMO,
        device="cpu",
        dtype="float32",
        served_model_name="demo",
        speculative_config=SpeculativeConfig.parse(NGRAM),
        speculative_knee_tokens=64,
        speculative_use_clock=False,  # what is proposed and kept must not depend on this machine's load
    )

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine)

    with running_engine_server(config, app) as running:
        yield running


def test_the_sdk_gets_the_unspeculated_answer_and_metrics_count_the_speculation(
    server: tuple[str, AsyncEngine],
) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    answer = client.completions.create(model="demo", prompt=PROMPT, max_tokens=40, temperature=0)
    expected = LLM(DEMO, device="cpu", dtype="float32").generate(PROMPT, SamplingParams(temperature=0, max_tokens=40))
    assert answer.choices[0].text == expected[0].outputs[0].text
    metrics = httpx.get(f"{url}/metrics").text
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines() if line.startswith("lora")}
    proposed = lines['loraplex_engine_spec_decode_num_draft_tokens_total{lora_name=""}']
    accepted = lines['loraplex_engine_spec_decode_num_accepted_tokens_total{lora_name=""}']
    assert proposed > 0 and proposed / 3 < accepted <= proposed  # the demo model repeats itself
    assert lines['loraplex_engine_spec_decode_acceptance_rate{lora_name=""}'] == pytest.approx(accepted / proposed)
    assert lines['loraplex_engine_spec_decode_mean_accepted_length{lora_name=""}'] >= 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"method": "medusa"}', "speculative method must be one of"),
        ('{"method": "draft_model"}', "needs 'model'"),
    ],
)
def test_a_bad_speculative_config_is_refused_naming_the_option(value: str, message: str) -> None:
    result = CliRunner().invoke(engine_cli, ["serve", "--model", str(DEMO), "--speculative-config", value])
    assert result.exit_code == 2, result.output
    assert "--speculative-config" in result.output and message in result.output
