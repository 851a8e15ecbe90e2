"""KV accounting for the engine: pool sizing, a request's worst case, a sequence's next demand.

Pure arithmetic over the model config and the pool's block size (``KVBudget``); the engine
actor plans with the ``Engine.kv_*`` methods, which ``KVAccounting`` gives the engine.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from tinyloop.engine.prefix_cache import PrefixCache, prefix_request
from tinyloop.engine.sequence import Sequence
from tinyloop.errors import ConfigError
from tinyloop.limits import KVLimits, ModelLimits, Resolved
from tinyloop.model.config import ModelConfig
from tinyloop.model.kvcache import KVDemand, KVPool, KVPoolStats, slot_count
from tinyloop.requests import GenerationRequest
from tinyloop.vocabulary import ExitRule, KVMode

__all__ = ["DEFAULT_KV_BUDGET_MB", "KVAccounting", "KVBudget", "context_fits", "pool_blocks"]

DEFAULT_KV_BUDGET_MB = 1024


def pool_blocks(config: ModelConfig, kv_mode: KVMode, dtype: torch.dtype, max_seq_len: int,
                kv_cache_mb: float | None, block_size: int) -> int:
    """Blocks of the pool: ``kv_cache_mb`` of them, or by default room for 8 full-length
    sequences at the default loops and for one at the most loops (a larger request is refused,
    ``Engine.validate``), capped by ``DEFAULT_KV_BUDGET_MB``. The pool allocates one block more,
    its null block (``KVPool.null_block``), which no request holds."""
    c = config
    elem = torch.empty((), dtype=dtype).element_size()
    per_block = kv_mode.slot_bytes(c, elem) * block_size  # the budget is in bytes
    if kv_cache_mb is None:
        per_token = max(8 * kv_mode.bytes_per_token(c, c.default_loops, None, elem),
                        kv_mode.bytes_per_token(c, c.max_loops, None, elem))
        need = per_token * max_seq_len
        budget = min(need, DEFAULT_KV_BUDGET_MB * 2**20)
    else:
        budget = int(kv_cache_mb * 2**20)
    return max(1, budget // per_block)


def context_fits(config: ModelConfig, blocks: int, block_size: int) -> int:
    """Tokens one sequence at the model's default loops may hold in a pool of ``blocks``;
    ``ConfigError`` when not one block's worth: such a model would serve "healthy" and refuse
    every request."""
    slots = slot_count(config, config.default_loops, config.default_loops)
    fits = blocks // slots * block_size
    if fits < 1:
        raise ConfigError(f"one sequence at the model's default_loops {config.default_loops} needs {slots} KV "
                          f"blocks of {block_size} tokens but the KV cache holds {blocks}: raise kv_cache_mb "
                          "(TINYLOOP_KV_CACHE_MB) or lower the default loops")
    return fits


class KVBudget:
    """What requests and sequences hold of one engine's pool, at most and next."""

    def __init__(self, config: ModelConfig, pool: KVPool, max_seq_len: int) -> None:
        self.config = config
        self.pool = pool
        self.max_seq_len = max_seq_len
        self.kv = KVLimits(pool.num_blocks, pool.block_size, config)

    def worst_blocks(self, req: GenerationRequest, loops: int, window: int) -> int:
        """KV blocks ``req`` holds at most: every slot's table at its full length (prompt plus
        ``max_tokens``), times the beams of a beam search. Speculation needs no more: it falls
        back to plain decoding when blocks are short."""
        length = min(len(req.prompt_tokens) + req.max_tokens, self.max_seq_len)
        return self.kv.worst_blocks(length, loops, window, req.beam[0] if req.beam is not None else 1)

    @staticmethod
    def reserves_worst_case(req: GenerationRequest, rule: ExitRule) -> bool:
        """Whether ``req``, running under exit ``rule``, sets its worst-case KV aside when it
        starts instead of growing and being preemptible: a recompute would not reproduce the KV
        of a warm-start or adaptive-exit sequence (decoding ran each token differently from a
        prefill), and a beam search's beams are not one sequence."""
        return req.warm_start or rule.stops or req.mode == "beam"

    def start_blocks(self, req: GenerationRequest, resolved: Resolved) -> int:
        """Blocks ``req`` needs to start: its worst case when it reserves one, else its prompt
        and first token (the prompt alone with ``max_tokens == 0``: never more than its worst
        case, which admission checked against the pool; prefix-cache hits may make it less)."""
        loops, window = resolved.loops, resolved.window
        if self.reserves_worst_case(req, resolved.exit):
            return self.worst_blocks(req, loops, window)
        length = len(req.prompt_tokens) + min(req.max_tokens, 1)
        return slot_count(self.config, loops, window) * -(-length // self.pool.block_size)

    def prefix_blocks(self, n_tokens: int, loops: int, window: int) -> int:
        """Blocks a registered prefix of ``n_tokens`` holds."""
        return slot_count(self.config, loops, window) * -(-n_tokens // self.pool.block_size)

    def demand(self, seq: Sequence) -> KVDemand:
        """What ``seq`` asks of the pool next (the engine actor's planning input)."""
        kv = seq.kv
        target = seq.context_length if seq.prefilling else kv.length + 1
        if seq.prefill_only or self.reserves_worst_case(seq.request, seq.exit):
            worst = self.worst_blocks(seq.request, seq.loops, seq.window)
            held = kv.num_blocks + (seq.mode_state.blocks() if seq.mode_state is not None else 0)
            return KVDemand(0, max(worst - held, 0), False, 0)
        return KVDemand(kv.blocks_to_reserve(target), 0, True, kv.n_slots)

    def available(self) -> int:
        """Blocks the pool can hand out now: free ones and idle prefix-cache ones."""
        stats = self.pool.statistics()
        return stats.blocks_free + stats.blocks_cached


class _Engine(Protocol):
    """What ``KVAccounting`` uses of the engine it is mixed into."""

    budget: KVBudget
    pool: KVPool
    config: ModelConfig
    prefix_cache: PrefixCache
    limits: ModelLimits

    def validate(self, req: GenerationRequest) -> tuple[int, int]: ...

    def free(self, seq: Sequence) -> None: ...


class KVAccounting:
    """The engine's ``kv_*`` planning methods and preemption (``Engine`` mixes them in), over
    its ``budget``, ``validate``, ``free`` and ``prefix_cache``."""

    def preempt(self: _Engine, seq: Sequence) -> None:
        """Give ``seq``'s KV back now and rebuild it later: its next steps prefill the prompt and
        every output token but the pending one (through the prefix cache where it kept them),
        then decoding goes on where it stopped, with the same tokens as without the pause."""
        if self.budget.reserves_worst_case(seq.request, seq.exit) or seq.prefill_only:
            raise ValueError(f"{seq!r} cannot be preempted: a recompute would change its KV")
        self.free(seq)
        seq.resumed = bool(seq.output)  # none yet: the prompt's last logits are still to sample

    def resume(self: _Engine, seq: Sequence) -> None:
        """Before a preempted sequence runs again: take what the prefix cache kept of it."""
        self.prefix_cache.attach(seq, None)

    def kv_statistics(self: _Engine) -> KVPoolStats:
        return self.pool.statistics()

    def kv_blocks_needed(self: _Engine, req: GenerationRequest) -> int:
        """KV blocks ``req`` holds at most (``KVBudget.worst_blocks``)."""
        return self.budget.worst_blocks(req, *self.validate(req))

    def kv_start_blocks(self: _Engine, req: GenerationRequest, resolved: Resolved | None = None) -> int:
        """Blocks ``req`` needs to start, at the loops and window ``resolved`` (admission's check)
        gives; checked here when the caller has none."""
        return self.budget.start_blocks(req, resolved or self.limits.check(req))

    def kv_prefix_blocks(self: _Engine, tokens: Seq[int], loops: int | None = None,
                         cache_window: int | None = None) -> int:
        """Blocks a registered prefix of ``tokens`` holds (validated like a request)."""
        return self.budget.prefix_blocks(len(tokens), *self.validate(prefix_request(tokens, loops, cache_window)))

    def kv_demand(self: _Engine, seq: Sequence) -> KVDemand:
        return self.budget.demand(seq)

    def kv_available(self: _Engine) -> int:
        return self.budget.available()

    def kv_bytes_per_token(self: _Engine, loops: int | None = None, cache_window: int | None = None) -> int:
        return self.pool.bytes_per_token(loops or self.config.default_loops, cache_window)
