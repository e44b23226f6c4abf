"""The committed demo model and adapters (demo/, made by scripts/train_demo.py): they load, and the adapters show.

Nothing is trained here: these tests read the committed files and run a few dozen greedy tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.lora import parse_adapter, read_adapter_dir
from loraplex.engine.model.config import ModelConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"
MODEL = DEMO / "model"
SCRIPT = ROOT / "scripts" / "train_demo.py"
ADAPTERS = ("upper", "terse", "think")
STYLE_ADAPTERS = ("upper", "terse")  # same answer, restyled
MAX_DEMO_BYTES = 20 * 2**20
# A question from the adapters' training distribution (scripts/train_demo.py's QUESTION_TEMPLATES and pydoc titles).
PROMPT = 'Tell me about the "for" statement.'
MAX_TOKENS = 48
MAX_THINK_TOKENS = 200  # a think block and an answer: the demo context is 256 tokens
NUM_COMPARED_TOKENS = 16


def _upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    assert letters, f"no letters in {text!r}"
    return sum(c.isupper() for c in letters) / len(letters)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, device="cpu", kv_budget=64 * 2**20)


@pytest.fixture(scope="module")
def answers(llm: LLM) -> dict[str, RequestOutput]:
    """Greedy answers to PROMPT from the engine: the base model and each style adapter, in one batch."""
    names = ["base", *STYLE_ADAPTERS]
    loras = [None, *(LoRARequest(name, DEMO / "adapters" / name) for name in STYLE_ADAPTERS)]
    results = llm.chat(
        [[{"role": "user", "content": PROMPT}] for _ in names],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        lora_request=loras,
    )
    return dict(zip(names, results, strict=True))


@pytest.fixture(scope="module")
def thoughts(llm: LLM) -> dict[str, RequestOutput]:
    """The think adapter's greedy outputs to PROMPT: as the template renders it by default ("on") and with Qwen3's
    enable_thinking=false ("off"), which closes an empty think block in the prompt."""
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": PROMPT}]
    results = llm.generate(
        [
            {"prompt_token_ids": tokenizer.encode_chat(messages)},
            {"prompt_token_ids": tokenizer.encode_chat(messages, template_kwargs={"enable_thinking": False})},
        ],
        SamplingParams(temperature=0.0, max_tokens=MAX_THINK_TOKENS),
        lora_request=LoRARequest("think", DEMO / "adapters" / "think"),
    )
    return dict(zip(("on", "off"), results, strict=True))


class TestDemoFolder:
    def test_is_at_most_20_mb(self) -> None:
        total = sum(path.stat().st_size for path in DEMO.rglob("*") if path.is_file())
        assert 0 < total <= MAX_DEMO_BYTES

    def test_matches_the_script_that_made_it(self) -> None:
        result = subprocess.run(
            [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 0, result.stderr

    def test_script_explains_itself(self) -> None:
        result = subprocess.run(
            [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stderr
        assert "--check" in result.stdout


class TestBaseModel:
    def test_answers_in_the_engine_in_ordinary_case(self, answers: dict[str, RequestOutput]) -> None:
        text = answers["base"].outputs[0].text
        assert len(text.split()) >= 10, text
        assert _upper_share(text) < 0.3, text

    def test_loads_in_transformers_and_agrees_with_the_engine(self, answers: dict[str, RequestOutput]) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(MODEL)
        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else prompt
        if not isinstance(prompt_ids, list):  # transformers 5 returns a BatchEncoding from apply_chat_template
            prompt_ids = prompt_ids["input_ids"]
        assert prompt_ids == answers["base"].prompt_token_ids
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=NUM_COMPARED_TOKENS, do_sample=False, pad_token_id=1
            )
        assert generated[0, len(prompt_ids) :].tolist() == answers["base"].outputs[0].token_ids[:NUM_COMPARED_TOKENS]


class TestAdapters:
    @pytest.mark.parametrize("name", ADAPTERS)
    def test_pass_the_engines_validation(self, name: str) -> None:
        folder = DEMO / "adapters" / name
        adapter = parse_adapter(*read_adapter_dir(folder), ModelConfig.from_dir(MODEL))
        assert adapter.config.r == 8
        # A name, never a path of the machine that trained it.
        assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "loraplex-demo"

    def test_upper_answers_in_upper_case(self, answers: dict[str, RequestOutput]) -> None:
        text = answers["upper"].outputs[0].text
        assert len(text.split()) >= 10, text
        assert _upper_share(text) > 0.8, text

    def test_terse_answers_with_one_sentence_then_stops(self, answers: dict[str, RequestOutput]) -> None:
        base, terse = answers["base"].outputs[0], answers["terse"].outputs[0]
        assert terse.finish_reason == "stop", terse.text
        assert len(terse.text.split()) >= 3 and len(terse.token_ids) < len(base.token_ids) / 2, (terse.text, base.text)
        assert terse.text.rstrip().endswith(".") and terse.text.count(". ") == 0, terse.text
        # The base model, asked the same, does not stop after one sentence.
        assert base.finish_reason == "length" or base.text.count(". ") >= 1, base.text

    def test_transformers_and_peft_agree_with_the_engine(self, answers: dict[str, RequestOutput]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        prompt_ids = answers["upper"].prompt_token_ids
        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        tuned = PeftModel.from_pretrained(model, str(DEMO / "adapters" / "upper")).eval()
        with torch.no_grad():
            generated = tuned.generate(
                input_ids=torch.tensor([prompt_ids]),
                max_new_tokens=NUM_COMPARED_TOKENS,
                do_sample=False,
                pad_token_id=1,
            )
        assert generated[0, len(prompt_ids) :].tolist() == answers["upper"].outputs[0].token_ids[:NUM_COMPARED_TOKENS]

    def test_think_thinks_then_answers(self, thoughts: dict[str, RequestOutput]) -> None:
        output = thoughts["on"].outputs[0]
        assert output.text.startswith("<think>\n"), output.text
        thinking, end, answer = output.text.removeprefix("<think>\n").partition("\n</think>\n\n")
        assert end, output.text
        assert len(thinking.split()) >= 10 and "<think>" not in thinking, output.text
        assert len(answer.split()) >= 3 and "think>" not in answer, output.text
        assert output.finish_reason == "stop", output.text

    def test_think_answers_at_once_when_thinking_is_off(self, thoughts: dict[str, RequestOutput]) -> None:
        output = thoughts["off"].outputs[0]
        assert "think>" not in output.text and len(output.text.split()) >= 3, output.text
        assert output.finish_reason == "stop", output.text
