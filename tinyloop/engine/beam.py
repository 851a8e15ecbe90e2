"""Beam search on forked sequences: the beams of one request share their KV blocks copy-on-write.

A beam request (``mode="beam"``) is one ``Sequence`` to the runtime. Its prompt is prefilled as
usual; from the prompt's logits on, ``BeamSearch`` keeps up to ``num_beams`` live beams, each a
private ``Sequence`` over ``kv.fork()`` of its parent. Each engine step decodes every live beam
of every beam request in one batched forward, scores the ``2 * num_beams`` best extensions by
cumulative logprob (``log_softmax`` of the raw logits plus ``logit_bias``, EOS and stop tokens at
-inf before ``min_tokens``: ``sampling.bias_and_mask``; nothing is sampled), and keeps the best
``num_beams`` that do not end: a beam extended by several candidates is forked, a beam extended
by none is freed. An extension that ends (EOS, a stop token, ``max_tokens``) becomes a finished
hypothesis scored ``sum_logprob / len ** length_penalty`` (HF's convention).

The search stops when no live beam can still beat the worst of the ``num_beams`` best finished
hypotheses (an exact bound: logprobs are <= 0, so the best a live beam can reach is its current
sum over the largest length the penalty favours). The best hypothesis is then replayed through
``output.accept_token`` so stop strings, detokenisation and the result are those of any request, and
all its tokens are emitted as TokenEvents in that one step (a stream gets a single burst).

Under a grammar (structured outputs) each beam carries its own copy of the request's matcher:
its extensions score -inf where its grammar refuses them, and one whose token completes the
grammar ends as a finished hypothesis.

With ``num_beams == 1`` only the best extension is considered: greedy decoding. The logprobs a
request asks for are those of the raw logits, as in every mode (they differ from the scores only
under a bias or ``min_tokens``); scores stay <= 0 either way, so the bound above holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from tinyloop import grammar
from tinyloop.engine.modes import Core, Finish
from tinyloop.engine.output import accept_run
from tinyloop.engine.sampling import bias_and_mask
from tinyloop.engine.sequence import ModeState, Sequence, TokenEvent
from tinyloop.errors import EngineBroken, EngineError, KVCacheExhausted
from tinyloop.requests import GenerationResult, TokenLogprob

__all__ = ["Beam", "BeamDecoding", "BeamState", "BeamSearch", "beam_score"]


def beam_score(sum_logprob: float, length: int, length_penalty: float) -> float:
    """HF's length-normalised score of a hypothesis of ``length`` generated tokens."""
    return float(sum_logprob / max(length, 1) ** length_penalty)


@dataclass(eq=False)
class Beam:
    """A live beam: a private sequence (its KV forked from its parent's) and its tokens so far."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[float]
    sum_logprob: float


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: its tokens, their logprobs and its score."""

    score: float
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    loops_total: int


@dataclass(eq=False)
class BeamState:
    """One beam request's search (its ``modes.ModeState``): live beams and the best finished
    hypotheses, best first; ``score`` the returned hypothesis's, once the search ends."""

    num_beams: int
    length_penalty: float
    live: list[Beam] = field(default_factory=list)
    done: list[Hypothesis] = field(default_factory=list)
    score: float | None = None

    def release(self) -> None:
        self.free()

    def contribute(self, result: GenerationResult) -> GenerationResult:
        return dataclasses.replace(result, beam_score=self.score)

    def blocks(self) -> int:
        return sum(b.seq.kv.num_blocks for b in self.live)

    def free(self) -> None:
        for b in self.live:
            b.seq.kv.free()
        self.live.clear()

    def add_done(self, hyp: Hypothesis) -> None:
        self.done.append(hyp)
        self.done.sort(key=lambda h: -h.score)
        del self.done[self.num_beams:]

    def settled(self, max_tokens: int) -> bool:
        """No live beam can still enter the ``num_beams`` best finished hypotheses."""
        if not self.live:
            return True
        if len(self.done) < self.num_beams:
            return False
        worst = self.done[-1].score
        return all(self._best_reachable(b, max_tokens) <= worst for b in self.live)

    def _best_reachable(self, beam: Beam, max_tokens: int) -> float:
        # The sum only falls as tokens are added; the length that helps most is the longest
        # one for a positive penalty and the next one otherwise.
        length = max_tokens if self.length_penalty > 0 else len(beam.tokens) + 1
        return beam_score(beam.sum_logprob, length, self.length_penalty)


