"""llguidance's view of a TinyLoop tokenizer: every token's bytes, the special ids and the EOS ids.

Built once per ``Tokenizer`` (about 0.3 s for 65k tokens) and kept as long as the tokenizer
lives. Built from ``Tokenizer.token_bytes`` rather than the tokenizer JSON so that the bytes the
grammar matches are exactly the bytes TinyLoop streams; special tokens are marked special, so
no grammar can spell ``<|im_end|>`` as text, and every id in ``eos_ids`` may end a constrained
output where the grammar may end.
"""

from __future__ import annotations

import threading
import weakref

import llguidance

from tinyloop.tokenizer import Tokenizer

__all__ = ["token_info"]

_lock = threading.Lock()
_infos: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()


class _Wrapper(llguidance.TokenizerWrapper):
    """What ``llguidance.LLTokenizer`` reads off a tokenizer (the base class's attributes; its
    ``__init__`` wraps a different kind of tokenizer, so it is not called)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.is_tokenizer_wrapper = True
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i, skip_special=False) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:  # llguidance tokenizes forced text with it
        return self._tokenizer.encode(text)


def token_info(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The ``LLTokenizer`` of ``tokenizer``, built on first use and cached while it lives."""
    with _lock:
        info = _infos.get(tokenizer)
        if info is None:
            info = llguidance.LLTokenizer(_Wrapper(tokenizer), n_vocab=tokenizer.vocab_size,
                                          eos_token=sorted(tokenizer.eos_ids))
            _infos[tokenizer] = info
        return info
