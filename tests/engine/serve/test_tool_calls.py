"""The tool-call parsers and the streaming splitter on hand-written model outputs."""

from __future__ import annotations

import json

import pytest

from loraplex.engine.serve.tool_calls import ToolCallStream, parse_auto, parse_required

pytestmark = pytest.mark.unit

NAMES = frozenset({"get_weather", "get_time"})
HERMES = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' + (
    '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
)


def test_hermes_calls_and_the_content_before_them() -> None:
    content, calls = parse_auto("hermes", HERMES, NAMES)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize(
    "text",
    [
        "Just text.",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not one of the tools
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "get_time", "arguments": "zone"}</tool_call>',
    ],
)
def test_text_without_a_well_formed_call_is_content(text: str) -> None:
    assert parse_auto("hermes", text, NAMES) == (text, [])


def test_llama3_json_calls_with_and_without_the_python_tag() -> None:
    for text in (
        '{"name": "get_time", "parameters": {"zone": "UTC"}}',
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {}}',
    ):
        content, calls = parse_auto("llama3_json", text, NAMES)
        assert content is None
        assert calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": "UTC"}
    assert parse_auto("llama3_json", "The time is noon.", NAMES) == ("The time is noon.", [])


def test_required_output_is_read_as_its_array() -> None:
    calls = parse_required('[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]
    assert parse_required('[{"name": "get_time", "param') == []  # cut short by max_tokens


def test_streaming_sends_content_until_a_call_may_begin() -> None:
    stream = ToolCallStream("hermes", NAMES)
    pieces = [
        "Let me",
        " look.\n<tool",
        '_call>\n{"name": ',
        '"get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    ]
    sent = [stream.feed(p) for p in pieces]
    assert "".join(sent) == "Let me look.\n"  # "<tool" was held back: it could be (and was) a marker
    assert sent[1] == " look.\n"
    rest, calls = stream.finish()
    assert rest == ""
    assert [c.name for c in calls] == ["get_weather"]


def test_streaming_text_that_only_looked_like_a_call_is_sent_at_the_end() -> None:
    stream = ToolCallStream("hermes", NAMES)
    sent = stream.feed("a <tool") + stream.feed("box> here")
    rest, calls = stream.finish()
    assert calls == []
    assert sent + rest == "a <toolbox> here"
