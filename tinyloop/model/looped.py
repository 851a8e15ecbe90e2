"""The looped language model: prelude, a core block looped ``loops`` times, coda.

One forward serves prefill (one row, T tokens), batched decode (B rows, one token each) and
verification (one row, k tokens). Rows may run different loop counts and cache windows: at loop
``r`` the core block is called once for the rows still looping, so a row that asked for fewer
loops, or whose exit rule fired, costs nothing more.

    x = embed(tokens) * embed_scale
    e = prelude(x)
    s = initial state (zeros | randn | e | the previous token's final state when warm-starting)
    repeat loops:  h = adapter([s; e]) or s;  h = core(h);  s = final_norm(h) if every_loop else h
    y = final_norm(s) (final_only) -> coda -> final_norm (when there is a coda) -> lm_head
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyloop.model.backend import TORCH, Backend
from tinyloop.model.config import ModelConfig
from tinyloop.model.layers import AttentionContext, Block, RMSNorm, rope_for
from tinyloop.vocabulary import ExitRule

__all__ = ["LoopedLM", "RowSpec", "ForwardOutput"]

_NOISE_MIX = 0x9E3779B97F4A7C15


@dataclass(slots=True)
class RowSpec:
    """How one row of a forward runs.

    ``noise_seed`` seeds the randn initial state per position, so a token's initial state depends
    only on (seed, position), never on batching or chunking. ``positions`` (one per token) are
    those positions when they are not ``start .. start+T-1``: tree verification, where sibling
    nodes share a depth. ``warm_state`` (``[H]``) replaces the initial state of a one-token row
    (warm start). ``exit`` overrides the config's rule. ``kv_loops`` is the loop count the row's
    KV slots were laid out for, when the row runs fewer loops inside them (a speculative draft
    reading and writing the verifier's slots, coda included).
    """

    loops: int
    window: int
    start: int = 0
    noise_seed: int = 0
    warm_state: torch.Tensor | None = None
    exit: ExitRule | None = None
    kv_loops: int | None = None
    positions: Sequence[int] | None = None


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [B, T', V] (T' = 1 when last_only)
    state: torch.Tensor  # [B, T, H] final core state, before the final norm (for warm start)
    loops_used: list[int] = field(default_factory=list)  # loops run by each row


def _exit_fired(rule: ExitRule, new: torch.Tensor, prev: torch.Tensor,
                logp_new: torch.Tensor | None, logp_prev: torch.Tensor | None,
                cdf: torch.Tensor | None) -> torch.Tensor:
    """Per row: did the rule fire after this loop? new/prev ``[R, H]``; returns ``[R]`` bool."""
    if rule.kind == "latent_diff":
        diff = (new.float() - prev.float()).norm(dim=-1)
        fired: torch.Tensor = diff / new.float().norm(dim=-1).clamp_min(1e-12) < rule.threshold
        return fired
    if rule.kind == "kl":
        assert logp_new is not None and logp_prev is not None
        kl = (logp_new.exp() * (logp_new - logp_prev)).sum(-1)
        return kl < rule.threshold
    if rule.kind == "gate":
        assert cdf is not None
        return cdf >= rule.threshold
    return torch.zeros(new.shape[0], dtype=torch.bool)


@dataclass(slots=True)
class _Selection:
    """The ``gate_select`` rule over one forward (the Ouro reference's exit): after loop t, per
    position, lambda_t = sigmoid(gate(state_t)) and p_t = lambda_t * prod_{j<t}(1 - lambda_j) in
    the model's dtype, the row's last loop taking the remaining mass; the first loop whose
    cumulative p reaches the threshold (from ``min_loops`` on; else the last loop) gives the
    position's state for the head. Every loop still runs and writes KV."""

    rows: list[int]  # the batch rows under the rule
    cdf: torch.Tensor  # [B, T] cumulative exit probability
    remaining: torch.Tensor  # [B, T] prod of (1 - lambda) so far
    picked: torch.Tensor  # [B, T] bool: the position's state is chosen
    chosen: torch.Tensor  # [B, T, H] the chosen states

    @classmethod
    def start(cls, state: torch.Tensor, rules: Sequence[ExitRule]) -> _Selection | None:
        rows = [b for b, rule in enumerate(rules) if rule.kind == "gate_select"]
        if not rows:
            return None
        shape = state.shape[:2]
        return cls(rows, torch.zeros(shape, dtype=state.dtype), torch.ones(shape, dtype=state.dtype),
                   torch.zeros(shape, dtype=torch.bool), torch.zeros_like(state))

    def step(self, act: list[int], r: int, h: torch.Tensor, gate: nn.Module, rules: Sequence[ExitRule],
             loops: Sequence[int]) -> None:
        """After loop ``r``: ``h`` ``[len(act), T, H]`` is the (normed) state of the rows ``act``."""
        for j, b in enumerate(act):
            if b not in self.rows:
                continue
            lam = torch.sigmoid(gate(h[j]).squeeze(-1))  # [T], model dtype
            last = r + 1 == loops[b]
            p = self.remaining[b] if last else lam * self.remaining[b]
            self.remaining[b] = self.remaining[b] * (1.0 - lam)
            self.cdf[b] = self.cdf[b] + p
            if last:
                fires = torch.ones_like(self.picked[b])
            elif r + 1 >= rules[b].min_loops:
                fires = self.cdf[b] >= rules[b].threshold
            else:
                fires = torch.zeros_like(self.picked[b])
            new = fires & ~self.picked[b]
            self.chosen[b][new] = h[j][new]
            self.picked[b] |= new

    def states(self, state: torch.Tensor) -> torch.Tensor:
        """``state`` with the selected rows' chosen states in place."""
        out = state.clone()
        out[self.rows] = self.chosen[self.rows]
        return out


class LoopedLM(nn.Module):
    """Huginn-style and Ouro-style looped transformers under one config."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden)
        self.prelude = nn.ModuleList(Block(c) for _ in range(c.n_prelude))
        self.core = nn.ModuleList(Block(c) for _ in range(c.n_core))
        self.coda = nn.ModuleList(Block(c) for _ in range(c.n_coda))
        if c.injection == "concat_linear":
            self.adapter = nn.Linear(2 * c.hidden, c.hidden, bias=False)
        self.final_norm = RMSNorm(c.hidden, c.norm_eps, c.norm_order == "cast_then_weight")
        if not c.tie_embeddings:
            self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        if c.has_exit_gate:
            self.exit_gate = nn.Linear(c.hidden, 1, bias=True)
        self.rope = rope_for(c)
        # Work counters: tests assert compute grows with loops by counting, never by timing.
        self.counters: Counter[str] = Counter()
        self.backend: Backend = TORCH

    def use_backend(self, backend: Backend) -> None:
        """Run this model's norms, RoPE and (through the contexts the engine builds) attention
        and KV on ``backend`` (``backend.py``); ``TORCH`` is the default."""
        self.backend = backend
        self.rope.backend = backend
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.backend = backend

    def _apply(self, fn: Any, recurse: bool = True) -> LoopedLM:
        """``.to(device)`` and friends move the RoPE tables too (they are not parameters)."""
        out: LoopedLM = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        device = self.embed.weight.device
        if device.type != "meta":
            self.rope.cos = self.rope.cos.to(device)
            self.rope.sin = self.rope.sin.to(device)
        return out

    # -- pieces --------------------------------------------------------------------------------
    def head(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.config.tie_embeddings else self.lm_head.weight
        # As 2-D rows: a strided [B, 1, H] view (a prefill's last positions) would send F.linear
        # to bmm, which copies the whole weight per row in bf16 (1.5 s at Ouro-1.4B's vocabulary).
        return F.linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)

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
            s = torch.empty_like(e)
            for b, spec in enumerate(specs):
                positions = spec.positions or range(spec.start, spec.start + e.shape[1])
                for t, pos in enumerate(positions):
                    g = torch.Generator().manual_seed((spec.noise_seed * _NOISE_MIX + pos) % 2**63)
                    noise = torch.randn(c.hidden, generator=g).clamp_(-3.0, 3.0) * c.state_init_std
                    s[b, t] = noise.to(e.dtype)
        for b, spec in enumerate(specs):
            if spec.warm_state is not None:
                s[b, -1] = spec.warm_state.to(s.dtype)
        return s

    def inject(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        if self.config.injection == "concat_linear":
            out: torch.Tensor = self.adapter(torch.cat([s, e], dim=-1))
            return out
        return s

    def tail(self, s: torch.Tensor, ctx: AttentionContext, windows: torch.Tensor,
             rows: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        """final norm, coda, final norm, head: state ``[R, T, H]`` -> logits ``[R, T', V]``."""
        c = self.config
        x = self.final_norm(s) if c.loop_norm == "final_only" else s
        base = c.n_prelude + windows * c.n_core
        for j, layer in enumerate(self.coda):
            x = layer(x, ctx, self.rope, rows, base + j)
        if c.n_coda:
            x = self.final_norm(x)
        if last_only:
            x = x[:, -1:]
        return self.head(x)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, ctx: AttentionContext, specs: Sequence[RowSpec],
                last_only: bool = True) -> ForwardOutput:
        """tokens ``[B, T]``: one forward of B rows through prelude, loops and coda."""
        c = self.config
        bsz, n_tok = tokens.shape
        loops = [s.loops for s in specs]
        windows = torch.tensor([min(s.window, s.kv_loops or s.loops) for s in specs],
                               dtype=torch.long)  # [B]
        x = self.embed(tokens)  # [B, T, H]
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        for i, layer in enumerate(self.prelude):
            x = layer(x, ctx, self.rope, None, torch.full((bsz,), i, dtype=torch.long))
        e = x
        state = self.initial_state(e, specs)
        rules = [s.exit if s.exit is not None else c.exit for s in specs]
        can_exit = n_tok == 1 and any(r.kind not in ("none", "gate_select") for r in rules)
        select = _Selection.start(state, rules)
        exited = [False] * bsz
        done = [0] * bsz
        cdf = torch.zeros(bsz)
        remaining = torch.ones(bsz)
        logp_prev: list[torch.Tensor | None] = [None] * bsz
        for r in range(max(loops)):
            act = [b for b in range(bsz) if loops[b] > r and not exited[b]]
            if not act:
                break
            rows = None if len(act) == bsz else torch.tensor(act, dtype=torch.long)
            win = windows if rows is None else windows[rows]
            h = self.inject(state if rows is None else state[rows], e if rows is None else e[rows])
            for i, layer in enumerate(self.core):
                h = layer(h, ctx, self.rope, rows, c.n_prelude + (r % win) * c.n_core + i)
            if c.loop_norm == "every_loop":
                h = self.final_norm(h)
            prev = state if rows is None else state[rows]
            if rows is None:
                state = h
            else:
                state = state.index_copy(0, rows, h)
            self.counters["core_block_calls"] += 1
            self.counters["core_row_loops"] += len(act) * n_tok
            for b in act:
                done[b] += 1
            if select is not None:
                select.step(act, r, h, self.exit_gate, rules, loops)
            if can_exit:
                self._check_exits(act, rows, r, h, prev, rules, loops, exited, cdf, remaining,
                                  logp_prev, ctx, windows)
        logits = self.tail(state if select is None else select.states(state), ctx, windows, None, last_only)
        return ForwardOutput(logits=logits, state=state, loops_used=done)

    def _check_exits(self, act: list[int], rows: torch.Tensor | None, r: int, h: torch.Tensor,
                     prev: torch.Tensor, rules: list[ExitRule], loops: list[int], exited: list[bool],
                     cdf: torch.Tensor, remaining: torch.Tensor, logp_prev: list[torch.Tensor | None],
                     ctx: AttentionContext, windows: torch.Tensor) -> None:
        """Mark rows whose exit rule fired after loop ``r`` and fill the slots they skip."""
        c = self.config
        idx = torch.tensor(act, dtype=torch.long)
        kinds = {rules[b].kind for b in act}
        logp_new = None
        if "kl" in kinds:
            logp_new = self.tail(h, ctx, windows[idx], rows, True)[:, -1].float().log_softmax(-1)
        if "gate" in kinds:
            normed = self.final_norm(h) if c.loop_norm == "final_only" else h
            lam = torch.sigmoid(self.exit_gate(normed[:, -1]).float().squeeze(-1))  # [R]
            cdf[idx] += lam * remaining[idx]
            remaining[idx] *= 1 - lam
        fired_rows = []
        for j, b in enumerate(act):
            rule = rules[b]
            lp_prev = logp_prev[b]
            if logp_new is not None:
                logp_prev[b] = logp_new[j]
            if rule.kind == "none" or r + 1 < rule.min_loops or r + 1 >= loops[b]:
                continue
            if rule.kind == "kl" and lp_prev is None:
                continue  # KL compares two successive loops
            fired = _exit_fired(rule, h[j:j + 1, -1], prev[j:j + 1, -1],
                                None if logp_new is None else logp_new[j:j + 1],
                                None if lp_prev is None else lp_prev[None],
                                cdf[b:b + 1])
            if bool(fired[0]):
                exited[b] = True
                fired_rows.append(b)
        if fired_rows:
            self._fill_skipped_slots(fired_rows, r, loops, windows, ctx)

    def _fill_skipped_slots(self, rows: list[int], r: int, loops: list[int],
                            windows: torch.Tensor, ctx: AttentionContext) -> None:
        """An exited token's unwritten loop slots get its last written K,V (DESIGN.md)."""
        c = self.config
        for b in rows:
            w = int(windows[b])
            targets = {(q % w) for q in range(r + 1, min(loops[b], r + w))} - {r % w}
            for t in sorted(targets):
                for i in range(c.n_core):
                    src = torch.tensor([c.n_prelude + (r % w) * c.n_core + i])
                    dst = torch.tensor([c.n_prelude + t * c.n_core + i])
                    ctx.copy_new(torch.tensor([b]), src, dst)  # type: ignore[attr-defined]
