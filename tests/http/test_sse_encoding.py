"""The native /generate stream's token events, spliced without a dict, are byte for byte what
the generic SSE encoder makes of the same event."""

from __future__ import annotations

import json

from tinyloop.http.native import _chunk_event
from tinyloop.http.service import sse
from tinyloop.requests import GenerationChunk, TokenLogprob


def test_spliced_events_match_the_generic_encoder() -> None:
    rid = "gen-0123456789abcdef01234567"
    head = b'data: {"id":' + json.dumps(rid).encode() + b',"index":'
    chunks = [GenerationChunk(7, "<7>", 0, None, 8), GenerationChunk(0, "", 3, None, 1),
              GenerationChunk(12, 'quote " back \\ nl \n tab \t', 41, None, 64),
              GenerationChunk(5, "ünï \u2028 😀 \x00", 2, None, 4),
              GenerationChunk(9, "x", 1, None, None),
              GenerationChunk(9, "x", 1, TokenLogprob(9, -0.25), 8)]
    for c in chunks:
        event = {"id": rid, "index": c.index, "token_id": c.token_id, "text": c.text, "loops": c.loops_used}
        if c.logprob is not None:
            event["logprob"] = c.logprob.logprob
        assert _chunk_event(head, rid, c) == sse(event), c
