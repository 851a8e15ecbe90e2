"""Structured outputs: a request's ``Constraint`` compiled to a grammar that masks its logits.

Built on llguidance (the grammar engine llama.cpp uses), chosen by measurement
(``bench/structured.py``, ``bench/LOG.md``) over xgrammar (vLLM's, SGLang's): on a 65k
byte-level BPE vocabulary, a realistic nested JSON schema compiles in 3-4 ms against xgrammar's
70-100 ms (an untrusted schema arrives with each request, so compile time is on the request's
path), and a token's mask takes 0.07-0.08 ms on average (1.5 ms at worst, in length-bounded
strings) against xgrammar's 0.006 ms: both far below a decode step (16 constrained streams of
the demo model run at 99% of free ones). And llguidance is one 7.8 MB wheel with no
dependencies, where xgrammar requires transformers and triton (1.1 GB installed); TinyLoop may
not depend on transformers. llguidance also has what the engine needs: bounded compiles and
mask steps (``LLParserLimits``), cheap copies (beams, ``n``), rollback (speculation), and a Lark
dialect that embeds JSON schemas (tool calls).

The API (``compile.py``, ``matcher.py``, ``masks.py``):

- ``validate(constraint, tokenizer)``: raise ``RequestError(param="response_format")`` for a
  bad schema, regex, grammar or tool-call spec; compiles and caches the grammar (the HTTP layer
  calls it before admission, and the engine then finds it compiled).
- ``matcher_for(request, tokenizer) -> Matcher | None``: a new sequence's matcher
  (``Engine.start``); ``fork(matcher)`` a copy; ``advance(seq, token)`` on each accepted token.
- ``Matcher``: ``fill(words)`` (the allowed-token bitmask), ``accept(token) -> bool``,
  ``rollback(n)``, ``is_terminated()`` (only end-of-text may follow), ``can_end()``.
- ``constrain_rows(logits, matchers, buffer)``: mask a batch's constrained rows in place.

The ``grammar`` kind takes llguidance's Lark dialect (``compile.py`` says what each kind means).
"""

from __future__ import annotations

from tinyloop.grammar.compile import JSON_FORMAT as JSON_FORMAT
from tinyloop.grammar.compile import MAX_SOURCE_CHARS as MAX_SOURCE_CHARS
from tinyloop.grammar.compile import MAX_TOOLS as MAX_TOOLS
from tinyloop.grammar.compile import grammar_text as grammar_text
from tinyloop.grammar.compile import validate as validate
from tinyloop.grammar.masks import MaskBuffer as MaskBuffer
from tinyloop.grammar.masks import apply_words as apply_words
from tinyloop.grammar.masks import constrain_rows as constrain_rows
from tinyloop.grammar.masks import node_masks as node_masks
from tinyloop.grammar.masks import words_per_row as words_per_row
from tinyloop.grammar.matcher import Matcher as Matcher
from tinyloop.grammar.matcher import advance as advance
from tinyloop.grammar.matcher import fork as fork
from tinyloop.grammar.matcher import matcher_for as matcher_for
from tinyloop.grammar.vocab import token_info as token_info

__all__ = [
    "JSON_FORMAT",
    "MAX_SOURCE_CHARS",
    "MAX_TOOLS",
    "MaskBuffer",
    "Matcher",
    "advance",
    "apply_words",
    "constrain_rows",
    "fork",
    "grammar_text",
    "matcher_for",
    "node_masks",
    "token_info",
    "validate",
    "words_per_row",
]
