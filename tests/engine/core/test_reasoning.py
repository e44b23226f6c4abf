"""The think block's state machine (engine.core.reasoning), its settings (reasoning_config) and the text split the
server makes of it (serve.reasoning_parser): phases, budgets, forced closing, markers of one or several tokens."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from loraplex.engine.core.outputs import ReasoningOutput
from loraplex.engine.core.reasoning import PROMPT_TAIL, Phase, ReasoningMarkers, ReasoningState
from loraplex.engine.core.reasoning_config import (
    DEFAULT_REASONING_BUDGETS,
    ReasoningConfig,
    format_reasoning_budgets,
    parse_reasoning_budgets,
)
from loraplex.engine.serve.reasoning_parser import ReasoningSplit, ReasoningStream, split

pytestmark = pytest.mark.unit

# One-token markers (a reasoning model's added tokens): <think> = 1, </think> = 2, closing text = 7 8.
SINGLE = ReasoningMarkers("qwen3", (1,), (2,), (7, 8))
# Several tokens each, as a tokenizer without them as added tokens writes them: <think> = 1 3, </think> = 1 4 3.
MULTI = ReasoningMarkers("qwen3", (1, 3), (1, 4, 3), (9,))


def run(state: ReasoningState, tokens: list[int]) -> ReasoningState:
    for token in tokens:
        state = state.after(token)
    return state


class TestConfig:
    def test_flag_form_round_trips_and_keeps_default_tiers(self) -> None:
        budgets = parse_reasoning_budgets("none=0, low=8,high=100")
        config = ReasoningConfig(parser="qwen3", budgets=budgets)
        assert config.budgets == {**DEFAULT_REASONING_BUDGETS, "low": 8, "high": 100}
        assert parse_reasoning_budgets(format_reasoning_budgets(config.budgets)) == config.budgets
        assert config.budget(None) == config.budgets["medium"] and config.budget("low") == 8

    @pytest.mark.parametrize(
        ("text", "says"),
        [("low", "tier=tokens"), ("huge=5", "not a reasoning effort"), ("low=x", "whole number"),
         ("low=1,low=2", "twice"), ("", "at least one")],
    )  # fmt: skip
    def test_bad_flags_say_what_is_wrong(self, text: str, says: str) -> None:
        with pytest.raises(ValueError, match=says):
            parse_reasoning_budgets(text)

    @pytest.mark.parametrize(
        ("value", "says"),
        [({"budgets": {}}, "parser is required"), ({"parser": "gpt"}, "parser must be one of"),
         ({"parser": "qwen3", "budgets": {"low": -1}}, "from 0"), ({"parser": "qwen3", "budgets": {"none": 3}}, "none"),
         ({"parser": "qwen3", "default_effort": "max"}, "default reasoning effort"),
         ({"parser": "qwen3", "closing_text": "</think>"}, "markers"), ({"parser": "qwen3", "x": 1}, "unknown field"),
         ([1], "must be an object")],
    )  # fmt: skip
    def test_the_json_form_is_checked(self, value: object, says: str) -> None:
        with pytest.raises(ValueError, match=says):
            ReasoningConfig.from_dict(value)

    def test_the_json_form_round_trips(self) -> None:
        config = ReasoningConfig.from_dict({"parser": "deepseek_r1", "budgets": "low=3", "default_effort": "low"})
        assert ReasoningConfig.from_dict(config.to_dict()) == config
        assert config.budget(None) == 3


class TestPhases:
    def test_the_prompt_decides_where_a_row_starts(self) -> None:
        decode = {5: "x", 6: "\n"}.get

        def phase(markers: ReasoningMarkers, prompt: list[int]) -> Phase:
            return markers.initial_phase(prompt, lambda ids: "".join(decode(i) or "?" for i in ids))

        assert phase(SINGLE, [5, 1, 6]) is Phase.THINKING  # the template opened the block
        assert phase(SINGLE, [5, 1, 6, 2, 6, 6]) is Phase.DONE  # enable_thinking false: closed, then whitespace
        assert phase(SINGLE, [1, 2, 5, 5]) is Phase.OPENING  # an earlier turn's block: this turn may open one
        assert phase(SINGLE, [5, 5]) is Phase.OPENING
        r1 = ReasoningMarkers("deepseek_r1", (1,), (2,), (7,))
        assert phase(r1, [5, 5]) is Phase.THINKING  # R1 reasons from its first token, marker or not
        assert phase(MULTI, [5, 1, 3, 6]) is Phase.THINKING
        assert phase(MULTI, [5, 1, 3, 1, 4, 3, 6]) is Phase.DONE
        # Only the prompt's tail counts: a block opened far back is an earlier turn's text.
        assert phase(SINGLE, [5, 1, *[5] * PROMPT_TAIL]) is Phase.OPENING

    def test_a_block_the_model_closes_itself_is_counted_with_its_markers(self) -> None:
        state = run(ReasoningState.start(SINGLE, 10, Phase.OPENING), [1, 5, 5, 2])
        assert state.phase is Phase.DONE and state.num_tokens == 4
        assert run(state, [5, 5, 1, 2]).num_tokens == 4  # the answer's tokens are not reasoning, markers or not

    def test_an_output_that_does_not_open_a_block_has_none(self) -> None:
        state = run(ReasoningState.start(MULTI, None, Phase.OPENING), [1, 5])  # half a marker, then something else
        assert state.phase is Phase.DONE and state.num_tokens == 0

    @pytest.mark.parametrize("markers", [SINGLE, MULTI])
    @pytest.mark.parametrize("budget", [1, 3, 6])
    def test_a_spent_budget_forces_the_closing_text_and_the_end_marker(
        self, markers: ReasoningMarkers, budget: int
    ) -> None:
        state = ReasoningState.start(markers, budget, Phase.THINKING)
        for _ in range(budget):
            assert state.forced() is None and state.forbids_stop
            state = state.after(5)
        forced = []
        while (token := state.forced()) is not None:
            forced.append(token)
            state = state.after(token)
        assert forced == [*markers.closing_ids, *markers.end_ids]
        assert state.phase is Phase.DONE and state.num_tokens == budget + len(forced)
        assert not state.forbids_stop and state.forced() is None

    def test_a_zero_budget_closes_an_open_block_with_the_end_marker_alone(self) -> None:
        state = ReasoningState.start(MULTI, 0, Phase.THINKING)
        assert state.phase is Phase.CLOSING
        assert [state.forced(), (s := state.after(1)).forced(), s.after(4).forced()] == [1, 4, 3]
        assert run(state, [1, 4, 3]).num_tokens == 3

    def test_a_zero_budget_forbids_opening_a_block(self) -> None:
        state = ReasoningState.start(SINGLE, 0, Phase.OPENING)
        assert state.forbids_marker() == 1
        assert ReasoningState.start(SINGLE, 5, Phase.OPENING).forbids_marker() is None

    def test_without_a_budget_nothing_is_forced_or_forbidden(self) -> None:
        state = run(ReasoningState.start(SINGLE, None, Phase.THINKING), [5] * 500)
        assert state.phase is Phase.THINKING and state.forced() is None and not state.forbids_stop

    def test_a_row_with_a_grammar_finishes_an_opening_marker_it_began(self) -> None:
        state = ReasoningState.start(MULTI, 4, Phase.OPENING).after(1)
        assert state.forced() is None and state.forced(complete_marker=True) == 3


class TestSplit:
    def test_markers_and_the_whitespace_around_them_are_dropped(self) -> None:
        text = "<think>\nLet me see.\n</think>\n\nThe answer."
        end = text.index("\n\nThe")
        parts = split(text, ReasoningOutput(9, end))
        assert (parts.reasoning, parts.content) == ("Let me see.", "The answer.")
        # A block the template opened in the prompt has no opening marker in the output.
        assert split("Hmm.\n</think>\n\nYes.", ReasoningOutput(3, 13)).reasoning == "Hmm."

    def test_outputs_without_a_block_are_all_content(self) -> None:
        assert split(" <b>hi</b>", ReasoningOutput(0, 0)).content == " <b>hi</b>"
        assert split("hi", None).reasoning is None
        assert split("</think>\n\nAnswer", ReasoningOutput(1, 8)).reasoning is None  # closed at once: none
        # Cut off inside its block (a length limit): all of it is reasoning, and there is no answer.
        assert split("still thinking", ReasoningOutput(3, None)) == ReasoningSplit("still thinking", "")

    @pytest.mark.parametrize("cut", [1, 2, 3, 5, 7])
    def test_streamed_pieces_add_up_to_the_whole(self, cut: int) -> None:
        text = "<think>\nStep one. Step two <\n</think>\n\n  Final: 42"
        end = text.index("\n\n  Final")
        stream = ReasoningStream()
        reasoning = content = ""
        for stop in [*range(cut, len(text), cut), len(text)]:
            piece = text[:stop]
            finished = stop == len(text)
            state = ReasoningOutput(0, end if stop >= end else None)
            r, c = stream.feed(piece, state, finished=finished)
            reasoning, content = reasoning + r, content + c
        whole = split(text, ReasoningOutput(0, end))
        assert (reasoning, content) == (whole.reasoning, whole.content)


PIECES = ["<think>", "</think>", "\n", " ", "a", "b.", "<", "</", "th", "ink>"]


@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=30),
    answer=st.lists(st.sampled_from(PIECES), max_size=10),
    cuts=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=60),
    closes=st.booleans(),
)
# Found by a CI run: an open block whose text ends with a whole end marker and a newline streamed the marker as
# reasoning, which the finished block's split drops.
@example(pieces=["</think>", "\n"], answer=[], cuts=[1, 7], closes=False)
def test_any_streaming_of_any_block_adds_up_to_the_whole(
    pieces: list[str], answer: list[str], cuts: list[int], closes: bool
) -> None:
    block = "".join(pieces) + ("</think>" if closes else "")
    text = block + ("".join(answer) if closes else "")
    end = len(block) if closes else None
    stream = ReasoningStream()
    reasoning = content = ""
    stop = 0
    for cut in [*cuts, len(text)]:
        stop = min(len(text), stop + cut)
        finished = stop == len(text)
        r, c = stream.feed(
            text[:stop], ReasoningOutput(0, end if end is not None and stop >= end else None), finished=finished
        )
        reasoning, content = reasoning + r, content + c
        if finished:
            break
    whole = split(text, ReasoningOutput(0, end))
    assert (reasoning or None, content) == (whole.reasoning, whole.content)
