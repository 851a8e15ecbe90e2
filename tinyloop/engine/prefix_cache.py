"""Prefixes for the engine: automatic prefix caching, and prefix-pool entries.

``PrefixCache``: with it on, ``Engine.free`` hands a sequence's full blocks of computed, request-independent KV
to the pool's cache (``model/blockcache.py``) and ``Engine.start`` reuses the longest cached run
of a new prompt's blocks, so only the rest is prefilled. ``PrefixEntries``: the engine's
``start_prefix``/``prefill_prefix``, a registered prefix that ``Engine.start`` can share.

Prompt logprobs. A request that asks for ``prompt_logprobs`` needs the logits of every prompt
position, and a position served from cached KV has none: computing them would be a forward
over those positions, the very prefill the cache saves. So such a request is served no cached
or pool blocks for the positions whose logits it still needs (``prefill.prompt_logits_from``):
a new one prefills its whole prompt and reports ``cached_tokens == 0``, with the same logprobs
and output as on a cold cache. Its blocks still go to the cache when it ends (its KV is the
same as anyone's). A preempted one that already has all its entries resumes from the cache as
any sequence does; one preempted mid-prompt takes cached blocks only up to its first missing
entry.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from tinyloop.engine.prefill import prompt_logits_from
from tinyloop.engine.sequence import Sequence
from tinyloop.model.blockcache import block_keys
from tinyloop.model.kvcache import KVPool
from tinyloop.requests import GenerationRequest
from tinyloop.vocabulary import KVMode

__all__ = ["PrefixCache", "PrefixEntries", "prefix_request"]


def prefix_request(tokens: Seq[int], loops: int | None, cache_window: int | None) -> GenerationRequest:
    """The request a registered prefix of ``tokens`` is validated and started as."""
    return GenerationRequest(prompt_tokens=tuple(tokens), max_tokens=1, loops=loops, cache_window=cache_window)



class PrefixCache:
    """Looks up and fills the pool's block cache for sequences (a no-op when disabled)."""

    def __init__(self, pool: KVPool, kv_mode: KVMode, enabled: bool) -> None:
        self.pool = pool
        self.kv_mode = kv_mode
        self.enabled = enabled

    def _salt(self, seq: Sequence) -> tuple[object, ...]:
        """What a block's KV depends on besides its tokens (the hash chain's salt): an adaptive
        exit rule changes the loops each position ran, and so its KV."""
        return (seq.loops, seq.window, seq.noise_seed, self.kv_mode.name, repr(seq.exit))

    def attach(self, seq: Sequence, prefix: Sequence | None) -> None:
        """Give a new (or preempted) sequence the longest KV prefix there is: cached blocks, or
        ``prefix``'s blocks (a prefix-pool entry whose prompt prefixes ``seq``'s) when they
        cover more. The last prompt token always runs, so the first output token has logits, and
        so do the positions whose logits prompt logprobs still need (the module docstring)."""
        pool_hit = 0
        limit = prompt_logits_from(seq)
        if prefix is not None:
            n = len(prefix.prompt)
            if (prefix.loops, prefix.window) != (seq.loops, seq.window) or seq.prompt[:n] != prefix.prompt:
                raise ValueError("prefix does not match the request's prompt, loops and window")
            pool_hit = min(n, len(seq.prompt) - 1, len(seq.prompt) if limit is None else limit)
        cached = self.lookup(seq, limit)
        if len(cached) * self.pool.block_size < pool_hit:
            self.pool.release([b for col in cached for b in col])
            cached = []
        if cached:
            seq.kv.adopt(cached)
        elif prefix is not None and pool_hit > 0:
            seq.kv = prefix.kv.fork()
            seq.kv.truncate(pool_hit)

    def lookup(self, seq: Sequence, limit: int | None = None) -> list[list[int]]:
        """The cache's longest run of full blocks of ``seq``'s prompt (referenced for it);
        never the block of the last prompt token, which must run to give the first logits, nor
        positions from ``limit`` on."""
        if not self.cacheable(seq):
            return []
        context = seq.context
        n = min(len(context) - 1, len(context) if limit is None else limit) // self.pool.block_size
        return self.pool.cache.lookup(block_keys(context, self.pool.block_size, n, self._salt(seq)))

    def cacheable(self, seq: Sequence) -> bool:
        # With W < loops a token reads its predecessors' latest slot when they ran in an earlier
        # forward but the same loop's when they run in its own: a prefill that starts after
        # cached blocks would change the output, so only full-cache sequences take part.
        return self.enabled and seq.window >= seq.loops

    def keep(self, seq: Sequence) -> None:
        """Hand ``seq``'s full blocks of computed, request-independent KV to the cache."""
        if not self.cacheable(seq):
            return
        tokens = seq.tokens
        # Positions < kv.length are verified (speculation truncates its drafts away); a
        # warm-start request's decoded positions depend on its warm state, not its tokens, and
        # a beam sequence's output need not be the tokens its KV was decoded from.
        prompt_only = seq.request.warm_start or seq.request.mode == "beam"
        n = min(seq.kv.length, len(seq.prompt) if prompt_only else len(tokens))
        if seq.kv.gaps:  # a token that skipped loop slots: the cache keeps no gap map
            n = min(n, min(seq.kv.gaps))
        n_blocks = min(n // self.pool.block_size, seq.kv.blocks_per_slot)
        if n_blocks:
            keys = block_keys(tokens, self.pool.block_size, n_blocks, self._salt(seq))
            self.pool.cache.insert(keys, seq.kv.columns(n_blocks))


class _Engine(Protocol):
    """What ``PrefixEntries`` uses of the engine it is mixed into."""

    def start(self, req: GenerationRequest, prefix: Sequence | None = None) -> Sequence: ...

    def prefill(self, seq: Sequence) -> torch.Tensor: ...

    def free(self, seq: Sequence) -> None: ...

    def start_prefix(self, tokens: Seq[int], loops: int | None = None,
                     cache_window: int | None = None) -> Sequence: ...


class PrefixEntries:
    """The engine's prefix-pool entries (``Engine`` mixes them in), over its ``start``,
    ``prefill`` and ``free``."""

    @torch.inference_mode()
    def prefill_prefix(self: _Engine, tokens: Seq[int], loops: int | None = None,
                       cache_window: int | None = None) -> Sequence:
        """Prefill ``tokens`` once and keep the KV (free it with ``free``): a prefix-pool entry."""
        seq = self.start_prefix(tokens, loops, cache_window)
        try:
            self.prefill(seq)
        except BaseException:
            self.free(seq)
            raise
        return seq

    def start_prefix(self: _Engine, tokens: Seq[int], loops: int | None = None,
                     cache_window: int | None = None) -> Sequence:
        """A prefix-pool entry to be: ``step`` prefills it a chunk at a time beside the other
        sequences and samples nothing; once it is no longer ``prefilling`` it is ready."""
        seq = self.start(prefix_request(tokens, loops, cache_window))
        seq.prefill_only = True
        return seq