class BeamDecoding:
    """The beam mode's strategy (``modes.Strategy``): a search starts from the prompt's logits
    and extends its beams after the step's sampling; a search that raises fails alone."""

    def __init__(self, core: Core) -> None:
        self.search = BeamSearch(core)

    def new_state(self, seq: Sequence) -> ModeState | None:
        return None  # the search begins once the prompt is prefilled

    def prepare(self, seqs: list[Sequence]) -> list[Sequence]:
        return seqs  # each live beam reserves its own next position (BeamSearch.step)

    def first(self, seq: Sequence, logits: torch.Tensor) -> list[TokenEvent] | None:
        return self.search.begin(seq, logits)

    def plan(self, seqs: list[Sequence]) -> tuple[Finish, list[Sequence]]:
        return (lambda: self._step_isolated(seqs)), []

    def _step_isolated(self, seqs: list[Sequence]) -> list[TokenEvent]:
        if not seqs:
            return []
        try:
            return self.search.step(seqs)
        except EngineBroken:
            raise
        except Exception as exc:
            if len(seqs) == 1:
                self.search.fail(seqs[0], exc)
                return []
        events: list[TokenEvent] = []
        for s in seqs:
            try:
                events.extend(self.search.step([s]))
            except EngineBroken:
                raise
            except Exception as exc:
                self.search.fail(s, exc)
        return events


