"""--speculative-config parses vLLM's shape and refuses what it cannot serve, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.engine.core.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.unit


def test_vllm_shaped_ngram_config() -> None:
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    )
    assert config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2
    )


def test_draft_model_config_needs_its_model() -> None:
    config = SpeculativeConfig.parse({"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3})
    assert config.model == Path("/models/draft") and config.num_speculative_tokens == 3
    assert SpeculativeConfig.parse({"method": "draft", "model": "d"}).method == "draft_model"
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.parse({"method": "draft_model"})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"method": "medusa"}, "speculative method must be one of"),
        ({"method": "ngram", "num_speculative_token": 4}, "unknown speculative config field"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "between 1 and 16"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "between 1 and 16"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "at least prompt_lookup_min"),
        ({"method": "ngram", "prompt_lookup_min": 0}, "at least 1"),
        ({"method": "ngram", "model": "x"}, "ngram speculation has no model"),
        ({"method": "draft_model", "model": 3}, "must be a path"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(value: str | dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)  # type: ignore[arg-type]
