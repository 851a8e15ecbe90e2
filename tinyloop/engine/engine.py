"""The engine: a loaded looped model, its paged KV pool, and the steps of the engine contract.

Sequence-level, so batching, the prefix pool and speculation share one mechanism:

- ``start(request) -> Sequence``  validate and set up (no model work, no KV yet)
- ``prefill_step(seq)``           run the next ``prefill_chunk`` prompt tokens; ``prefill`` all
- ``decode(seqs) -> logits``      one token for each sequence, one batched call
- ``step(seqs) -> events``        one iteration: a prefill chunk for new sequences, a decode
                                  step for the rest, sampling, stop checks, detokenisation; a
                                  speculative sequence (``mode`` ``speculative`` or ``tree``)
                                  drafts and verifies instead and may emit several tokens
                                  (``speculative.py``); a beam sequence (``mode`` ``beam``)
                                  extends its beams and emits its tokens once done (``beam.py``)
- ``fork(seq)`` / ``free(seq)``   share a KV prefix copy-on-write / give the KV back

With ``prefix_caching`` (automatic prefix caching, ``model/blockcache.py``) ``free`` keeps a
sequence's full, computed blocks in the pool's cache and ``start`` reuses the longest cached run
of a new prompt's blocks, so only the rest is prefilled.

Every method is blocking and runs on the caller's thread: the runtime calls it from a worker
thread. One engine is driven by one thread at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence as Seq
from os import PathLike
from typing import Any, TypeVar

import torch

from tinyloop.engine.beam import BeamSearch, release as release_beams
from tinyloop.engine.sampling import StopMatcher, make_generator, sample_batch
from tinyloop.engine.sequence import Sequence, TokenEvent
from tinyloop.engine.speculative import Emission, Speculator
from tinyloop.errors import EngineBroken, EngineError, KVCacheExhausted, PromptTooLongError, RequestError
from tinyloop.model.config import ModelConfig
from tinyloop.model.blockcache import block_keys
from tinyloop.model.context import PagedContext
from tinyloop.model.kvcache import KVDemand, KVPool, KVPoolStats, SeqKV, slot_count
from tinyloop.vocabulary import KVMode
from tinyloop.model.looped import ForwardOutput, LoopedLM, RowSpec
from tinyloop.requests import GenerationChunk, GenerationRequest, GenerationResult
from tinyloop.tokenizer import Tokenizer

__all__ = ["Engine"]

_T = TypeVar("_T")
_log = logging.getLogger(__name__)

DEFAULT_KV_BUDGET_MB = 1024
DEFAULT_MAX_DRAFT_NODES = 64
# The randn initial state depends on the token position only (never on the request), so the KV
# of a prompt prefix is the same for every request: prefix sharing and reproducible greedy
# decoding both rely on it.
NOISE_SEED = 0


class Engine:
    """A looped model ready to serve: model, tokenizer, KV pool and limits."""

    def __init__(self, model: LoopedLM, tokenizer: Tokenizer, *, max_seq_len: int | None = None,
                 kv_cache_mb: float | None = None, block_size: int = 16, prefill_chunk: int = 512,
                 chat_template: str | None = None, name: str = "tinyloop",
                 kv_mode: KVMode | str | None = None, prefix_caching: bool = True,
                 max_draft_nodes: int = DEFAULT_MAX_DRAFT_NODES) -> None:
        self.model = model.eval()
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.name = name
        self.chat_template = chat_template or tokenizer.chat_template
        self.max_seq_len = max_seq_len or self.config.max_position
        if self.max_seq_len > self.config.max_position:
            raise RequestError(f"max_seq_len {self.max_seq_len} exceeds the model's max_position "
                               f"{self.config.max_position}", param="max_seq_len")
        if prefill_chunk < 1:
            raise RequestError("prefill_chunk must be >= 1", param="prefill_chunk")
        self.prefill_chunk = prefill_chunk
        if max_draft_nodes < 1:
            raise RequestError("max_draft_nodes must be >= 1", param="max_draft_nodes")
        self.max_draft_nodes = max_draft_nodes  # speculative draft tokens per step, all sequences
        self._vocab_limit = min(tokenizer.vocab_size, self.config.vocab_size)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.kv_mode = KVMode.parse(kv_mode)  # full, int4, h-mode, ... (kvmode.py)
        self.pool = KVPool(self.config, self._num_blocks(kv_cache_mb, block_size), block_size,
                           dtype=self.dtype, device=self.device, mode=self.kv_mode)
        self.speculator = Speculator(self)
        self.beam_search = BeamSearch(self)
        self.prefix_caching = prefix_caching
        self.prefilled_tokens = 0  # prompt tokens run through the model (cache hits excluded)

    @classmethod
    def load(cls, path: str | PathLike[str], *, max_seq_len: int | None = None, device: str = "cpu",
             dtype: torch.dtype | None = None, **options: Any) -> Engine:
        """Load a ``.tinyloop`` artifact; ``options`` go to the constructor (kv_cache_mb, ...)."""
        from tinyloop.model.artifact import load_artifact

        art = load_artifact(path, max_seq_len=max_seq_len, device=device, dtype=dtype)
        options.setdefault("name", str(path).rsplit("/", 1)[-1].removesuffix(".tinyloop"))
        return cls(art.model, art.tokenizer, max_seq_len=max_seq_len,
                   chat_template=art.chat_template, **options)

    def _num_blocks(self, kv_cache_mb: float | None, block_size: int) -> int:
        c = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_block = self.kv_mode.slot_bytes(c, elem) * block_size  # the budget is in bytes
        if kv_cache_mb is None:
            # Room for 8 full-length sequences at the default loops, and for one at the most
            # loops (a larger request is refused, Engine.validate), capped by the budget.
            per_token = max(8 * self.kv_mode.bytes_per_token(c, c.default_loops, None, elem),
                            self.kv_mode.bytes_per_token(c, c.max_loops, None, elem))
            need = per_token * self.max_seq_len
            budget = min(need, DEFAULT_KV_BUDGET_MB * 2**20)
        else:
            budget = int(kv_cache_mb * 2**20)
        return max(1, budget // per_block)

    # -- introspection -------------------------------------------------------------------------
    @property
    def default_loops(self) -> int:
        return self.config.default_loops

    def kv_statistics(self) -> KVPoolStats:
        return self.pool.statistics()

    def kv_blocks_needed(self, req: GenerationRequest) -> int:
        """KV blocks ``req`` holds at most: every slot's table at its full length (prompt plus
        ``max_tokens``), times the beams of a beam search. Speculation needs no more: it falls
        back to plain decoding when blocks are short."""
        return self._worst_blocks(req, *self.validate(req))

    def _worst_blocks(self, req: GenerationRequest, loops: int, window: int) -> int:
        length = min(len(req.prompt_tokens) + req.max_tokens, self.max_seq_len)
        per_slot = -(-length // self.pool.block_size)
        beams = req.beam[0] if req.beam is not None else 1
        return slot_count(self.config, loops, window) * per_slot * beams

    def reserves_worst_case(self, req: GenerationRequest) -> bool:
        """Whether ``req`` sets its worst-case KV aside when it starts instead of growing and
        being preemptible: a recompute would not reproduce the KV of a warm-start or
        adaptive-exit sequence (decoding ran each token differently from a prefill), and a beam
        search's beams are not one sequence."""
        rule = req.exit or self.config.exit
        return req.warm_start or rule.kind != "none" or req.mode == "beam"

    def kv_start_blocks(self, req: GenerationRequest) -> int:
        """Blocks ``req`` needs to start: its worst case when it reserves one, else its prompt
        and first token (prefix-cache hits may make it less)."""
        loops, window = self.validate(req)
        if self.reserves_worst_case(req):
            return self._worst_blocks(req, loops, window)
        return slot_count(self.config, loops, window) * -(-(len(req.prompt_tokens) + 1) // self.pool.block_size)

    def kv_demand(self, seq: Sequence) -> KVDemand:
        """What ``seq`` asks of the pool next (the engine actor's planning input)."""
        kv = seq.kv
        target = seq.context_length if seq.prefilling else kv.length + 1
        slots = kv.n_slots
        if seq.prefill_only or self.reserves_worst_case(seq.request):
            worst = self._worst_blocks(seq.request, seq.loops, seq.window)
            held = kv.num_blocks + (seq.beam.blocks() if seq.beam is not None else 0)
            return KVDemand(0, max(worst - held, 0), False, 0)
        return KVDemand(kv.blocks_to_reserve(target), 0, True, slots)

    def kv_available(self) -> int:
        """Blocks the pool can hand out now: free ones and idle prefix-cache ones."""
        stats = self.pool.statistics()
        return stats.blocks_free + stats.blocks_cached

    def preempt(self, seq: Sequence) -> None:
        """Give ``seq``'s KV back now and rebuild it later: its next steps prefill the prompt and
        every output token but the pending one (through the prefix cache where it kept them),
        then decoding goes on where it stopped, with the same tokens as without the pause."""
        if self.reserves_worst_case(seq.request) or seq.prefill_only:
            raise ValueError(f"{seq!r} cannot be preempted: a recompute would change its KV")
        self.free(seq)
        seq.resumed = bool(seq.output)  # none yet: the prompt's last logits are still to sample
        seq.preemptions += 1

    def resume(self, seq: Sequence) -> None:
        """Before a preempted sequence runs again: take what the prefix cache kept of it."""
        cached = self._cached_blocks(seq)
        if cached:
            seq.kv.adopt(cached)

    def kv_bytes_per_token(self, loops: int | None = None, cache_window: int | None = None) -> int:
        loops = loops or self.config.default_loops
        return self.pool.bytes_per_token(loops, cache_window)

    def __repr__(self) -> str:
        return f"<Engine {self.name} max_seq_len={self.max_seq_len} {self.pool!r}>"

    # -- lifecycle of a sequence ---------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> tuple[int, int]:
        """Check a request against this model; returns its (loops, window)."""
        c = self.config
        loops = req.loops or c.default_loops
        if loops > c.max_loops:
            raise RequestError(f"loops must be <= {c.max_loops} for this model", param="loops")
        window = min(req.cache_window or loops, loops)
        if len(req.prompt_tokens) + req.max_tokens > self.max_seq_len:
            raise PromptTooLongError(len(req.prompt_tokens), req.max_tokens, self.max_seq_len)
        if max(req.prompt_tokens) >= c.vocab_size:
            raise RequestError(f"prompt token id {max(req.prompt_tokens)} is outside the "
                               f"vocabulary ({c.vocab_size})", param="prompt")
        rule = req.exit or c.exit
        if rule.kind == "gate" and c.exit.kind != "gate":
            raise RequestError("this model has no exit gate: use exit kind latent_diff or kl",
                               param="exit")
        if rule.min_loops > loops and rule.kind != "none":
            raise RequestError(f"exit.min_loops ({rule.min_loops}) exceeds loops ({loops})",
                               param="exit")
        if req.speculation is not None:
            self._validate_speculation(req, loops, window)
        worst = self._worst_blocks(req, loops, window)
        if worst > self.pool.num_blocks:
            raise RequestError(
                f"this request can hold up to {worst} KV blocks (prompt + max_tokens at {loops} "
                f"loops, cache_window {window}) but the whole KV pool has {self.pool.num_blocks}: "
                "lower max_tokens, loops or cache_window", param="max_tokens")
        return loops, window

    def _validate_speculation(self, req: GenerationRequest, loops: int, window: int) -> None:
        draft_loops, _, _ = req.speculation or (1, 0, 0)
        # A multi-token verify forward runs every token to its full loops: with an adaptive
        # exit rule plain decoding would stop some tokens earlier and emit other tokens.
        rule = req.exit or self.config.exit
        if rule.kind != "none":
            raise RequestError("speculative decoding is not available with an "
                               f"adaptive exit rule ({rule.kind}): verification "
                               "cannot exit per token, so the output would differ from plain "
                               "decoding", param="mode")
        if draft_loops > loops:
            raise RequestError(f"draft_loops ({draft_loops}) must be <= the verifier's loops "
                               f"({loops})", param="draft_loops")
        # With W < loops a token reads its predecessors' latest slot, which a multi-token
        # verify forward fills at the same loop instead: verification would change the output.
        if window < loops:
            raise RequestError("speculative decoding needs the full cache (cache_window >= loops)",
                               param="cache_window")

    def start(self, req: GenerationRequest, prefix: Sequence | None = None) -> Sequence:
        """A new sequence for ``req`` (validated; no model work, and no KV beyond shared blocks).

        With ``prefix`` (a prefilled sequence at the same loops and window whose prompt
        prefixes this one, see ``prefill_prefix``), the new sequence shares its KV blocks and
        only the rest of the prompt is prefilled: the output is the same as without it. With
        prefix caching on, cached blocks serve instead when they cover more of the prompt.
        ``seq.cached_tokens`` says how many prompt tokens were served either way.
        """
        loops, window = self.validate(req)
        seq = Sequence(
            request=req, loops=loops, window=window,
            kv=SeqKV(self.pool, slot_count(self.config, loops, window)),
            generator=make_generator(req.sampling.seed), noise_seed=NOISE_SEED,
            detokenizer=self.tokenizer.stream_decoder(),
            stop_matcher=StopMatcher(req.sampling.stop), prompt=list(req.prompt_tokens))
        # The last prompt token always runs, so the first output token has its logits.
        pool_hit = 0
        if prefix is not None:
            n = len(prefix.prompt)
            if (prefix.loops, prefix.window) != (loops, window) or seq.prompt[:n] != prefix.prompt:
                raise ValueError("prefix does not match the request's prompt, loops and window")
            pool_hit = min(n, len(seq.prompt) - 1)
        cached = self._cached_blocks(seq)
        if len(cached) * self.pool.block_size < pool_hit:
            self.pool.release([b for col in cached for b in col])
            cached = []
        if cached:
            seq.kv.adopt(cached)
        elif prefix is not None:
            seq.kv = prefix.kv.fork()
            seq.kv.truncate(pool_hit)
        seq.cached_tokens = seq.kv.length
        return seq

    def _salt(self, seq: Sequence) -> tuple[object, ...]:
        """What a block's KV depends on besides its tokens (the hash chain's salt): an adaptive
        exit rule changes the loops each position ran, and so its KV."""
        return (seq.loops, seq.window, seq.noise_seed, self.kv_mode.name, repr(seq.request.exit))

    def _cached_blocks(self, seq: Sequence) -> list[list[int]]:
        """The prefix cache's longest run of full blocks of ``seq``'s prompt (referenced for it);
        never the block of the last prompt token, which must run to give the first logits."""
        if not self._cacheable(seq):
            return []
        context = seq.context
        n = (len(context) - 1) // self.pool.block_size
        return self.pool.cache.lookup(block_keys(context, self.pool.block_size, n, self._salt(seq)))

    def _cacheable(self, seq: Sequence) -> bool:
        # With W < loops a token reads its predecessors' latest slot when they ran in an earlier
        # forward but the same loop's when they run in its own: a prefill that starts after
        # cached blocks would change the output, so only full-cache sequences take part.
        return self.prefix_caching and seq.window >= seq.loops

    def _cache_blocks(self, seq: Sequence) -> None:
        """Hand ``seq``'s full blocks of computed, request-independent KV to the prefix cache."""
        tokens = seq.tokens
        # Positions < kv.length are verified (speculation truncates its drafts away); a
        # warm-start request's decoded positions depend on its warm state, not its tokens, and
        # a beam sequence's output need not be the tokens its KV was decoded from.
        prompt_only = seq.request.warm_start or seq.request.mode == "beam"
        n = min(seq.kv.length, len(seq.prompt) if prompt_only else len(tokens))
        n_blocks = min(n // self.pool.block_size, seq.kv.blocks_per_slot)
        if n_blocks:
            keys = block_keys(tokens, self.pool.block_size, n_blocks, self._salt(seq))
            self.pool.cache.insert(keys, seq.kv.columns(n_blocks))

    @torch.inference_mode()
    def prefill_prefix(self, tokens: Seq[int], loops: int | None = None,
                       cache_window: int | None = None) -> Sequence:
        """Prefill ``tokens`` once and keep the KV (free it with ``free``): a prefix-pool entry."""
        seq = self.start_prefix(tokens, loops, cache_window)
        try:
            self.prefill(seq)
        except BaseException:
            self.free(seq)
            raise
        return seq

    def start_prefix(self, tokens: Seq[int], loops: int | None = None,
                     cache_window: int | None = None) -> Sequence:
        """A prefix-pool entry to be: ``step`` prefills it a chunk at a time beside the other
        sequences and samples nothing; once it is no longer ``prefilling`` it is ready."""
        seq = self.start(self._prefix_request(tokens, loops, cache_window))
        seq.prefill_only = True
        return seq

    def kv_prefix_blocks(self, tokens: Seq[int], loops: int | None = None,
                         cache_window: int | None = None) -> int:
        """Blocks a registered prefix of ``tokens`` holds (validated like a request)."""
        req = self._prefix_request(tokens, loops, cache_window)
        loops_, window = self.validate(req)
        return slot_count(self.config, loops_, window) * -(-len(tokens) // self.pool.block_size)

    @staticmethod
    def _prefix_request(tokens: Seq[int], loops: int | None, cache_window: int | None) -> GenerationRequest:
        return GenerationRequest(prompt_tokens=tuple(tokens), max_tokens=1, loops=loops,
                                 cache_window=cache_window)

    def fork(self, seq: Sequence) -> Sequence:
        """A copy of ``seq`` sharing its KV blocks copy-on-write (beam, prefix pool)."""
        child = self.start(seq.request)
        child.kv.free()  # whatever start found in the prefix cache: the parent's KV replaces it
        child.kv = seq.kv.fork()
        child.cached_tokens = seq.cached_tokens
        child.output = list(seq.output)
        child.pending = seq.pending
        child.warm_state = seq.warm_state
        child.prompt = list(seq.prompt)
        return child

    def free(self, seq: Sequence) -> None:
        """Give the sequence's KV blocks back to the pool (its full blocks to the prefix cache,
        when on). Safe to call twice."""
        release_beams(seq)
        if self._cacheable(seq):
            self._cache_blocks(seq)
        seq.kv.free()

    # -- model work ----------------------------------------------------------------------------
    def _spec(self, seq: Sequence, start: int, warm: bool) -> RowSpec:
        return RowSpec(loops=seq.loops, window=seq.window, start=start, noise_seed=seq.noise_seed,
                       warm_state=seq.warm_state if warm else None, exit=seq.request.exit)

    def run_model(self, tokens: torch.Tensor, ctx: Any, specs: Seq[RowSpec],
                  last_only: bool = True) -> ForwardOutput:
        """One model forward; rows of the embedding past the tokenizer's vocabulary (padding in
        the checkpoint) get -inf logits, so sampling can never pick a token nobody can decode."""
        out: ForwardOutput = self.model(tokens, ctx, specs, last_only=last_only)
        if self._vocab_limit < out.logits.shape[-1]:
            out.logits[..., self._vocab_limit:] = float("-inf")
        return out

    def _forward(self, seqs: Seq[Sequence], tokens: torch.Tensor, warm: bool) -> ForwardOutput:
        n_new = tokens.shape[1]
        starts = [s.kv.length for s in seqs]
        for s in seqs:
            s.kv.reserve(s.kv.length + n_new)
        ctx = PagedContext(self.pool, self.model.rope, [s.kv for s in seqs], starts, n_new)
        specs = [self._spec(s, st, warm) for s, st in zip(seqs, starts)]
        out = self.run_model(tokens.to(self.device), ctx, specs)
        for row, (s, used) in enumerate(zip(seqs, out.loops_used)):
            s.kv.length += n_new
            s.last_loops = used
            if s.request.warm_start:
                s.warm_state = out.state[row, -1].clone()
        return out

    @torch.inference_mode()
    def prefill_step(self, seq: Sequence) -> torch.Tensor | None:
        """Run the next ``prefill_chunk`` context tokens; the last logits ``[V]`` once done (None
        for a resumed preempted sequence, whose pending token decodes next)."""
        start = seq.kv.length
        chunk = seq.context[start:start + self.prefill_chunk]
        out = self._forward([seq], torch.tensor([chunk], dtype=torch.long), warm=False)
        self.prefilled_tokens += len(chunk)
        if seq.prefilling:
            return None
        if seq.resumed:
            seq.resumed = False
            return None
        seq.loops_total += out.loops_used[0]
        return out.logits[0, -1]

    def prefill(self, seq: Sequence) -> torch.Tensor:
        """Run the whole (remaining) prompt; returns the last position's logits ``[V]``."""
        while True:
            logits = self.prefill_step(seq)
            if logits is not None:
                return logits

    @torch.inference_mode()
    def decode(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Feed each sequence its pending token in one batched call; logits ``[B, V]``."""
        tokens = torch.tensor([[s.pending] for s in seqs], dtype=torch.long)  # [B, 1]
        out = self._forward(seqs, tokens, warm=True)
        for s, used in zip(seqs, out.loops_used):
            s.loops_total += used
            s.pending = None
        return out.logits[:, -1]

    # -- one iteration -------------------------------------------------------------------------
    def step(self, seqs: Seq[Sequence]) -> list[TokenEvent]:
        """One iteration over ``seqs``: a prefill chunk for each prefilling sequence, one batched
        decode for the others, then sampling.

        Failures stay with their sequence: one that cannot get KV blocks, whose prefill, sampling
        (a NaN row), stop check, detokenisation, speculation or beam bookkeeping raises finishes
        with ``seq.error`` and the others go on. When a batched forward raises, its sequences are
        retried one by one in the same step and only those that fail alone fail.
        ``EngineBroken`` is the exception: the engine cannot run anything, so it propagates.
        """
        events: list[TokenEvent] = []
        ready: list[tuple[Sequence, torch.Tensor]] = []
        decoding = [s for s in seqs if not s.finished and not s.prefilling]
        beams = [s for s in decoding if s.request.mode == "beam"]
        decoding = self._reserve_or_fail([s for s in decoding if s.request.mode != "beam"])
        for seq in [s for s in seqs if not s.finished and s.prefilling]:
            logits = self._guard(seq, self.prefill_step, seq)
            if logits is not None and not seq.prefill_only:
                ready.append((seq, logits))
        runs: list[tuple[Sequence, list[Emission]]] = []
        speculative = [s for s in decoding if s.request.speculation is not None]
        if speculative:
            runs, fallback = self._speculate_or_fall_back(speculative)
            decoding = [s for s in decoding if s.request.speculation is None] + fallback
        ready.extend(self._decode_isolated(decoding))
        for seq, logits in [(s, l) for s, l in ready if s.request.mode == "beam"]:
            events.extend(self._guard(seq, self.beam_search.begin, seq, logits) or [])
        ready = [(s, l) for s, l in ready if s.request.mode != "beam"]
        if ready:
            events.extend(self._sample([s for s, _ in ready], [l for _, l in ready]))
        if beams:
            events.extend(self._beam_isolated(beams))
        for seq, emissions in runs:
            events.extend(self._guard(seq, self._accept_run, seq, emissions) or [])
        return events

    def _guard(self, seq: Sequence, fn: Callable[..., _T], *args: Any) -> _T | None:
        """``fn(*args)``, or None with ``seq`` failed when it raises (EngineBroken propagates)."""
        try:
            return fn(*args)
        except EngineBroken:
            raise
        except Exception as exc:
            self._fail(seq, exc)
            return None

    def _decode_isolated(self, seqs: list[Sequence]) -> list[tuple[Sequence, torch.Tensor]]:
        """``decode(seqs)``; when the batched forward raises, each sequence alone."""
        if not seqs:
            return []
        saved = [(s.pending, s.kv.length, s.loops_total, s.last_loops, s.warm_state) for s in seqs]
        try:
            return list(zip(seqs, self.decode(seqs)))
        except EngineBroken:
            raise
        except Exception as exc:
            if len(seqs) == 1:
                self._fail(seqs[0], exc)
                return []
            for s, (pending, length, total, last, warm) in zip(seqs, saved):  # as before the call
                s.pending, s.kv.length, s.loops_total, s.last_loops, s.warm_state = pending, length, total, last, warm
        out = []
        for s in seqs:
            logits = self._guard(s, self.decode, [s])
            if logits is not None:
                out.append((s, logits[0]))
        return out

    def _speculate_or_fall_back(self, seqs: list[Sequence]) -> tuple[list[tuple[Sequence, list[Emission]]], list[Sequence]]:
        """Speculate; when a draft or verify forward raises, these sequences decode plainly this
        step instead (drafts never change the output, and no KV was committed)."""
        try:
            return self.speculate(seqs)
        except EngineBroken:
            raise
        except Exception:  # raised before any commit: every KV length is where it was
            _log.exception("speculation failed; %d sequences decode plainly this step", len(seqs))
            return [], list(seqs)

    def _beam_isolated(self, seqs: list[Sequence]) -> list[TokenEvent]:
        try:
            return self.beam_search.step(seqs)
        except EngineBroken:
            raise
        except Exception as exc:
            if len(seqs) == 1:
                self.beam_search.fail(seqs[0], exc)
                return []
        events: list[TokenEvent] = []
        for s in seqs:
            try:
                events.extend(self.beam_search.step([s]))
            except EngineBroken:
                raise
            except Exception as exc:
                self.beam_search.fail(s, exc)
        return events

    @torch.inference_mode()
    def speculate(self, seqs: Seq[Sequence]) -> tuple[list[tuple[Sequence, list[Emission]]], list[Sequence]]:
        """Draft and verify for speculative sequences: (each one's tokens to append; those that
        need a plain decode step this time). See ``speculative.py``."""
        return self.speculator.run(seqs)

    def _accept_run(self, seq: Sequence, emissions: list[Emission]) -> list[TokenEvent]:
        """Append a verified run of tokens, stopping at the first stop condition."""
        events = []
        for token, logprob in emissions:
            seq.loops_total += seq.loops
            events.append(self._accept(seq, token, logprob))
            if seq.finished:
                break
        return events

    def _reserve_or_fail(self, seqs: list[Sequence]) -> list[Sequence]:
        ok = []
        for s in seqs:
            try:
                s.kv.reserve(s.kv.length + 1)
            except KVCacheExhausted as exc:
                self._fail(s, exc)
            else:
                ok.append(s)
        return ok

    @staticmethod
    def _fail(seq: Sequence, exc: BaseException) -> None:
        seq.fail(exc)

    def _sample(self, seqs: list[Sequence], rows: list[torch.Tensor]) -> list[TokenEvent]:
        """Sample every row and accept its token; a row with NaN or +inf logits, or with no
        finite one, fails its own sequence only (as does a sampler or stop-check failure)."""
        logits = torch.stack(rows).float()  # [B, V]
        bad = (torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)
               | ~torch.isfinite(logits).any(-1)).tolist()  # [B]
        for seq, b in zip(seqs, bad):
            if b:
                self._fail(seq, EngineError("the model produced non-finite logits for this request"))
        keep = [i for i, b in enumerate(bad) if not b]
        good = [seqs[i] for i in keep]
        if not good:
            return []
        states = [s.generator.get_state() for s in good]
        try:
            results: list[Any] = sample_batch(logits[keep], [s.request.sampling for s in good],
                                              [s.generator for s in good], [s.prompt for s in good],
                                              [s.output for s in good])
        except Exception:  # find the row that raised: every other row samples as it would have
            for s, state in zip(good, states):
                s.generator.set_state(state)  # rows before the one that raised drew already
            results = [self._guard(s, self._sample_one, s, logits[i]) for s, i in zip(good, keep)]
        events = []
        for s, r in zip(good, results):
            if r is not None:
                event = self._guard(s, self._accept, s, r.token_id, r.logprob)
                if event is not None:
                    events.append(event)
        return events

    @staticmethod
    def _sample_one(seq: Sequence, row: torch.Tensor) -> Any:
        return sample_batch(row[None], [seq.request.sampling], [seq.generator], [seq.prompt],
                            [seq.output])[0]

    def _accept(self, seq: Sequence, token: int, logprob: Any) -> TokenEvent:
        """Append a sampled token: stop checks, detokenisation, bookkeeping."""
        params = seq.request.sampling
        seq.output.append(token)
        seq.pending = token
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        text, stopped = seq.stop_matcher.feed(seq.detokenizer.push(token))
        if stopped:
            seq.finish("stop", "stop_string")
        elif token in self.tokenizer.eos_ids and not params.ignore_eos:
            seq.finish("stop", "eos")
        elif token in params.stop_token_ids:
            seq.finish("stop", "stop_token")
        elif len(seq.output) >= seq.request.max_tokens:
            seq.finish("length", "length")
        if seq.finished and not stopped:
            tail, stopped = seq.stop_matcher.feed(seq.detokenizer.flush())
            text += tail
            if stopped:
                seq.stop_reason = "stop_string"
                seq.finish_reason = "stop"
            else:
                text += seq.stop_matcher.flush()
        seq.text_parts.append(text)
        return TokenEvent(seq, token, text, len(seq.output) - 1, logprob,
                          seq.last_loops, seq.finished)

    # -- blocking conveniences -----------------------------------------------------------------
    def generate(self, req: GenerationRequest) -> GenerationResult:
        """Run one request to completion."""
        return self.generate_many([req])[0]

    def generate_stream(self, req: GenerationRequest, emit: Callable[[GenerationChunk], None]) -> GenerationResult:
        """Run one request, calling ``emit`` with each chunk as its token is sampled."""
        return self.generate_many([req], emit=lambda _i, chunk: emit(chunk))[0]

    def generate_many(self, reqs: Seq[GenerationRequest],
                      emit: Callable[[int, GenerationChunk], None] | None = None) -> list[GenerationResult]:
        """Run several requests as one continuous batch; results in request order."""
        seqs = [self.start(r) for r in reqs]
        index = {id(s): i for i, s in enumerate(seqs)}
        try:
            while not all(s.finished for s in seqs):
                for ev in self.step([s for s in seqs if not s.finished]):
                    if emit is not None:
                        emit(index[id(ev.sequence)], ev.chunk())
            for s in seqs:
                if s.error is not None:
                    raise s.error
        finally:
            for s in seqs:
                self.free(s)
        return [s.result() for s in seqs]
