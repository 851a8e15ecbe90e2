"""Reasoning split off ``<think>`` replies: whole, streamed (equal however the text is split), and
the prompt and template checks that say when to split."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from tinyloop.http.reasoning import (
    Kind,
    StreamingReasoningSplitter,
    prompt_opens_think,
    split_reasoning,
    template_thinks,
)
from tinyloop.tokenizer import CHATML_TEMPLATE, render_chat

# Ouro-Thinking's ChatML: `enable_thinking` opens `<think>` in the generation prompt.
OURO_THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "2+2?"}]


def test_a_reply_that_opens_think_splits_at_its_close() -> None:
    assert split_reasoning("<think>\nadd them\n</think>\n\nIt is 4.") == ("add them", "It is 4.")
    assert split_reasoning("\n <think>a</think>b</think>") == ("a", "b</think>")


def test_a_reply_without_an_opening_think_is_all_content() -> None:
    assert split_reasoning("  It is 4. ") == (None, "It is 4.")
    assert split_reasoning("So <think>x</think> y") == (None, "So <think>x</think> y")
    assert split_reasoning("x</think>y") == (None, "x</think>y")
    assert split_reasoning("") == (None, None)


def test_an_unclosed_think_is_all_reasoning_and_empty_parts_are_none() -> None:
    assert split_reasoning("<think>still going") == ("still going", None)
    assert split_reasoning("<think>\n\n</think>\n\nIt is 4.") == (None, "It is 4.")
    assert split_reasoning("<think>hm</think>  ") == ("hm", None)


def test_a_reply_to_a_prompt_that_opened_think_starts_in_the_reasoning() -> None:
    assert split_reasoning("add them\n</think>\n\n4", started_in_think=True) == ("add them", "4")
    assert split_reasoning("no close yet", started_in_think=True) == ("no close yet", None)
    assert split_reasoning("</think>4", started_in_think=True) == (None, "4")


def test_the_prompt_opens_think_when_its_template_ends_with_the_tag() -> None:
    thinking = render_chat(MESSAGES, template=OURO_THINKING_TEMPLATE, variables={"enable_thinking": True})
    assert thinking.endswith("<think>\n") and prompt_opens_think(thinking)
    plain = render_chat(MESSAGES, template=OURO_THINKING_TEMPLATE, variables={"enable_thinking": False})
    assert not prompt_opens_think(plain)
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not prompt_opens_think("<|im_start|>user\nwhat does <think> do?<|im_end|>\n<|im_start|>assistant\n")


def test_thinking_templates_are_told_from_plain_ones() -> None:
    assert template_thinks(OURO_THINKING_TEMPLATE)
    assert template_thinks("{% if not enable_thinking %}{{ '<think></think>' }}{% endif %}")
    assert not template_thinks(CHATML_TEMPLATE)


def test_tags_split_across_deltas_are_held_until_they_settle() -> None:
    splitter = StreamingReasoningSplitter()
    assert splitter.feed("<th") == []
    assert splitter.feed("ink>\nadd") == [("reasoning", "add")]
    assert splitter.feed(" them</th") == [("reasoning", " them")]
    assert splitter.feed("ink>\n\nIt") == [("content", "It")]
    assert splitter.feed(" is 4.\n") == [("content", " is 4.")]
    assert splitter.finish() == []
    assert "content" in repr(splitter)


def test_a_short_reply_that_never_opens_think_comes_out_in_finish() -> None:
    splitter = StreamingReasoningSplitter()
    assert splitter.feed(" <thi") == []
    assert splitter.finish() == [("content", "<thi")]
    opened = StreamingReasoningSplitter(started_in_think=True)
    assert opened.feed("hm </thi") == [("reasoning", "hm")]
    assert opened.finish() == [("reasoning", " </thi")]


def _streamed(text: str, cuts: list[int], started_in_think: bool) -> tuple[str | None, str | None]:
    splitter = StreamingReasoningSplitter(started_in_think=started_in_think)
    pieces: list[tuple[Kind, str]] = []
    for a, b in itertools.pairwise([0, *sorted(cuts), len(text)]):
        pieces += splitter.feed(text[a:b])
    pieces += splitter.finish()
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # reasoning first, then content
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return reasoning or None, content or None


def test_a_reply_fed_one_character_at_a_time_splits_as_a_whole() -> None:
    for text in ("\n<think>\nadd them </think> </think>\n\nIt is 4 <think>", "a </think> b"):
        for started in (False, True):
            assert _streamed(text, list(range(len(text))), started) == split_reasoning(text, started)


@st.composite
def split_texts(draw: st.DrawFn) -> tuple[str, list[int]]:
    """A reply of tags, their pieces and words, and the points to cut it at."""
    pieces = st.sampled_from(["<think>", "</think>", "<th", "</th", "ink>", "<", "\n", " ", "add", "4", "é"])
    text = "".join(draw(st.lists(pieces, max_size=12)))
    return text, draw(st.lists(st.integers(0, len(text)), max_size=8))


@given(split_texts(), st.booleans())
def test_the_streamed_split_equals_the_whole_split_however_the_text_is_split(
        split: tuple[str, list[int]], started_in_think: bool) -> None:
    text, cuts = split
    assert _streamed(text, cuts, started_in_think) == split_reasoning(text, started_in_think)
