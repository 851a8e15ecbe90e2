"""The looped language model: prelude, a core block looped ``loops`` times, coda.

One forward serves prefill (one row, T tokens), batched decode (B rows, one token each) and
verification (one row, k tokens). Rows may run different loop counts and cache windows: at loop
``r`` the core block is called once for the rows still looping, so a row that asked for fewer
loops, or whose exit rule fired, costs nothing more.

    x = embed(tokens) * embed_scale
    e = prelude(x), then prelude_norm(e) (Parcae)
    s = initial state (zeros | randn | e | the previous token's final state when warm-starting)
    repeat loops:  h = adapter([s; e]) | s * decay + dt * B e (diagonal) | s;  h = core(h);
                   s = final_norm(h) if every_loop else h
    y = final_norm(s) (final_only) | loop_out(s) (Parcae) -> coda -> final_norm (when there is a
    coda) -> lm_head
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from tinyloop.model.backend import TORCH, Backend
from tinyloop.model.config import ModelConfig
from tinyloop.model.cpu_linear import PackedWeight, unpack_linears
from tinyloop.model.exits import Selection, StopTracker
from tinyloop.model.layers import MLP, AttentionContext, Block, RMSNorm, rope_for
from tinyloop.model.quant import QuantWeight
from tinyloop.vocabulary import ExitRule

__all__ = ["Burst", "LoopedLM", "RowSpec", "ForwardOutput"]

_NOISE_MIX = 0x9E3779B97F4A7C15
_NOISE_CACHE_BYTES = 16 << 20  # randn initial states kept (LoopedLM._noise): 16k positions at hidden 256


class WholeStep(Protocol):
    """A plain decode step in one call (``cpu.step.FusedStep``): ``tokens`` ``[B, 1]`` through
    ``loops`` loops in ``window`` slots from ``state`` ``[B, 1, H]``: logits ``[B, 1, V]`` and
    the last loop's state, or None where it does not cover the call."""

    def run(self, tokens: torch.Tensor, ctx: AttentionContext, loops: int, window: int,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def burst(self, token: int, ctx: AttentionContext, loops: int, window: int, init: torch.Tensor | None,
              limit: int, stops: tuple[int, ...], min_prob: float = 0.0) -> Burst | None: ...


class Burst(NamedTuple):
    """A greedy burst's picks (``LoopedLM.decode_burst``): a step whose logits could not be
    sampled from (a NaN or +inf, or nothing finite) ends it, ``unusable``, and picks nothing."""

    tokens: list[int]
    unusable: bool


@dataclass(slots=True)
class RowSpec:
    """How one row of a forward runs.

    ``noise_seed`` seeds the randn initial state per position, so a token's initial state depends
    only on (seed, position), never on batching or chunking. ``positions`` (one per token) are
    those positions when they are not ``start .. start+T-1``: tree verification, where sibling
    nodes share a depth. ``warm_state`` (``[H]``) replaces the initial state of a one-token row
    (warm start). ``exit`` overrides the config's rule. ``kv_loops`` is the loop count the row's
    KV slots were laid out for, when the row runs fewer loops inside them (a speculative draft
    reading and writing the verifier's slots, coda included). ``last``: the index of the row's
    last token when the row is right-padded (a batched prefill): its ``last_only`` logits come
    from there; None is the row's last column.
    """

    loops: int
    window: int
    start: int = 0
    noise_seed: int = 0
    warm_state: torch.Tensor | None = None
    exit: ExitRule | None = None
    kv_loops: int | None = None
    positions: Sequence[int] | None = None
    last: int | None = None


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [B, T', V] (T' = 1 when last_only)
    state: torch.Tensor  # [B, T, H] final core state, before the final norm (for warm start)
    loops_used: list[int] = field(default_factory=list)  # loops run by each row


class DiagonalInjection(nn.Module):
    """Parcae's injection: ``s * exp(-dt * exp(A_log)) + dt * (e @ B.T)``, ``dt = softplus(dt_bias)``
    (a per-channel decay of the state and a linear map of the prelude's output)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(hidden))
        self.dt_bias = nn.Parameter(torch.zeros(hidden))
        self.B = nn.Parameter(torch.zeros(hidden, hidden))

    def forward(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(self.dt_bias)
        decay = torch.exp(-dt * torch.exp(self.A_log))
        out: torch.Tensor = s * decay + dt * (e @ self.B.T)
        return out


class LoopedLM(nn.Module):
    """Huginn-style, Ouro-style and Parcae-style looped transformers under one config."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        cast_first = c.norm_order == "cast_then_weight"
        self.embed = nn.Embedding(c.vocab_size, c.hidden)
        ve = set(c.value_embeds)  # layers counted prelude, core, coda
        self.prelude = nn.ModuleList(Block(c, i in ve) for i in range(c.n_prelude))
        self.core = nn.ModuleList(Block(c, c.n_prelude + i in ve) for i in range(c.n_core))
        self.coda = nn.ModuleList(Block(c, c.n_prelude + c.n_core + i in ve) for i in range(c.n_coda))
        if c.prelude_norm:
            self.prelude_norm = RMSNorm(c.hidden, c.norm_eps, cast_first)
        self.adapter: nn.Module
        if c.injection == "concat_linear":
            self.adapter = nn.Linear(2 * c.hidden, c.hidden, bias=False)
        elif c.injection == "diagonal":
            self.adapter = DiagonalInjection(c.hidden)
        if c.loop_output == "linear":
            self.loop_out = nn.Linear(c.hidden, c.hidden, bias=False)
        self.final_norm = RMSNorm(c.hidden, c.norm_eps, cast_first)
        if not c.tie_embeddings:
            self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        if c.has_exit_gate:
            self.exit_gate = nn.Linear(c.hidden, 1, bias=True)
        self.rope = rope_for(c)
        # Work counters: tests assert compute grows with loops by counting, never by timing.
        self.counters: Counter[str] = Counter()
        self._noise_cache: dict[tuple[int, int], torch.Tensor] = {}  # (seed, position) -> [H] (``_noise``)
        self.backend: Backend = TORCH
        # the head's CPU layout (cpu_linear.pack_linears) or quantized copy (quant.quantize_linears)
        self.packed_head: PackedWeight | QuantWeight | None = None
        # the whole plain decode step in one C call (``cpu.step.FusedStep``; ``use_cpu_kernels``)
        self.fused_step: WholeStep | None = None

    def use_backend(self, backend: Backend) -> None:
        """Run this model's norms, SwiGLU, RoPE and (through the contexts the engine builds)
        attention and KV on ``backend`` (``backend.py``); ``TORCH`` is the default."""
        self.backend = backend
        self.rope.backend = backend
        for module in self.modules():
            if isinstance(module, RMSNorm | MLP | Block):
                module.backend = backend

    def _apply(self, fn: Any, recurse: bool = True) -> LoopedLM:
        """``.to(device)`` and friends move the RoPE tables too (they are not parameters)."""
        out: LoopedLM = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        unpack_linears(self)  # a new dtype or device: the packed layouts would be stale
        device = self.embed.weight.device
        if device.type != "meta":
            self.rope.to(device)
        return out

    # -- pieces --------------------------------------------------------------------------------
    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight ``[V, H]`` (a parameter): the embedding's when tied."""
        return self.embed.weight if self.config.tie_embeddings else self.lm_head.weight

    def head(self, x: torch.Tensor) -> torch.Tensor:
        # As 2-D rows: a strided [B, 1, H] view (a prefill's last positions) would send F.linear
        # to bmm, which copies the whole weight per row in bf16 (1.5 s at Ouro-1.4B's vocabulary).
        rows = x.reshape(-1, x.shape[-1])
        logits = F.linear(rows, self.head_weight) if self.packed_head is None else self.packed_head.linear(rows)
        return logits.view(*x.shape[:-1], -1)

    def core_slot(self, loop: int, layer: int, window: int) -> int:
        return self.config.n_prelude + (loop % window) * self.config.n_core + layer

    def coda_slot(self, layer: int, window: int) -> int:
        return self.config.n_prelude + window * self.config.n_core + layer

    def initial_state(self, e: torch.Tensor, specs: Sequence[RowSpec]) -> torch.Tensor:
        """The core state before the first loop, ``[B, T, H]``."""
        c = self.config
        if c.state_init == "embed":
            s = e.clone()
        elif c.state_init == "zeros":
            s = torch.zeros_like(e)
        else:
            draws = [self._noise(spec.noise_seed, pos) for spec in specs
                     for pos in (spec.positions or range(spec.start, spec.start + e.shape[1]))]
            s = torch.stack(draws).view(e.shape).to(device=e.device, dtype=e.dtype)
        for b, spec in enumerate(specs):
            if spec.warm_state is not None:
                s[b, -1] = spec.warm_state.to(s.dtype)
        return s

    def _noise(self, seed: int, pos: int) -> torch.Tensor:
        """The randn initial state of position ``pos`` under ``seed``, ``[H]`` float32 on the host:
        drawn once, then kept (a draw is a generator and five ops, per row and token; the oldest
        draws go first past ``_NOISE_CACHE_BYTES``)."""
        key = (seed, pos)
        noise = self._noise_cache.get(key)
        if noise is None:
            c = self.config
            g = torch.Generator().manual_seed((seed * _NOISE_MIX + pos) % 2**63)
            std = c.state_init_std  # the reference's law: a normal truncated at 3 std
            noise = nn.init.trunc_normal_(torch.empty(c.hidden, device="cpu"), 0.0, std, -3 * std, 3 * std,
                                          generator=g)
            self.counters["noise_draws"] += 1
            if len(self._noise_cache) * c.hidden * 4 >= _NOISE_CACHE_BYTES:
                # engine replicas share the model and step in two threads: either may evict first
                self._noise_cache.pop(next(iter(self._noise_cache), None), None)  # type: ignore[arg-type]
            self._noise_cache[key] = noise
        return noise

    def inject(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        if self.config.injection == "concat_linear":
            out: torch.Tensor = self.adapter(torch.cat([s, e], dim=-1))
            return out
        if self.config.injection == "diagonal":
            out = self.adapter(s, e)
            return out
        return s

    def tail(self, s: torch.Tensor, ctx: AttentionContext, windows: torch.Tensor | int,
             rows: torch.Tensor | None, last_only: bool, ends: torch.Tensor | None = None,
             ids: torch.Tensor | None = None) -> torch.Tensor:
        """final norm (or the loop's output projection), coda, final norm, head: state ``[R, T, H]``
        -> logits ``[R, T', V]`` (``windows``: each row's, or one for all; ``ends``: every batch
        row's last column ``[B]`` when rows are right-padded; ``ids``: every batch row's tokens
        ``[B, T]``, which layers with value embeddings read)."""
        c = self.config
        x = self.final_norm(s) if c.loop_norm == "final_only" else s
        if c.loop_output == "linear":
            x = self.loop_out(x)
        x = self.stack(self.coda, x, ctx, rows, c.n_prelude + windows * c.n_core, ids)
        if c.n_coda or c.loop_norm == "none":  # "none": the one final_norm comes after the coda
            x = self.final_norm(x)
        if last_only:
            if ends is None:
                x = x[:, -1:]
            else:  # each row's own last column
                x = x[torch.arange(x.shape[0], device=x.device), ends if rows is None else ends[rows]][:, None]
        return self.head(x)

    def stack(self, blocks: nn.ModuleList, x: torch.Tensor, ctx: AttentionContext, rows: torch.Tensor | None,
              base: torch.Tensor | int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """x through ``blocks``, block i at slot ``base + i`` (one per row, or one for all); each
        block's input norm comes out of the block before's last backend call (``Block.run``).
        ``ids``: every batch row's tokens ``[B, T]`` (value embeddings), taken at ``rows``."""
        layers = cast(Sequence[Block], blocks)
        if ids is not None and rows is not None:
            ids = ids[rows]
        if rows is None and isinstance(base, int) and len(layers) and (first := layers[0].fused) is not None:
            out = first.run_stack(blocks, x, ctx, base)  # a plain decode step: the stack in one call
            if out is not None:
                return out
        normed = None
        for i, layer in enumerate(layers):
            then = layers[i + 1].attn_norm if i + 1 < len(layers) and layer.style != "post_ln" else None
            x, normed = layer.run(x, ctx, self.rope, rows, base + i, normed, then, ids)
        return x

    def embed_prelude(self, tokens: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """tokens ``[B, T]`` -> the prelude's output e ``[B, T, H]`` (injected at every loop)."""
        x: torch.Tensor = self.embed(tokens)  # [B, T, H]
        if self.config.embed_scale != 1.0:
            x = x * self.config.embed_scale
        e = self.stack(self.prelude, x, ctx, None, 0, tokens)
        return self.prelude_norm(e) if self.config.prelude_norm else e

    def core_loop(self, state: torch.Tensor, e: torch.Tensor, ctx: AttentionContext, rows: torch.Tensor | None,
                  base: torch.Tensor | int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """One loop of the core block for ``rows`` (None: all) of ``state``, their first core slot
        ``base`` (one per row, or one for all): the new state of those rows ``[R, T, H]``
        (``ids``: every row's tokens, for value embeddings)."""
        h = self.inject(state if rows is None else state[rows], e if rows is None else e[rows])
        h = self.stack(self.core, h, ctx, rows, base, ids)
        out: torch.Tensor = self.final_norm(h) if self.config.loop_norm == "every_loop" else h
        return out

    # -- forward -------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, ctx: AttentionContext, specs: Sequence[RowSpec],
                last_only: bool = True) -> ForwardOutput:
        """tokens ``[B, T]``: one forward of B rows through prelude, loops and coda."""
        c = self.config
        bsz, n_tok = tokens.shape
        loops = [s.loops for s in specs]
        dev = self.embed.weight.device
        wins = [min(s.window, s.kv_loops or s.loops) for s in specs]
        # one window for every row (the usual case): a layer's slot is one int, found without index ops
        window = wins[0] if wins.count(wins[0]) == bsz else None
        rules = [s.exit if s.exit is not None else c.exit for s in specs]
        if n_tok == 1 and self.fused_step is not None and window is not None and (
                fused := self._fused_decode(tokens, ctx, specs, loops, window, rules)) is not None:
            return fused
        windows = torch.tensor(wins, dtype=torch.long, device=dev)  # [B]
        e = self.embed_prelude(tokens, ctx)
        ids = tokens if c.value_embeds else None  # the layers with value embeddings read them
        state = self.initial_state(e, specs)
        stops = None  # rules that stop a decoded token early run one token per row
        if n_tok == 1 and any(rule.stops for rule in rules):
            stops = StopTracker(rules, loops, state[:, -1], c.vocab_size)
        select = Selection.start(state, rules)
        ends = None if all(s.last is None for s in specs) else torch.tensor(
            [n_tok - 1 if s.last is None else s.last for s in specs], dtype=torch.long, device=dev)  # [B]
        exited = [False] * bsz
        done = [0] * bsz
        for r in range(max(loops)):
            act = [b for b in range(bsz) if loops[b] > r and not exited[b]]
            if not act:
                break
            rows = None if len(act) == bsz else torch.tensor(act, dtype=torch.long, device=dev)
            win = windows if rows is None else windows[rows]
            # each row's first core slot this loop
            h = self.core_loop(state, e, ctx, rows, c.n_prelude + (r % (win if window is None else window)) * c.n_core,
                               ids)
            state = h if rows is None else state.index_copy(0, rows, h)
            self.counters["core_block_calls"] += 1
            self.counters["core_row_loops"] += len(act) * n_tok
            for b in act:
                done[b] += 1
            if select is not None:
                select.step(act, r, h, self.exit_gate, rules, loops,
                            lambda b, hb: self.tail(hb, ctx, windows[b:b + 1], torch.tensor([b], device=dev),
                                                    last_only, ends, ids))
            if stops is not None:
                fired = stops.check(act, r + 1, h[:, -1], self._logits_of(act, h, ctx, windows, ids),
                                    self._gate_of(h))
                for b in fired:
                    exited[b] = True
                copies = [b for b in fired if rules[b].exited_kv == "copy_latest"]
                if copies:
                    self._fill_skipped_slots(copies, r, loops, windows, ctx)
        logits = self.tail(state if select is None else select.states(state), ctx,
                           windows if window is None else window, None, last_only, ends, ids)
        if select is not None:
            logits = select.logits(logits)
        return ForwardOutput(logits=logits, state=state, loops_used=done)

    def _fused_decode(self, tokens: torch.Tensor, ctx: AttentionContext, specs: Sequence[RowSpec], loops: list[int],
                      window: int, rules: list[ExitRule]) -> ForwardOutput | None:
        """``forward`` of one token a row as one C call (``cpu.step``) where the step is plain:
        every row the same loops (and window), no exit rule, no warm state, no given positions;
        None where it is not (or the call is not one the C step covers)."""
        n = loops[0]
        if (loops.count(n) != len(loops) or any(rule.kind != "none" for rule in rules)
                or any(s.warm_state is not None or s.positions is not None for s in specs)):
            return None
        assert self.fused_step is not None
        shape = (tokens.shape[0], 1, self.config.hidden)
        state = torch.empty(shape, device=tokens.device)  # zeros or each row's noise ("embed": made in the step)
        if self.config.state_init != "embed":
            state = self.initial_state(state, specs).contiguous()
        done = self.fused_step.run(tokens, ctx, n, window, state)
        if done is None:
            return None
        self.counters["core_block_calls"] += n
        self.counters["core_row_loops"] += n * len(loops)
        self.counters["fused_steps"] += 1
        return ForwardOutput(logits=done[0], state=done[1], loops_used=list(loops))

    def decode_burst(self, token: int, ctx: AttentionContext, spec: RowSpec, n: int, limit: int,
                     stops: tuple[int, ...], min_prob: float = 0.0) -> Burst | None:
        """One row's ``n`` greedy decode steps over ``ctx``'s new positions in one C call
        (``fused_step.burst``): the first feeds ``token``, each later one the argmax (ids below
        ``limit``) of the step before, until a pick in ``stops`` or one whose softmax probability
        is below ``min_prob`` (a speculative draft chain's stop). Each step is the one
        ``forward`` takes a plain decode token through; None where the row is not plain (an exit
        rule, a warm state, given positions) or the model or context has no such call."""
        rule = spec.exit if spec.exit is not None else self.config.exit
        if (self.fused_step is None or rule.kind != "none" or spec.warm_state is not None
                or spec.positions is not None):
            return None
        init = None
        if self.config.state_init not in ("zeros", "embed"):  # each position's noise, as forward draws it
            init = self.initial_state(torch.empty(1, n, self.config.hidden), [spec]).view(n, -1).contiguous()
        window = min(spec.window, spec.kv_loops or spec.loops)
        done = self.fused_step.burst(token, ctx, spec.loops, window, init, limit, stops, min_prob)
        if done is not None:
            steps = len(done.tokens) + int(done.unusable)
            self.counters["core_block_calls"] += spec.loops * steps
            self.counters["core_row_loops"] += spec.loops * steps
            self.counters["fused_steps"] += steps
            self.counters["bursts"] += 1
        return done

    def _logits_of(self, act: list[int], h: torch.Tensor, ctx: AttentionContext, windows: torch.Tensor,
                   ids: torch.Tensor | None) -> Callable[[list[int]], torch.Tensor]:
        """For a stop rule: the logits ``[len(js), V]`` of the active rows at indices ``js``, the
        coda run on their current state."""
        def logits_of(js: list[int]) -> torch.Tensor:
            rows = torch.tensor([act[j] for j in js], dtype=torch.long, device=windows.device)
            return self.tail(h[js], ctx, windows[rows], rows, True, None, ids)[:, -1]
        return logits_of

    def _gate_of(self, h: torch.Tensor) -> Callable[[list[int]], torch.Tensor]:
        """For the ``gate`` stop rule: the exit gate's logit ``[len(js)]`` of the rows at ``js``."""
        def gate_of(js: list[int]) -> torch.Tensor:
            x = h[js][:, -1]
            normed = self.final_norm(x) if self.config.loop_norm == "final_only" else x
            logit: torch.Tensor = self.exit_gate(normed).squeeze(-1)
            return logit
        return gate_of

    def _fill_skipped_slots(self, rows: list[int], r: int, loops: list[int],
                            windows: torch.Tensor, ctx: AttentionContext) -> None:
        """An exited token's unwritten loop slots get its last written K,V (``copy_latest``)."""
        c = self.config
        for b in rows:
            w = int(windows[b])
            targets = {(q % w) for q in range(r + 1, min(loops[b], r + w))} - {r % w}
            for t in sorted(targets):
                for i in range(c.n_core):
                    src = torch.tensor([c.n_prelude + (r % w) * c.n_core + i], device=windows.device)
                    dst = torch.tensor([c.n_prelude + t * c.n_core + i], device=windows.device)
                    ctx.copy_new(torch.tensor([b], device=windows.device), src, dst)  # type: ignore[attr-defined]
