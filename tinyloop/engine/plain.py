"""Plain decoding: one batched decode forward for the step's sequences, then sampling.

A lone greedy sequence (``sampling.is_plain_greedy``: no bias, penalties, logprobs or
``min_tokens``; no grammar or warm start) decodes a burst instead, where the model has a
whole-step C call (``LoopedLM.decode_burst``): up to ``decode_burst`` tokens in one call, each step fed
the argmax of the step before, with no Python between them. Its tokens are accepted one by one
as sampled ones are (stop strings, stop tokens, EOS, ``max_tokens``), and what follows a stop
is dropped with its KV (the sequence ends there). The tokens are the ones one step per token
picks; a stream gets them together, and a request that arrives meanwhile starts after the burst.

Also the fallback of the other modes (a speculative sequence that cannot speculate this step
decodes here) and the sampler of every prompt's first logits. A constrained row (structured
outputs, ``tinyloop.grammar``) has its grammar's refused tokens set to -inf before the sampler
sees it; the batch's free rows are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from tinyloop.engine.modes import Core, Finish, guard, no_events, reserve_or_fail
from tinyloop.engine.sampling import is_plain_greedy, sample_batch, token_logprob
from tinyloop.engine.sequence import ModeState, Sequence, TokenEvent
from tinyloop.errors import EngineBroken, EngineError, KVCacheExhausted, RequestError
from tinyloop.grammar import MaskBuffer, constrain_rows
from tinyloop.model.looped import Burst, RowSpec

__all__ = ["DEFAULT_DECODE_BURST", "PlainDecoding", "check_burst"]

# A lone greedy sequence decodes up to this many tokens per step where the model has a whole-step
# C call (bench/LOG.md 2026-12-03: int4 1.34x, int8 1.24x, float32 1.05x tokens/s of one token a
# step at batch 1 on base100m); 1 runs one step per token
DEFAULT_DECODE_BURST = 8
MAX_DECODE_BURST = 64


def check_burst(n: object) -> int:
    """``decode_burst`` checked: an int from 1 to ``MAX_DECODE_BURST``."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_DECODE_BURST:
        raise RequestError(f"decode_burst must be an integer from 1 to {MAX_DECODE_BURST}, got {n!r}",
                           param="decode_burst")
    return n


