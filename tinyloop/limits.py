"""A model's limits: the one place that checks a request against the model and resolves its
defaults (loops, cache window, exit rule, KV worst case).

No torch and no trio: ``ModelLimits`` is built from plain numbers (``from_engine`` reads them off
a loaded engine). ``check`` raises ``RequestError`` naming the field (``PromptTooLongError`` for
the context) before any work is queued; the HTTP layer maps those errors to 400s.

The checks, in order (the first that fails is reported):

    loops          loops <= max_loops                                       param loops
    context        len(prompt) + max_tokens <= max_seq_len                  max_tokens (PromptTooLongError)
                   (max_tokens may be 0: the prompt alone, for its logprobs)
    min_tokens     min_tokens <= max_tokens (vLLM's rule)                   min_tokens
                   no min_tokens with a constraint (the grammar ends it)    min_tokens
    vocabulary     every prompt token id < vocab_size                       prompt
                   every logit_bias token id < vocab_size                   logit_bias
    exit           a ``gate`` rule needs a model with an exit gate          exit
                   exit.min_loops <= loops (adaptive rules)                 exit
    speculation    no adaptive exit rule                                    mode
                   draft_loops <= loops                                     draft_loops
                   cache_window >= loops                                    cache_window
    KV             the request's worst case fits the whole KV pool          max_tokens

A request that sets no ``max_tokens`` gets ``ModelLimits.max_tokens``: what is left of the
model's own context after the prompt (``trained_context``: the context its artifact says it was
built for, which the served context may extend), vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tinyloop.errors import PromptTooLongError, RequestError
from tinyloop.requests import GenerationRequest
from tinyloop.vocabulary import ExitRule, LayerShape, kv_slots_per_token

__all__ = ["KVLimits", "ModelLimits", "Resolved"]


@dataclass(frozen=True, slots=True)
class KVLimits:
    """The KV pool every request must fit in: its blocks, their size, and the model's layer
    counts (``layers``: any object with ``n_prelude``/``n_core``/``n_coda``, e.g. the config)."""

    num_blocks: int
    block_size: int
    layers: LayerShape

    def slots(self, loops: int, window: int) -> int:
        """KV slots per token at ``loops`` with a cache window of ``window``."""
        return kv_slots_per_token(self.layers, loops, window)

    def worst_blocks(self, length: int, loops: int, window: int, beams: int = 1) -> int:
        """Blocks a sequence of ``length`` tokens holds, times its beams."""
        return self.slots(loops, window) * -(-length // self.block_size) * beams


@dataclass(frozen=True, slots=True)
class Resolved:
    """A checked request's values, its defaults filled in."""

    loops: int  # the request's loops, or the model's default
    window: int  # KV slots kept per core layer: min(cache_window or loops, loops)
    exit: ExitRule  # the rule it runs under: its own, or the model's
    kv_blocks: int | None  # the most KV blocks it can hold (None: no pool known)


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a model accepts. ``exit`` is the model's own exit rule (a ``gate`` rule means the
    model has an exit gate); ``kv`` the KV pool (None: the KV worst case is not checked)."""

    max_seq_len: int  # prompt and completion together
    vocab_size: int  # token ids must be below this
    default_loops: int  # loops when a request does not ask
    max_loops: int  # the most loops a request may ask for
    exit: ExitRule = field(default_factory=ExitRule)
    kv: KVLimits | None = None
    gate: bool = False  # the model has an exit gate although its own rule is not ``gate``
    coda: bool = False  # the model has coda layers (after the loop)
    trained_context: int | None = None  # the context the model was built for (None: not known)
    architecture: str = "looped"  # ``ModelConfig.architecture``: inkling2 refuses what it does not define

    @classmethod
    def from_engine(cls, engine: Any) -> ModelLimits:
        """The limits of a loaded engine (anything with ``config``, ``max_seq_len`` and, for the
        KV check, ``pool``)."""
        c = engine.config
        pool = getattr(engine, "pool", None)
        kv = None if pool is None else KVLimits(pool.num_blocks, pool.block_size, c)
        return cls(max_seq_len=engine.max_seq_len, vocab_size=c.vocab_size,
                   default_loops=c.default_loops, max_loops=c.max_loops, exit=c.exit, kv=kv,
                   gate=c.has_exit_gate, coda=c.n_coda > 0, architecture=c.architecture)

    @property
    def has_gate(self) -> bool:
        """Whether the model has an exit gate (a request may then ask for the ``gate`` rule)."""
        return self.gate or self.exit.needs_gate

    def loops(self, asked: int | None) -> int:
        """The loops a request runs at: what it asked, or the model's default."""
        return asked or self.default_loops

    def max_tokens(self, prompt_len: int, asked: int | None, default: int | None = None) -> int:
        """The tokens a request may generate: ``asked`` when the client set it (``check`` then
        holds it to the served context); else the route's ``default`` (None: no cap of its own)
        capped by what is left of the model's own context after the prompt (vLLM's default:
        context - prompt). A prompt that already fills the model's own context, or a model
        whose own context is not known, is left the served context's room instead."""
        if asked is not None:
            return asked
        room = self.max_seq_len - prompt_len
        if self.trained_context is not None and self.trained_context > prompt_len:
            room = min(room, self.trained_context - prompt_len)
        return room if default is None else min(default, room)

    def outside_vocabulary(self, tokens: Sequence[int]) -> int | None:
        """The first token id that is not in the vocabulary, or None."""
        return next((t for t in tokens if t >= self.vocab_size), None)

    def check(self, req: GenerationRequest) -> Resolved:
        """``req`` checked against the model (``RequestError`` naming the field otherwise), its
        defaults resolved."""
        loops = self.loops(req.loops)
        if loops > self.max_loops:
            raise RequestError(f"loops must be <= {self.max_loops} for this model", param="loops")
        window = min(req.cache_window or loops, loops)
        prompt_len = len(req.prompt_tokens)
        if prompt_len + req.max_tokens > self.max_seq_len:
            raise PromptTooLongError(prompt_len, req.max_tokens, self.max_seq_len)
        if req.sampling.min_tokens > req.max_tokens:
            raise RequestError(f"min_tokens ({req.sampling.min_tokens}) must be <= max_tokens "
                               f"({req.max_tokens})", param="min_tokens")
        if req.sampling.min_tokens and req.constraint is not None:  # the grammar may end before: nothing to sample
            raise RequestError("min_tokens cannot be combined with a structured-output constraint: the grammar "
                               "decides where the output ends", param="min_tokens")
        if max(req.prompt_tokens) >= self.vocab_size:
            raise RequestError(f"prompt token id {max(req.prompt_tokens)} is outside the "
                               f"vocabulary ({self.vocab_size})", param="prompt")
        biased = self.outside_vocabulary([t for t, _ in req.sampling.logit_bias])
        if biased is not None:
            raise RequestError(f"logit_bias token id {biased} is outside the vocabulary ({self.vocab_size})",
                               param="logit_bias")
        rule = req.exit or self.exit
        if rule.needs_gate and not self.has_gate:
            raise RequestError(f"this model has no exit gate: exit kind {rule.kind} needs one; use "
                               "kl, minp_kl, entropy_diff, latent_diff, cosine or argmax_stability",
                               param="exit")
        if rule.kind == "gate_expected" and self.coda:
            # each loop's logits would run the coda, whose KV then holds only the last loop's
            raise RequestError("exit kind gate_expected needs a model without coda layers (Ouro's "
                               "layout); use gate_select", param="exit")
        if rule.min_loops > loops and rule.kind != "none":
            raise RequestError(f"exit.min_loops ({rule.min_loops}) exceeds loops ({loops})",
                               param="exit")
        if req.speculation is not None:
            _check_speculation(req.speculation[0], rule, loops, window)
        if self.architecture == "inkling2":
            _check_inkling2(req, rule, loops, window)
        return Resolved(loops, window, rule, self._check_kv(req, loops, window))

    def _check_kv(self, req: GenerationRequest, loops: int, window: int) -> int | None:
        if self.kv is None:
            return None
        length = min(len(req.prompt_tokens) + req.max_tokens, self.max_seq_len)
        beams = req.beam[0] if req.beam is not None else 1
        worst = self.kv.worst_blocks(length, loops, window, beams)
        if worst > self.kv.num_blocks:
            raise RequestError(
                f"this request can hold up to {worst} KV blocks (prompt + max_tokens at {loops} "
                f"loops, cache_window {window}) but the whole KV pool has {self.kv.num_blocks}: "
                "lower max_tokens, loops or cache_window", param="max_tokens")
        return worst


