"""Token acceptance: append a chosen token to a sequence, with stop checks and detokenisation.

Every mode emits its tokens through ``accept_token`` (a sampled token, a verified speculative
run, a finished beam search's best hypothesis), so stop strings, stop tokens, EOS, ``max_tokens``
and the streamed text are the same whatever chose the token.

``min_tokens``: as vLLM's stop checker, nothing but ``max_tokens`` ends a request before its
output has ``min_tokens`` tokens: sampling keeps EOS and stop tokens out until then
(``sampling.bias_and_mask``), and a stop string completed earlier stays in the text.
``include_stop_str_in_output`` keeps the matched stop string in the text (``StopMatcher``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable

from tinyloop.engine.sequence import Sequence, TokenEvent
from tinyloop.grammar import advance
from tinyloop.requests import TokenLogprob

__all__ = ["Emission", "accept_run", "accept_token"]

Emission = tuple[int, TokenLogprob | None]  # a token to append and its logprob


def accept_token(seq: Sequence, token: int, logprob: TokenLogprob | None, eos_ids: Collection[int]) -> TokenEvent:
    """Append a sampled token: stop checks, detokenisation, bookkeeping."""
    advance(seq, token)  # a constrained request's grammar matcher (tinyloop.grammar): ends it when complete
    params = seq.request.sampling
    seq.output.append(token)
    seq.pending = token
    if logprob is not None:
        seq.logprobs.append(logprob)
    if seq.first_token_at is None:
        seq.first_token_at = time.perf_counter()
    armed = len(seq.output) >= params.min_tokens  # stops count from min_tokens on
    text, stopped = seq.stop_matcher.feed(seq.detokenizer.push(token), armed)
    if stopped:
        seq.finish("stop", "stop_string")
    elif armed and token in eos_ids and not params.ignore_eos:
        seq.finish("stop", "eos")
    elif armed and token in params.stop_token_ids:
        seq.finish("stop", "stop_token")
    elif len(seq.output) >= seq.request.max_tokens:
        seq.finish("length", "length")
    if seq.finished and not stopped:
        tail, stopped = seq.stop_matcher.feed(seq.detokenizer.flush(), armed)
        text += tail
        if stopped:
            seq.stop_reason = "stop_string"
            seq.finish_reason = "stop"
        else:
            text += seq.stop_matcher.flush()
    seq.text_parts.append(text)
    return TokenEvent(seq, token, text, len(seq.output) - 1, logprob,
                      seq.last_loops, seq.finished)


def accept_run(seq: Sequence, emissions: Iterable[Emission], eos_ids: Collection[int],
               loops_each: int = 0) -> list[TokenEvent]:
    """Append a run of tokens, stopping at the first stop condition; each token adds
    ``loops_each`` to the sequence's loop count."""
    events = []
    for token, logprob in emissions:
        seq.loops_total += loops_each
        events.append(accept_token(seq, token, logprob, eos_ids))
        if seq.finished:
            break
    return events