class BeamSearch:
    """Drives the beam requests of an engine's step (see the module docstring)."""

    def __init__(self, core: Core) -> None:
        self.engine = core
        self.masks = grammar.MaskBuffer()  # constrained beams' grammar bitmasks

    def begin(self, seq: Sequence, logits: torch.Tensor) -> list[TokenEvent]:
        """The prompt's last logits ``[V]`` are in: start the search from one beam."""
        num_beams, length_penalty = seq.request.beam or (1, 1.0)
        state = BeamState(num_beams, length_penalty)
        seq.mode_state = state
        root = Beam(self._branch(seq), [], [], 0.0)
        root.seq.loops_total = 0
        state.live = [root]
        return self._extend(seq, logits[None])

    def step(self, seqs: Seq[Sequence]) -> list[TokenEvent]:
        """Decode every live beam of ``seqs`` in one batched forward and extend the searches."""
        ok = []
        for s in seqs:
            try:
                for b in self._state(s).live:
                    b.seq.kv.reserve(b.seq.kv.length + 1)
            except KVCacheExhausted as exc:
                self.fail(s, exc)
            else:
                ok.append(s)
        if not ok:
            return []
        beams = [b.seq for s in ok for b in self._state(s).live]
        logits = self.engine.decode(beams)  # [sum of live beams, V]
        events: list[TokenEvent] = []
        row = 0
        for s in ok:
            n = len(self._state(s).live)
            try:
                events.extend(self._extend(s, logits[row:row + n]))
            except Exception as exc:  # this search's bookkeeping: it fails alone
                self.fail(s, exc)
            row += n
        return events

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        if seq.mode_state is not None:
            seq.mode_state.release()
        seq.fail(exc)

    # -- one extension -------------------------------------------------------------------------
    @staticmethod
    def _state(seq: Sequence) -> BeamState:
        assert isinstance(seq.mode_state, BeamState), "a beam sequence runs a search once prefilled"
        return seq.mode_state

    def _branch(self, seq: Sequence) -> Sequence:
        """A private copy of ``seq`` for one beam, sharing its KV blocks copy-on-write."""
        return dataclasses.replace(seq, kv=seq.kv.fork(), output=[], text_parts=[], logprobs=[],
                                   mode_state=None, matcher=grammar.fork(seq.matcher))

    @torch.inference_mode()
    def _extend(self, seq: Sequence, logits: torch.Tensor) -> list[TokenEvent]:
        """Extend the live beams with their best next tokens (``logits`` ``[beams, V]``)."""
        state = self._state(seq)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V] raw: what is reported
        scores = self._constrained(state, self._scores(seq, state, logits.float(), logprobs))  # [B, V]
        sums = torch.tensor([b.sum_logprob for b in state.live], dtype=torch.float32, device=logprobs.device)
        totals = (sums[:, None] + scores).flatten()  # [B * V]
        k = min(2 * state.num_beams if state.num_beams > 1 else 1, totals.numel())
        top, idx = totals.topk(k)
        vocab = logprobs.shape[1]
        chosen: list[tuple[Beam, int, float, float]] = []
        for total, i in zip(top.tolist(), idx.tolist()):
            beam, token = state.live[i // vocab], i % vocab
            lp = float(logprobs[i // vocab, token])
            if total == float("-inf"):  # kept out (min_tokens): fewer candidates than k are left
                break
            if self._ends(seq, beam, token):
                tokens = beam.tokens + [token]
                state.add_done(Hypothesis(beam_score(total, len(tokens), state.length_penalty),
                                          tuple(tokens), tuple(beam.logprobs + [lp]),
                                          beam.seq.loops_total))
            elif len(chosen) < state.num_beams:
                # raw scores: the logprob as the sums' float32 arithmetic has it (they add up exactly)
                chosen.append((beam, token, total, total - beam.sum_logprob if scores is logprobs else lp))
            if len(chosen) == state.num_beams:
                break
        state.live = self._advance(state.live, chosen)
        if not state.settled(seq.request.max_tokens):
            return []
        return self._finish(seq)

    def _scores(self, seq: Sequence, state: BeamState, logits: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """What each live beam's extensions score ``[B, V]``: the raw ``logprobs``, or under a
        bias or ``min_tokens`` the ``log_softmax`` of the logits they adjust (each beam counts
        its own tokens toward ``min_tokens``)."""
        params = seq.request.sampling
        if not params.logit_bias and params.min_tokens == 0:
            return logprobs
        rows = [bias_and_mask(row, params, len(b.tokens), self.engine.eos_ids) for row, b in zip(logits, state.live)]
        return torch.log_softmax(torch.stack(rows), dim=-1)

    def _constrained(self, state: BeamState, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` ``[B, V]`` with what each beam's grammar refuses at -inf (a constrained
        request's beams each carry their own matcher)."""
        matchers = [b.seq.matcher for b in state.live]
        if all(m is None for m in matchers):
            return scores
        scores = scores.clone()  # (may be the reported logprobs themselves)
        if grammar.constrain_rows(scores, matchers, self.masks):
            raise EngineError("a beam's grammar matcher failed: " + next(m.error for m in matchers if m.failed))
        return scores

    def _ends(self, seq: Sequence, beam: Beam, token: int) -> bool:
        params = seq.request.sampling
        return (len(beam.tokens) + 1 >= seq.request.max_tokens
                or token in params.stop_token_ids
                or (token in self.engine.eos_ids and not params.ignore_eos)
                or (beam.seq.matcher is not None and beam.seq.matcher.completes(token)))  # the grammar's end

    def _advance(self, live: list[Beam], chosen: list[tuple[Beam, int, float, float]]) -> list[Beam]:
        """The next live beams (each chosen extension: its beam, token, score and raw logprob):
        fork a beam chosen twice or more, free one chosen by none."""
        used: set[int] = set()
        out = []
        for beam, token, total, lp in chosen:
            if id(beam) in used:
                seq = self._branch(beam.seq)
            else:
                used.add(id(beam))
                seq = beam.seq
            # The forks above read the parent's token lists, so build new ones for every child.
            out.append(Beam(seq, beam.tokens + [token], beam.logprobs + [lp], total))
            seq.pending = token
        for child in out:  # after every fork above: each copied its parent's grammar state before the token
            if child.seq.matcher is not None and not child.seq.matcher.accept(child.tokens[-1]):
                raise EngineError(f"the {child.seq.matcher.kind} constraint refused beam token {child.tokens[-1]}")
        for beam in live:
            if id(beam) not in used:
                beam.seq.kv.free()
        return out

    def _finish(self, seq: Sequence) -> list[TokenEvent]:
        """Replay the best hypothesis into the request's sequence; free every beam."""
        state = self._state(seq)
        state.free()
        best = state.done[0]
        state.score = best.score
        seq.loops_total += best.loops_total
        want = seq.request.sampling.logprobs or seq.request.sampling.top_logprobs > 0
        return accept_run(seq, [(token, TokenLogprob(token, lp) if want else None)
                                for token, lp in zip(best.tokens, best.logprobs)], self.engine.eos_ids)

