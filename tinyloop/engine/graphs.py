"""Decode steps captured once and replayed: CUDA graphs per (batch bucket, loops, mixed).

A looped model's decode step launches hundreds of kernels (every core layer, every loop): at
batch 1 their launch cost, not the GPU, sets the token rate. ``DecodeGraphs`` runs the step at
fixed shapes (``model.static_context.StaticContext``: the batch padded up to a bucket, block
tables padded to the longest context the engine allows) so that it can be captured by
``torch.cuda.CUDAGraph`` on its first use and replayed after: the host only rewrites the
context's input buffers (one copy, plus the table rows that changed) and replays.

    engine.decode(seqs)  ->  DecodeGraphs.forward(seqs)    # None: not covered, the eager forward runs
        reserve KV, fill the bucket's buffers, replay (capture on first use), advance

Rows of different loop counts and cache windows share one graph, the test-time compute dial
turned per request: the graph runs the batch's largest loop count L with every slot a loop of
its own (a window of L), and each row's block tables are laid out for it on the host
(``slot_map``): loop r of a row with window w reads and writes the row's slot r mod w, as the
eager forward does, and a row's coda its own coda slots. In a mixed batch a row that runs fewer
loops keeps its state through the loops past its count (``torch.where``) while their K and V go
to the pool's null block; a batch whose rows all run L loops has a graph without those selects.

Covered: one token a row, no exit rule that stops or selects, no KV gaps, K and V stored (not
h-mode), at most ``max_rows`` rows. Anything else, or a key whose capture failed, runs eagerly.
Without ``capture`` (the CPU) the same static step runs eagerly: what the tests check the
graph's body against.

The step's inputs live in the graph's buffers, its outputs in the graph's memory pool: the
logits are copied out at once, the state is read by ``prefill.advance`` before the next replay.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from tinyloop.engine.device_stream import on_stream
from tinyloop.engine.prefill import advance
from tinyloop.engine.sequence import Sequence
from tinyloop.model.kvcache import KVPool, SeqKV, slot_count
from tinyloop.model.looped import ForwardOutput, LoopedLM
from tinyloop.model.static_context import StaticContext, split_inputs

__all__ = ["DecodeGraphs", "GRAPH_ROWS"]

_log = logging.getLogger("tinyloop.engine")

GRAPH_ROWS = (1, 2, 4, 8, 16, 32, 64)  # the batch buckets: a batch runs in the smallest that holds it
MAX_GRAPHS = 24  # captured graphs kept (the oldest goes first): each holds its buffers and tables
_WARMUP_RUNS = 2  # eager runs on a side stream before a capture (cuBLAS handles, kernel modules)
# One capture at a time in the process: engines on one GPU step in their own threads, and a
# capture's start (a device synchronisation, the allocator's cache emptied, torch's one capture
# stream) must not fall inside another engine's capture.
_CAPTURE_LOCK = threading.Lock()


@dataclass(eq=False)
class _Graph:
    """One (bucket, loops, mixed): its context, host staging, and the captured graph."""

    ctx: StaticContext
    loops: int  # L: every row's slots laid out for L loops (window L)
    mixed: bool  # rows may run fewer loops than L
    staging: torch.Tensor  # [ctx.inputs] int64 on the host (pinned on CUDA)
    tables: torch.Tensor  # [R, S, MB] int64 on the host: what ctx.tables holds
    rows_host: torch.Tensor  # [2, R] int64 on the host (pinned on CUDA): warm start (0/1), loops
    rows_info: torch.Tensor  # [2, R] int64: what rows_host holds
    loop_index: torch.Tensor  # [L] int64: 0 .. L-1
    warm_state: torch.Tensor  # [R, H] model dtype
    noise: torch.Tensor  # [R, H] float32: the randn initial states (state_init "randn")
    noise_host: torch.Tensor  # [R, H] float32 on the host
    held: list[tuple[SeqKV, int] | None] = field(default_factory=list)  # each row's uploaded tables: whose, version
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    copied: Any = None  # torch.cuda.Event after the last replay (capture only)
    out: tuple[torch.Tensor, torch.Tensor] | None = None  # the captured step's logits and state


class _Owner(Protocol):
    """What ``DecodeGraphs.of`` reads of an engine."""

    model: LoopedLM
    pool: KVPool
    max_seq_len: int
    vocab_limit: int
    stream: Any  # the engine's CUDA stream (device_stream.py): captures at startup run on it


class DecodeGraphs:
    """The decode graphs of one engine (its model, KV pool and context limit)."""

    def __init__(self, model: LoopedLM, pool: KVPool, max_seq_len: int, vocab_limit: int, *,
                 capture: bool | None = None, max_rows: int = GRAPH_ROWS[-1], stream: Any = None) -> None:
        self.model, self.pool, self.stream = model, pool, stream
        self.device = pool.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the engine on a CUDA device")
        self.max_blocks = -(-max_seq_len // pool.block_size)
        self.vocab_limit = vocab_limit
        self.buckets = tuple(b for b in GRAPH_ROWS if b < max_rows) + (max_rows,)
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.failed: set[tuple[int, int, bool]] = set()  # keys whose capture raised: eager from then on
        self._slot_maps: dict[tuple[int, int, int], np.ndarray] = {}
        self.replays = 0
        self._mempool: Any = torch.cuda.graph_pool_handle() if self.capture else None

    @classmethod
    def of(cls, engine: _Owner, *, capture: bool | None = None, max_rows: int = GRAPH_ROWS[-1]) -> DecodeGraphs:
        """The graphs of ``engine`` (an ``Engine``: its model, pool, context and vocabulary limit)."""
        return cls(engine.model, engine.pool, engine.max_seq_len, engine.vocab_limit, capture=capture,
                   max_rows=max_rows, stream=engine.stream)

    def __repr__(self) -> str:
        return (f"<DecodeGraphs {len(self.graphs)} graphs capture={self.capture} replays={self.replays} "
                f"failed={sorted(self.failed)}>")

    def key(self, seqs: Seq[Sequence]) -> tuple[int, int, bool] | None:
        """The graph that would run ``seqs``: (bucket, the largest loop count, whether a row runs
        fewer), or None when they are not covered (module docstring)."""
        config, limit = self.model.config, self.max_blocks * self.pool.block_size
        # value embeddings read each row's tokens, which a captured step does not pass on; an
        # Inkling-2 model runs eagerly
        if (not seqs or len(seqs) > self.buckets[-1] or self.pool.mode.h_mode or config.value_embeds
                or config.architecture != "looped"):
            return None
        for s in seqs:
            if (s.kv.gaps or s.exit.stops or s.exit.kind in ("gate_select", "gate_expected") or s.pending is None
                    or s.kv.length + 1 > limit or s.kv.n_slots != slot_count(config, s.loops, min(s.window, s.loops))):
                return None
        loops = max(s.loops for s in seqs)
        key = (next(b for b in self.buckets if b >= len(seqs)), loops, any(s.loops != loops for s in seqs))
        return None if key in self.failed else key

    def slot_map(self, graph_loops: int, loops: int, window: int) -> np.ndarray:
        """For each slot of a graph laid out for ``graph_loops`` loops (window ``graph_loops``),
        the slot of a row at ``loops`` and ``window`` it stands for: the prelude's and the coda's
        their own, loop r's the row's r mod ``window``, -1 past the row's loops (the null block)."""
        key = (graph_loops, loops, window)
        found = self._slot_maps.get(key)
        if found is None:
            c = self.model.config
            core = [c.n_prelude + (r % window) * c.n_core + i if r < loops else -1
                    for r in range(graph_loops) for i in range(c.n_core)]
            coda = [c.n_prelude + window * c.n_core + j for j in range(c.n_coda)]
            found = self._slot_maps[key] = np.array([*range(c.n_prelude), *core, *coda], dtype=np.int64)
        return found

    @torch.inference_mode()
    def forward(self, seqs: Seq[Sequence]) -> ForwardOutput | None:
        """Each sequence's pending token through the model (stored, then advanced, as
        ``Engine.forward`` does); None when ``seqs`` are not covered or the capture failed."""
        key = self.key(seqs)
        if key is None:
            return None
        for s in seqs:
            s.kv.reserve(s.kv.length + 1)
        g = self.graphs.get(key) or self._open(*key)
        self._fill(g, seqs)
        if self.capture and g.graph is None and not self._captured(key, g):
            return None
        logits, state = self._run(g)
        n = len(seqs)
        loops = [s.loops for s in seqs]
        out = ForwardOutput(logits=logits[:n].clone(), state=state[:n], loops_used=loops)
        counters = self.model.counters
        counters["core_block_calls"] += g.loops
        counters["core_row_loops"] += sum(loops)  # (the graph runs every row L loops: the rest is held)
        self.replays += 1
        advance(self.model, seqs, out, [1] * n)
        return out

    @on_stream
    @torch.inference_mode()
    def capture_ahead(self, loops: int, rows: int | None = None, mixed: bool = False) -> int:
        """Capture the graphs of ``loops`` (every row at ``loops``; with ``mixed`` the graph for
        batches whose rows run at most ``loops``) for every bucket up to ``rows`` rows before any
        request needs them (at startup: a first request does not wait for its capture). The
        batch is all padding, so the warm-up runs write only the pool's null block. Returns how
        many graphs are ready."""
        top = self.buckets[-1] if rows is None else min(rows, self.buckets[-1])
        ready = 0
        for bucket in [b for b in self.buckets if b < top] + [next(b for b in self.buckets if b >= top)]:
            key = (bucket, loops, mixed)
            if key in self.failed:
                continue
            g = self.graphs.get(key) or self._open(*key)
            self._fill(g, [])
            if not self.capture:
                self._step(g)
            ready += g.graph is not None or not self.capture or self._captured(key, g)
        return ready

    # -- buffers -------------------------------------------------------------------------------
    def _open(self, rows: int, loops: int, mixed: bool) -> _Graph:
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        config, dev = self.model.config, self.device
        ctx = StaticContext(self.pool, self.model.rope, rows, slot_count(config, loops, loops), self.max_blocks,
                            self.model.backend)
        pin = dev.type == "cuda"
        dtype = next(self.model.parameters()).dtype
        g = _Graph(ctx=ctx, loops=loops, mixed=mixed,
                   staging=torch.zeros(ctx.inputs.shape, dtype=torch.long, device="cpu", pin_memory=pin),
                   tables=torch.full(ctx.tables.shape, self.pool.null_block, dtype=torch.long, device="cpu",
                                     pin_memory=pin),
                   rows_host=torch.zeros(2, rows, dtype=torch.long, device="cpu", pin_memory=pin),
                   rows_info=torch.zeros(2, rows, dtype=torch.long, device=dev),
                   loop_index=torch.arange(loops, device=dev),
                   warm_state=torch.zeros(rows, config.hidden, dtype=dtype, device=dev),
                   noise=torch.zeros(rows, config.hidden, dtype=torch.float32, device=dev),
                   noise_host=torch.zeros(rows, config.hidden, dtype=torch.float32, device="cpu", pin_memory=pin),
                   held=[None] * rows)
        self.graphs[(rows, loops, mixed)] = g
        return g

    def _fill(self, g: _Graph, seqs: Seq[Sequence]) -> None:
        """Write this step's inputs into ``g``'s buffers (host arrays, then copies to the device)."""
        ctx, n, bs, null = g.ctx, len(seqs), self.pool.block_size, self.pool.null_block
        if g.copied is not None:
            g.copied.synchronize()  # the last replay's copies out of the staging are done
        tokens, positions, n_keys, write = (t.numpy() for t in split_inputs(g.staging, ctx.rows, ctx.n_slots))
        pos = np.zeros(ctx.rows, dtype=np.int64)
        pos[:n] = [s.kv.length for s in seqs]
        tokens[:n, 0] = [s.pending for s in seqs]
        tokens[n:] = 0
        positions[:] = pos
        n_keys[:] = pos + 1
        tables = g.tables.numpy()
        changed = []
        for b in range(ctx.rows):
            kv = seqs[b].kv if b < n else None
            now = None if kv is None else (kv, kv.version)
            if g.held[b] == now:  # (SeqKV compares by identity)
                continue
            tables[b].fill(null)  # a new block, a copied shared block, another sequence, none
            if kv is not None and kv.blocks_per_slot:
                s = seqs[b]
                logical = self.slot_map(g.loops, s.loops, min(s.window, s.loops))  # [S] a slot of the row, or -1
                used = logical >= 0
                tables[b, used, :kv.blocks_per_slot] = np.asarray(kv.tables)[logical[used]]
            g.held[b] = now
            changed.append(b)
        rows = np.arange(ctx.rows)
        blocks = tables[rows[:, None], np.arange(ctx.n_slots)[None, :], (pos // bs)[:, None]]  # [R, S]
        write[:] = (blocks * bs + (pos % bs)[:, None]).T
        ctx.inputs.copy_(g.staging, non_blocking=True)
        for b in changed:
            ctx.tables[b].copy_(g.tables[b], non_blocking=True)
        warm = [b for b, s in enumerate(seqs) if s.warm_state is not None]
        info = g.rows_host.numpy()
        info[0] = 0
        info[0, warm] = 1
        info[1] = g.loops  # (padding rows: every loop, on the null block)
        info[1, :n] = [s.loops for s in seqs]
        g.rows_info.copy_(g.rows_host, non_blocking=True)
        for b in warm:
            g.warm_state[b].copy_(seqs[b].warm_state)  # type: ignore[arg-type]
        if self.model.config.state_init == "randn":
            for b, s in enumerate(seqs):
                g.noise_host[b] = self.model._noise(s.noise_seed, s.kv.length)
            g.noise_host[n:] = 0.0
            g.noise.copy_(g.noise_host, non_blocking=True)

    # -- the step --------------------------------------------------------------------------------
    def _step(self, g: _Graph) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step on ``g``'s buffers: logits ``[R, 1, V]`` and final state ``[R, 1, H]``
        (``LoopedLM.forward`` for one token a row, each row at its loops and window)."""
        model, ctx, c = self.model, g.ctx, self.model.config
        ctx.begin()
        e = model.embed_prelude(ctx.tokens, ctx)  # [R, 1, H]
        if c.state_init == "embed":
            state = e
        elif c.state_init == "zeros":
            state = torch.zeros_like(e)
        else:
            state = g.noise.to(e.dtype)[:, None]
        state = torch.where(g.rows_info[0, :, None, None] > 0, g.warm_state[:, None], state)  # [R, 1, H]
        active = g.rows_info[1, :, None] > g.loop_index if g.mixed else None  # [R, L]: loop r < the row's loops
        for r in range(g.loops):  # slot map: loop r in logical slot r, the row's own slot r mod w in its table
            new = model.core_loop(state, e, ctx, None, c.n_prelude + r * c.n_core)
            state = new if active is None else torch.where(active[:, r, None, None], new, state)
        logits = model.tail(state, ctx, g.loops, None, True)  # [R, 1, V]
        if self.vocab_limit < logits.shape[-1]:  # checkpoint padding past the tokenizer: never sampled
            logits[..., self.vocab_limit:] = float("-inf")
        return logits, state

    def _run(self, g: _Graph) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.capture:
            return self._step(g)
        assert g.out is not None
        with torch.cuda.device(self.device):  # the engine's device may not be the thread's current one
            g.graph.replay()
            g.copied.record()  # once the step has read its inputs, the host may rewrite the staging
        return g.out

    def _captured(self, key: tuple[int, int, bool], g: _Graph) -> bool:
        """Capture ``g``; a step that cannot be captured runs eagerly from now on (False)."""
        try:
            self._capture(g)
        except Exception:
            _log.exception("capturing the decode graph %s failed; it runs eagerly", key)
            self.failed.add(key)
            self.graphs.pop(key, None)
            return False
        return True

    def _capture(self, g: _Graph) -> None:
        """Warm up on a side stream, then capture ``g``'s step into the engine's graph pool."""
        started = time.perf_counter()
        with _CAPTURE_LOCK, torch.cuda.device(self.device):
            side, main = torch.cuda.Stream(), torch.cuda.current_stream()  # type: ignore[no-untyped-call]
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(_WARMUP_RUNS):
                    self._step(g)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                g.out = self._step(g)
            g.graph = graph
            g.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        _log.info("captured the decode graph (rows %d, loops %d%s) in %.0f ms",
                  g.ctx.rows, g.loops, ", mixed" if g.mixed else "", 1000 * (time.perf_counter() - started))