def _check_inkling2(req: GenerationRequest, rule: ExitRule, loops: int, window: int) -> None:
    """What an Inkling-2 model does not define, refused by name: its passes restart from the
    prelude's output and mix the last pass in through learned messages, so a stop rule would need
    the coda and head at every pass (not exposed yet), a warm start has no state to start from, a
    pass reads only its own KV (``cache_window`` must keep every pass), and a tree of drafts would
    run its short convolutions over tokens that do not follow each other (a chain of drafts,
    ``mode`` ``speculative``, runs)."""
    if rule.kind != "none":
        raise RequestError(f"exit kind {rule.kind} is not available for an Inkling-2 model: every token runs its "
                           "passes", param="exit")
    if req.warm_start:
        raise RequestError("warm_start is not available for an Inkling-2 model (each pass restarts from the "
                           "prelude's output)", param="warm_start")
    if window != loops:
        raise RequestError(f"cache_window {window} is not available for an Inkling-2 model: each pass attends "
                           f"its own KV (cache_window must be at least loops, {loops})", param="cache_window")
    if req.mode == "tree":
        raise RequestError("mode tree is not available for an Inkling-2 model (its short convolutions run along "
                           "the sequence, not a tree); use speculative", param="mode")


def _check_speculation(draft_loops: int, rule: ExitRule, loops: int, window: int) -> None:
    # A multi-token verify forward runs every token to its full loops: with an adaptive exit
    # rule plain decoding would stop some tokens earlier and emit other tokens.
    if rule.stops:
        raise RequestError("speculative decoding is not available with an "
                           f"adaptive exit rule ({rule.kind}): verification "
                           "cannot exit per token, so the output would differ from plain "
                           "decoding", param="mode")
    if draft_loops > loops:
        raise RequestError(f"draft_loops ({draft_loops}) must be <= the verifier's loops "
                           f"({loops})", param="draft_loops")
    # With W < loops a token reads its predecessors' latest slot, which a multi-token verify
    # forward fills at the same loop instead: verification would change the output.
    if window < loops:
        raise RequestError("speculative decoding needs the full cache (cache_window >= loops)",
                           param="cache_window")
