"""The engine core: a loaded looped model, its paged KV pool, and the engine contract (DESIGN.md):

- ``start(request) -> Sequence``  validate and set up (no model work, no KV yet)
- ``prefill_step(seq)``           run the next ``prefill_chunk`` prompt tokens; ``prefill`` all
- ``decode(seqs) -> logits``      one token for each sequence, one batched call
- ``verify(seqs, tokens)``        score drafted tokens in one forward (speculation)
- ``fork(seq)`` / ``free(seq)``   share a KV prefix copy-on-write / give the KV back
- ``step(seqs) -> events``        one iteration over running sequences (``batch.py``): each mode's
                                  strategy (``plain.py``, ``speculative.py``, ``beam.py``) drives
                                  its sequences through the methods above (``modes.Core``)

Around it: token acceptance (``output.py``), KV accounting and preemption (``kv_budget.py``),
prefix cache and prefix-pool entries (``prefix_cache.py``), blocking ``generate*`` (``blocking.py``).
Every method blocks on the caller's thread; one engine is driven by one thread at a time. On a
GPU its model work runs on a CUDA stream of its own (``device_stream.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence as Seq
from os import PathLike
from typing import Any, cast

import torch
from torch import nn

from tinyloop import grammar
from tinyloop.cpu.backend import use_cpu_kernels
from tinyloop.cuda.backend import use_cuda_kernels
from tinyloop.engine import blocking
from tinyloop.engine.batch import Batch
from tinyloop.engine.device_stream import new_stream, on_stream
from tinyloop.engine.graphs import DecodeGraphs
from tinyloop.engine.kv_budget import KVAccounting, KVBudget, context_fits, pool_blocks
from tinyloop.engine.output import accept_token
from tinyloop.engine.plain import DEFAULT_DECODE_BURST, check_burst
from tinyloop.engine.prefill import advance, prefill_chunks
from tinyloop.engine.prefix_cache import PrefixCache, PrefixEntries
from tinyloop.engine.sampling import StopMatcher, make_generator
from tinyloop.engine.sequence import Sequence, TokenEvent
from tinyloop.engine.speculation import check_drafting
from tinyloop.errors import RequestError
from tinyloop.limits import ModelLimits, Resolved
from tinyloop.model.config import ModelConfig
from tinyloop.model.context import PagedContext
from tinyloop.model.cpu_linear import pack_linears
from tinyloop.model.inkling2 import Inkling2LM
from tinyloop.model.kvcache import KVPool, SeqKV, slot_count
from tinyloop.model.looped import ForwardOutput, LoopedLM, RowSpec
from tinyloop.model.quant import WEIGHT_MODES, bf16_weights_on_cpu, draft_copy, quantize_linears
from tinyloop.requests import GenerationRequest, TokenLogprob
from tinyloop.tokenizer import Tokenizer
from tinyloop.vocabulary import KVMode

__all__ = ["Engine"]

DEFAULT_MAX_DRAFT_NODES = 64
# A draft chain ends at a token drafted below this probability (best of 0.1-0.3: bench/speculative.py; 0: none)
DEFAULT_DRAFT_MIN_PROB = 0.2
# The randn initial state depends on the token position only (never on the request), so the KV
# of a prompt prefix is the same for every request: prefix sharing and reproducible greedy
# decoding both rely on it.
NOISE_SEED = 0


class Engine(KVAccounting, PrefixEntries):
    """A looped model ready to serve: model, tokenizer, KV pool and limits."""

    def __init__(self, model: LoopedLM | Inkling2LM, tokenizer: Tokenizer, *, max_seq_len: int | None = None,
                 kv_cache_mb: float | None = None, block_size: int = 16, prefill_chunk: int = 512,
                 chat_template: str | None = None, name: str = "tinyloop",
                 kv_mode: KVMode | str | None = None, prefix_caching: bool = True,
                 max_draft_nodes: int = DEFAULT_MAX_DRAFT_NODES, pack_weights: bool = True,
                 weights: str = "float", draft_min_prob: float = DEFAULT_DRAFT_MIN_PROB,
                 draft_weights: str = "same", cpu_kernels: bool = True,
                 cuda_kernels: bool = False, cuda_graphs: bool = False,
                 default_loops: int | None = None, decode_burst: int = DEFAULT_DECODE_BURST) -> None:
        self.model = cast(LoopedLM, model.eval())  # an Inkling2LM: the same forward; ModelLimits refuses the rest
        if weights not in WEIGHT_MODES:
            raise RequestError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}", param="weights")
        weights = bf16_weights_on_cpu(model, weights, cpu_kernels)  # a bfloat16 model's weights stay bf16
        self.draft_model = draft_copy(model, draft_weights if weights == "float" else "same")  # quant.py
        self.weights = weights
        if weights != "float":  # int8 / int4 / bf16 linear weights (quant.py); activations float32
            quantize_linears(model, weights, grouped=cpu_kernels)  # (bf16: the rest of a bfloat16 model to float32)
        elif pack_weights and model.config.architecture == "looped":  # float32 CPU weights in the layouts
            pack_linears(model)  # decode reads fastest (cpu_linear.py; Inkling-2's small products: torch's)
        for m in {id(m): m for m in (model, self.draft_model)}.values():  # CPU decode attention on
            use_cpu_kernels(m, cpu_kernels)  # type: ignore[arg-type]  # the C kernel where it builds
            if cuda_kernels:  # norms, RoPE, decode attention on tinyloop/cuda's kernels
                use_cuda_kernels(m)
        # a server-wide default loop count replaces the model's: limits, KV sizing and graphs see it
        self.config: ModelConfig = model.config.replace(default_loops=default_loops or model.config.default_loops)
        self.tokenizer, self.eos_ids = tokenizer, tokenizer.eos_ids
        self.default_loops = self.config.default_loops
        self.name = name
        self.chat_template = chat_template or tokenizer.chat_template
        self.max_seq_len = max_seq_len or self.config.max_position
        self.context_capped_by_kv = False  # the default context shrank to what the KV pool holds
        if self.max_seq_len > self.config.max_position:
            raise RequestError(f"max_seq_len {self.max_seq_len} exceeds the model's max_position "
                               f"{self.config.max_position}", param="max_seq_len")
        if prefill_chunk < 1:
            raise RequestError("prefill_chunk must be >= 1", param="prefill_chunk")
        self.prefill_chunk = prefill_chunk
        # speculative drafts: tokens per step (all sequences), the probability a chain stops under
        self.max_draft_nodes, self.draft_min_prob = check_drafting(max_draft_nodes, draft_min_prob)
        self.decode_burst = check_burst(decode_burst)  # a lone greedy sequence's tokens per step (plain.py)
        self.vocab_limit = min(tokenizer.vocab_size, self.config.vocab_size)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        if cuda_graphs and self.device.type != "cuda":
            raise RequestError(f"cuda_graphs needs the model on a CUDA device, not {self.device}", param="cuda_graphs")
        self.cuda_graphs = cuda_graphs
        self.kv_mode = KVMode.parse(kv_mode)  # full, int4, h-mode, ... (kvmode.py)
        blocks = pool_blocks(self.config, self.kv_mode, self.dtype, self.max_seq_len, kv_cache_mb, block_size)
        if max_seq_len is None:  # the model's context, down to what one sequence at the default loops fits
            fits = context_fits(self.config, blocks, block_size)
            if fits < self.max_seq_len:
                self.max_seq_len, self.context_capped_by_kv = fits, True
        self._open_pool(blocks, block_size, prefix_caching)

    def _open_pool(self, blocks: int, block_size: int, prefix_caching: bool) -> None:
        """The engine's own state around the model: KV pool, its budget, limits, prefix cache, batch."""
        self.pool = KVPool(self.config, blocks, block_size, dtype=self.dtype, device=self.device, mode=self.kv_mode)
        self.budget = KVBudget(self.config, self.pool, self.max_seq_len)
        self.limits = ModelLimits.from_engine(self)  # the one check of a request (tinyloop.limits)
        self.prefix_cache = PrefixCache(self.pool, self.kv_mode, prefix_caching)
        self.stream = new_stream(self.device)  # this engine's CUDA stream (device_stream.py); None on the CPU
        # decode steps captured per bucket and loops, replayed (graphs.py)
        self.graphs = DecodeGraphs.of(self) if self.cuda_graphs else None
        self.batch = Batch(self)
        self.prefilled_tokens = 0  # prompt tokens run through the model (cache hits excluded)

    def replica(self) -> Engine:
        """Another engine on this model's (shared, read-only) weights, with its own KV pool and batch."""
        twin = copy.copy(self)
        twin._open_pool(self.pool.num_blocks, self.pool.block_size, self.prefix_cache.enabled)
        return twin

    @classmethod
    def load(cls, path: str | PathLike[str], *, max_seq_len: int | None = None, device: str = "cpu",
             dtype: torch.dtype | None = None, **options: Any) -> Engine:
        """Load a ``.tinyloop`` artifact; ``options`` go to the constructor (kv_cache_mb, ...)."""
        from tinyloop.model.artifact import load_artifact

        art = load_artifact(path, max_seq_len=max_seq_len, device=device, dtype=dtype)
        options.setdefault("name", str(path).rsplit("/", 1)[-1].removesuffix(".tinyloop"))
        return cls(art.model, art.tokenizer, max_seq_len=max_seq_len,
                   chat_template=art.chat_template, **options)

    def __repr__(self) -> str:
        return f"<Engine {self.name} max_seq_len={self.max_seq_len} {self.pool!r}>"

    # -- lifecycle of a sequence (kv_*, preempt, resume: kv_budget.KVAccounting) ---------------
    def validate(self, req: GenerationRequest) -> tuple[int, int]:
        """Check a request against this model (``self.limits``); returns its (loops, window)."""
        resolved = self.limits.check(req)
        return resolved.loops, resolved.window

    def start(self, req: GenerationRequest, prefix: Sequence | None = None,
              resolved: Resolved | None = None) -> Sequence:
        """A new sequence for ``req`` (validated; no model work, and no KV beyond shared blocks).

        With ``prefix`` (a prefilled sequence at the same loops and window whose prompt
        prefixes this one, see ``prefill_prefix``), the new sequence shares its KV blocks and
        only the rest of the prompt is prefilled: the output is the same as without it. With
        prefix caching on, cached blocks serve instead when they cover more of the prompt.
        ``seq.cached_tokens`` says how many prompt tokens were served either way. ``resolved``:
        the request's check by ``self.limits`` when the caller made it already (the runtime does,
        at admission), so it is not made twice.
        """
        if resolved is None:
            resolved = self.limits.check(req)
        loops, window = resolved.loops, resolved.window
        seq = Sequence(
            request=req, loops=loops, window=window, exit=resolved.exit,
            kv=SeqKV(self.pool, slot_count(self.config, loops, window)),
            generator=make_generator(req.sampling.seed), noise_seed=NOISE_SEED,
            detokenizer=self.tokenizer.stream_decoder(), prompt=list(req.prompt_tokens),
            stop_matcher=StopMatcher(req.sampling.stop, req.sampling.include_stop_str_in_output))
        seq.mode_state, seq.matcher = self.batch.new_state(seq), grammar.matcher_for(req, self.tokenizer)  # or None
        self.prefix_cache.attach(seq, prefix)
        seq.cached_tokens = seq.kv.length
        return seq

    def fork(self, seq: Sequence) -> Sequence:
        """A copy of ``seq`` sharing its KV blocks copy-on-write (beam, prefix pool)."""
        child = self.start(seq.request)
        child.kv.free()  # whatever start found in the prefix cache: the parent's KV replaces it
        child.kv = seq.kv.fork()
        child.cached_tokens, child.pending = seq.cached_tokens, seq.pending
        child.output, child.prompt = list(seq.output), list(seq.prompt)
        child.warm_state, child.matcher = seq.warm_state, grammar.fork(seq.matcher)  # its own grammar state
        return child

    def free(self, seq: Sequence) -> None:
        """Give the sequence's KV blocks back to the pool (its full blocks to the prefix cache,
        when on). Safe to call twice."""
        if seq.mode_state is not None:
            seq.mode_state.release()
        self.prefix_cache.keep(seq)
        seq.kv.free()

    # -- model work ----------------------------------------------------------------------------
    def context(self, kvs: Seq[SeqKV], starts: Seq[int], n_new: int, extra_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> PagedContext:
        """Where a forward's rows keep and read their KV: ``n_new`` tokens at ``starts`` in ``kvs``."""
        return PagedContext(self.pool, self.model.rope, kvs, starts, n_new, extra_mask=extra_mask,
                            positions=positions, backend=self.model.backend)

    def run_model(self, tokens: torch.Tensor, ctx: Any, specs: Seq[RowSpec], last_only: bool = True,
                  model: nn.Module | None = None) -> ForwardOutput:
        """One forward of ``model`` (the engine's, or its ``draft_model``); rows of the embedding past the
        tokenizer's vocabulary (checkpoint padding) get -inf logits: sampling can never pick them."""
        out: ForwardOutput = (model or self.model)(tokens, ctx, specs, last_only=last_only)
        if self.vocab_limit < out.logits.shape[-1]:
            out.logits[..., self.vocab_limit:] = float("-inf")
        return out

    def forward(self, seqs: Seq[Sequence], tokens: torch.Tensor, warm: bool,
                counts: Seq[int] | None = None, last_only: bool = True) -> ForwardOutput:
        """``tokens`` ``[B, T]`` stored from each ``kv.length`` on (blocks reserved for all T);
        ``counts``: each row's real tokens when right-padded (``prefill.py``); ``last_only``: the model's."""
        n_new = tokens.shape[1]
        counts = counts or [n_new] * len(seqs)
        starts = [s.kv.length for s in seqs]
        for s in seqs:
            s.kv.reserve(s.kv.length + n_new)
        ctx = self.context([s.kv for s in seqs], starts, n_new)
        specs = [RowSpec(loops=s.loops, window=s.window, start=st, noise_seed=s.noise_seed,
                         warm_state=s.warm_state if warm else None, exit=s.exit, last=n - 1 if n < n_new else None)
                 for s, st, n in zip(seqs, starts, counts)]
        out = self.run_model(tokens.to(self.device, non_blocking=True), ctx, specs, last_only=last_only)
        advance(self.model, seqs, out, counts)
        return out

    def host_tokens(self, rows: Seq[Seq[int | None]]) -> torch.Tensor:
        """Token ids ``[B, T]`` on the host, pinned when the model is on CUDA (a non-blocking copy)."""
        return torch.tensor(rows, dtype=torch.long, device="cpu", pin_memory=self.device.type == "cuda")

    @on_stream
    @torch.inference_mode()
    def prefill_step(self, seq: Sequence) -> torch.Tensor | None:
        """Run the next ``prefill_chunk`` context tokens; the last logits ``[V]`` once done (None
        for a resumed preempted sequence, whose pending token decodes next)."""
        return prefill_chunks(self, [seq])[0]

    def prefill(self, seq: Sequence) -> torch.Tensor:
        """Run the whole (remaining) prompt; returns the last position's logits ``[V]``."""
        while True:
            logits = self.prefill_step(seq)
            if logits is not None:
                return logits

    @on_stream
    @torch.inference_mode()
    def decode(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Feed each sequence its pending token in one batched call; logits ``[B, V]``."""
        out = self.graphs.forward(seqs) if self.graphs is not None else None  # None: not covered
        if out is None:
            out = self.forward(seqs, self.host_tokens([[s.pending] for s in seqs]), warm=True)
        for s, used in zip(seqs, out.loops_used):
            s.loops_total += used
            s.pending = None
        return out.logits[:, -1]

    @on_stream
    @torch.inference_mode()
    def verify(self, seqs: Seq[Sequence], tokens: Seq[Seq[int]], *, mask: torch.Tensor | None = None,
               positions: Seq[Seq[int]] | None = None) -> torch.Tensor:
        """Score ``tokens`` (T per sequence: the pending token, then the drafts, stored from
        ``kv.length`` on, blocks reserved) in one forward; logits ``[B, T, V]`` on the CPU. A tree
        gives ``mask`` ``[B, T, T]`` and ``positions``; the caller commits what it accepts."""
        starts = [s.kv.length for s in seqs]
        pos = None if positions is None else torch.tensor([list(p) for p in positions], dtype=torch.long,
                                                          device=self.device)  # [B, T]
        ctx = self.context([s.kv for s in seqs], starts, len(tokens[0]),
                           extra_mask=mask, positions=pos)  # the context combines the mask on the host
        specs = [RowSpec(loops=s.loops, window=s.window, start=st, noise_seed=s.noise_seed,
                         positions=None if positions is None else positions[b], exit=s.exit)
                 for b, (s, st) in enumerate(zip(seqs, starts))]
        out = self.run_model(torch.tensor([list(t) for t in tokens], dtype=torch.long, device=self.device),
                             ctx, specs, last_only=False)
        return out.logits.float().cpu()  # [B, T, V]

    # -- one iteration (batch.py), token acceptance (output.py), blocking API (blocking.py) ----
    @on_stream
    def step(self, seqs: Seq[Sequence]) -> list[TokenEvent]:
        """One iteration over ``seqs`` (``Batch.step``): failures stay with their sequence."""
        return self.batch.step(seqs)

    def accept(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> TokenEvent:
        """Append a chosen token: stop checks, detokenisation, bookkeeping."""
        return accept_token(seq, token, logprob, self.tokenizer.eos_ids)

    # run requests to completion on this thread
    generate, generate_stream, generate_many = blocking.generate, blocking.generate_stream, blocking.generate_many
