"""Exit rules inside one forward (``ExitRule`` in ``vocabulary.py`` says what each computes).

``StopTracker`` runs the rules that stop a decoded token's loops early: per row it keeps the
criterion's value at the previous check (the initial state, a uniform distribution, entropy 100,
no argmax, as Huginn's reference starts them) and, after each loop the rule checks, says which rows
exit. ``Selection`` runs the rules that let every loop run and choose what feeds the head
(``gate_select``: one loop's state per position; ``gate_expected``: the head's logits averaged
over the loops by the exit distribution), Ouro's reference semantics.

The model calls them with callbacks (``logits_of``, ``gate_of``) so that the coda and the gate run
only for the rows and loops that need them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tinyloop.vocabulary import ExitRule

__all__ = ["StopTracker", "Selection"]

_LOGIT_KINDS = ("kl", "minp_kl", "entropy_diff", "argmax_stability")


def _minp_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Probabilities under 0.1 * the largest set to 1/V, renormalised; their logs. ``[R, V]``."""
    probs = torch.softmax(logits, dim=-1)
    floor = 0.1 * probs.max(dim=-1, keepdim=True).values
    probs = torch.where(probs < floor, torch.full_like(probs, 1.0 / probs.shape[-1]), probs)
    return (probs / probs.sum(dim=-1, keepdim=True)).log()


def _kl(logp_prev: torch.Tensor, logp_new: torch.Tensor) -> torch.Tensor:
    """KL(p_prev || p_new) per row (``F.kl_div(new, prev, log_target=True)``)."""
    return (logp_prev.exp() * (logp_prev - logp_new)).sum(-1)


class StopTracker:
    """The stop rules of one decode forward (one token per row). ``init`` ``[B, H]`` is each row's
    initial state; ``vocab`` the width of the logits (the uniform first comparison)."""

    def __init__(self, rules: Sequence[ExitRule], loops: Sequence[int], init: torch.Tensor, vocab: int) -> None:
        self.rules = list(rules)
        self.loops = list(loops)
        self.prev_state = init.float().clone()  # [B, H] the state at the previous check
        dev = init.device
        self.prev_logp = torch.full((len(rules), vocab), -math.log(vocab), device=dev)  # [B, V]
        self.prev_entropy = torch.full((len(rules),), 100.0, device=dev)
        self.prev_argmax = torch.full((len(rules),), -1, dtype=torch.long, device=dev)
        self.stable = torch.zeros(len(rules), dtype=torch.long, device=dev)
        self.cdf = torch.zeros(len(rules), device=dev)
        self.remaining = torch.ones(len(rules), device=dev)

    def due(self, b: int, done: int) -> bool:
        """Whether row ``b``'s rule is checked after ``done`` loops (never after its last)."""
        rule = self.rules[b]
        return rule.stops and done < self.loops[b] and rule.checks_after(done)

    def check(self, act: Sequence[int], done: int, state: torch.Tensor,
              logits_of: Callable[[list[int]], torch.Tensor],
              gate_of: Callable[[list[int]], torch.Tensor]) -> list[int]:
        """After loop ``done`` (1-based) of the rows ``act`` (``state`` ``[len(act), H]``, each
        row's state after it): the rows whose rule fires. ``logits_of(js)`` gives the logits
        ``[len(js), V]`` of the rows at indices ``js`` of ``act``; ``gate_of(js)`` their gate
        logits ``[len(js)]``."""
        gate_rows = [j for j, b in enumerate(act) if self.rules[b].kind == "gate"]
        if gate_rows:  # the gate's cumulative probability moves every loop, checked or not
            idx = torch.tensor([act[j] for j in gate_rows], dtype=torch.long, device=self.cdf.device)
            lam = torch.sigmoid(gate_of(gate_rows).float())
            self.cdf[idx] += lam * self.remaining[idx]
            self.remaining[idx] *= 1 - lam
        due = [j for j, b in enumerate(act) if self.due(b, done)]
        if not due:
            return []
        need_logits = [j for j in due if self.rules[act[j]].kind in _LOGIT_KINDS]
        logits = logits_of(need_logits).float() if need_logits else None
        row_of_logits = {j: i for i, j in enumerate(need_logits)}
        fired = []
        for j in due:
            b, rule = act[j], self.rules[act[j]]
            if rule.kind == "gate":
                hit = float(self.cdf[b]) >= rule.threshold
            else:
                value = self._value(b, state[j].float(),
                                    logits[row_of_logits[j]] if logits is not None and j in row_of_logits else None)
                # NaN (the cosine against a zero initial state) never fires
                hit = value >= rule.threshold if rule.kind == "argmax_stability" else value < rule.threshold
            if hit:
                fired.append(b)
        return fired

    def _value(self, b: int, state: torch.Tensor, logits: torch.Tensor | None) -> float:
        """Row ``b``'s criterion now, and its reference point moved to now."""
        kind = self.rules[b].kind
        if kind in ("latent_diff", "cosine"):
            prev, self.prev_state[b] = self.prev_state[b].clone(), state
            if kind == "latent_diff":
                return float((state - prev).norm() / state.norm())
            return float(1 - (state * prev).sum() / state.norm() / prev.norm())
        assert logits is not None
        if kind == "argmax_stability":
            top = int(logits.argmax())
            self.stable[b] = self.stable[b] + 1 if top == int(self.prev_argmax[b]) else 0
            self.prev_argmax[b] = top
            return float(self.stable[b])
        if kind == "entropy_diff":
            probs = torch.softmax(logits, dim=-1)
            entropy = -(probs * (probs + 1e-10).log()).sum()
            value = float((entropy - self.prev_entropy[b]).abs())
            self.prev_entropy[b] = entropy
            return value
        logp = _minp_log_probs(logits[None])[0] if kind == "minp_kl" else logits.log_softmax(-1)
        value = float(_kl(self.prev_logp[b], logp))
        self.prev_logp[b] = logp
        return value