class PlainDecoding:
    """The plain mode's strategy (``modes.Strategy``), and the decode and sampling every mode
    falls back to."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.masks = MaskBuffer()  # the constrained rows' grammar bitmasks, reused step to step

    def new_state(self, seq: Sequence) -> ModeState | None:
        return None

    def prepare(self, seqs: list[Sequence]) -> list[Sequence]:
        return reserve_or_fail(seqs)

    def plan(self, seqs: list[Sequence]) -> tuple[Finish, list[Sequence]]:
        return no_events, seqs

    def first(self, seq: Sequence, logits: torch.Tensor) -> list[TokenEvent] | None:
        return None

    def decode(self, seqs: list[Sequence]) -> list[tuple[Sequence, torch.Tensor]]:
        """``core.decode(seqs)``; when the batched forward raises, each sequence alone."""
        if not seqs:
            return []
        saved = [(s.pending, s.kv.length, s.loops_total, s.last_loops, s.warm_state) for s in seqs]
        try:
            return list(zip(seqs, self.core.decode(seqs)))
        except EngineBroken:
            raise
        except Exception as exc:
            if len(seqs) == 1:
                seqs[0].fail(exc)
                return []
            for s, (pending, length, total, last, warm) in zip(seqs, saved):  # as before the call
                s.pending, s.kv.length, s.loops_total, s.last_loops, s.warm_state = pending, length, total, last, warm
        out = []
        for s in seqs:
            logits = guard(s, self.core.decode, [s])
            if logits is not None:
                out.append((s, logits[0]))
        return out

    def burst(self, seq: Sequence) -> list[TokenEvent] | None:
        """A lone sequence's burst (the module docstring) and the events of the tokens it
        accepts; None where it does not burst this step (it decodes one token)."""
        params = seq.request.sampling
        n = min(self.core.decode_burst, seq.request.max_tokens - len(seq.output),
                self.core.max_seq_len - seq.kv.length)
        if (n < 2 or seq.matcher is not None or seq.request.warm_start or not is_plain_greedy(params)
                or getattr(self.core.model, "fused_step", None) is None):  # (Inkling-2's has none)
            return None
        start = seq.kv.length
        try:
            done = self._run_burst(seq, n)
        except KVCacheExhausted:
            return None  # no room for the burst: one token, whose block prepare reserved
        except EngineBroken:
            raise
        except Exception as exc:
            seq.fail(exc)
            return []
        if done is None:
            return None
        seq.pending, seq.last_loops = None, seq.loops
        events = []
        for token in done.tokens:  # as sampled ones: the first stop ends the sequence, the rest is dropped
            seq.loops_total += seq.loops
            event = guard(seq, self.core.accept, seq, token, None)
            if event is None:
                break
            events.append(event)
            if seq.finished:
                break
        seq.kv.length = start + len(events)  # the positions of the tokens fed to pick them
        if done.unusable and not seq.finished:
            seq.fail(EngineError("the model produced non-finite logits for this request"))
        return events

    @torch.inference_mode()
    def _run_burst(self, seq: Sequence, n: int) -> Burst | None:
        """Up to ``n`` greedy steps of ``seq`` in one call (``LoopedLM.decode_burst``), the first
        fed its pending token, its KV blocks reserved for all ``n``; nothing else of it changes."""
        core, start, params = self.core, seq.kv.length, seq.request.sampling
        seq.kv.reserve(start + n)
        ctx = core.context([seq.kv], [start], n)
        spec = RowSpec(loops=seq.loops, window=seq.window, start=start, noise_seed=seq.noise_seed, exit=seq.exit)
        stops = tuple(sorted({*params.stop_token_ids, *(() if params.ignore_eos else core.eos_ids)}))
        assert seq.pending is not None
        return core.model.decode_burst(seq.pending, ctx, spec, n, core.vocab_limit, stops)

    def sample(self, seqs: list[Sequence], rows: list[torch.Tensor]) -> list[TokenEvent]:
        """Sample every row and accept its token; a row with NaN or +inf logits, or with no
        finite one, fails its own sequence only (as does a sampler or stop-check failure)."""
        if len(rows) == 1 and seqs[0].matcher is None:  # (nothing writes into it: no copy)
            logits = rows[0].float().unsqueeze(0).contiguous()  # [1, V]
        else:
            logits = torch.stack(rows).float()  # [B, V]
        raw = {id(s): logits[i].clone() for i, s in enumerate(seqs) if s.matcher is not None and _reports(s)}
        seqs, logits = self._constrain(seqs, logits)  # grammar masks on the constrained rows
        if not seqs:
            return []
        # Greedy rows draw nothing: only the others' generators need saving for a retry.
        states = [(s, s.generator.get_state()) for s in seqs if not s.request.sampling.greedy]
        try:  # (on a GPU: one wait for the device, the step's only one)
            results: list[Any] = sample_batch(logits, [s.request.sampling for s in seqs], [s.generator for s in seqs],
                                              [s.prompt for s in seqs], [s.output for s in seqs], self.core.eos_ids)
        except Exception:  # find the row that raised: every other row samples as it would have
            for s, state in states:
                s.generator.set_state(state)  # rows before the one that raised drew already
            results = [guard(s, _sample_one, s, logits[i], self.core.eos_ids) for i, s in enumerate(seqs)]
        events = []
        for s, r in zip(seqs, results):
            if r is None:  # no usable logits (or the sampler failed the sequence already)
                if s.error is None:
                    s.fail(EngineError("the model produced non-finite logits for this request"))
                continue
            logprob = r.logprob if id(s) not in raw else token_logprob(raw[id(s)], r.token_id, s.request.sampling)
            event = guard(s, self.core.accept, s, r.token_id, logprob)  # (logprobs: of the logits before a mask)
            if event is not None:
                events.append(event)
        return events

    def _constrain(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """Each constrained row's logits with its grammar's refused tokens at -inf (in place;
        ``tinyloop.grammar``), before the sampler's own adjustments; the rows left to sample: a
        row whose matcher failed fails its own sequence."""
        if all(s.matcher is None for s in seqs):
            return seqs, logits
        try:
            failed = constrain_rows(logits, [s.matcher for s in seqs], self.masks)
        except EngineBroken:
            raise
        except Exception as exc:
            failed = [i for i, s in enumerate(seqs) if s.matcher is not None]
            for i in failed:
                seqs[i].fail(exc)
        for i in failed:
            if not seqs[i].finished:
                seqs[i].fail(EngineError(f"the {seqs[i].matcher.kind} constraint failed: {seqs[i].matcher.error}"))
        if not failed:
            return seqs, logits
        keep = [i for i in range(len(seqs)) if i not in failed]
        return [seqs[i] for i in keep], logits[keep]


def _reports(seq: Sequence) -> bool:
    return seq.request.sampling.logprobs or seq.request.sampling.top_logprobs > 0


def _sample_one(seq: Sequence, row: torch.Tensor, eos_ids: frozenset[int]) -> Any:
    return sample_batch(row[None], [seq.request.sampling], [seq.generator], [seq.prompt],
                        [seq.output], eos_ids)[0]