@dataclass(slots=True)
class Selection:
    """The every-loop gate rules over one forward (any number of tokens per row). After loop t,
    per position, lambda_t = sigmoid(gate(state_t)) and p_t = lambda_t * prod_{j<t}(1 - lambda_j)
    in the model's dtype, the row's last loop taking the remaining mass. ``gate_select``: the first
    loop whose cumulative p reaches the threshold (from ``min_loops`` on; else the last loop) gives
    the position's state for the head. ``gate_expected``: the head's logits weighted by p_t."""

    rows: list[int]  # the batch rows under a selection rule
    cdf: torch.Tensor  # [B, T] cumulative exit probability
    remaining: torch.Tensor  # [B, T] prod of (1 - lambda) so far
    picked: torch.Tensor  # [B, T] bool: the position's state is chosen
    chosen: torch.Tensor  # [B, T, H] the chosen states
    expected: dict[int, torch.Tensor]  # gate_expected rows: sum of p_t * logits_t, [T', V]

    @classmethod
    def start(cls, state: torch.Tensor, rules: Sequence[ExitRule]) -> Selection | None:
        rows = [b for b, rule in enumerate(rules) if rule.kind in ("gate_select", "gate_expected")]
        if not rows:
            return None
        shape = state.shape[:2]
        dev = state.device
        return cls(rows, torch.zeros(shape, dtype=state.dtype, device=dev),
                   torch.ones(shape, dtype=state.dtype, device=dev),
                   torch.zeros(shape, dtype=torch.bool, device=dev), torch.zeros_like(state), {})

    def step(self, act: Sequence[int], r: int, h: torch.Tensor, gate: Callable[[torch.Tensor], torch.Tensor],
             rules: Sequence[ExitRule], loops: Sequence[int],
             logits_of: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """After loop ``r``: ``h`` ``[len(act), T, H]`` is the (normed) state of the rows ``act``;
        ``logits_of(b, x)`` the head's logits of batch row ``b`` from its state ``x`` ``[1, T, H]``."""
        for j, b in enumerate(act):
            if b not in self.rows:
                continue
            lam = torch.sigmoid(gate(h[j]).squeeze(-1))  # [T], model dtype
            last = r + 1 == loops[b]
            p = self.remaining[b].clone() if last else lam * self.remaining[b]  # not a view: updated next
            self.remaining[b] = self.remaining[b] * (1.0 - lam)
            if rules[b].kind == "gate_expected":
                logits = logits_of(b, h[j:j + 1])[0]  # [T', V]
                term = logits * p[-logits.shape[0]:, None].to(logits.dtype)
                self.expected[b] = term if b not in self.expected else self.expected[b] + term
                continue
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
        """``state`` with the ``gate_select`` rows' chosen states in place."""
        out = state.clone()
        select = [b for b in self.rows if b not in self.expected]
        out[select] = self.chosen[select]
        return out

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[B, T', V]`` with the ``gate_expected`` rows' averaged logits in place."""
        for b, expected in self.expected.items():
            logits[b] = expected.to(logits.dtype)
        return logits
