"""What callers hand the runtime and what they get back.

``GenerationRequest`` is validated on construction (``RequestError`` names the field), so a bad
request never reaches the engine. ``SamplingParams`` is everything sampling needs; sampling itself
is a pure function of logits, these params and a per-request ``torch.Generator``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass, field
from typing import Literal

from tinyloop.errors import RequestError
from tinyloop.vocabulary import ExitRule

__all__ = [
    "SamplingParams",
    "GenerationRequest",
    "GenerationChunk",
    "GenerationResult",
    "RequestState",
    "FinishReason",
    "TokenLogprob",
    "Constraint",
    "CONSTRAINT_KINDS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_TOKENS",
]

FinishReason = Literal["stop", "length", "cancelled", "error"]
StopReason = Literal["eos", "stop_token", "stop_string", "length", "cancelled", "error"]
MAX_TOP_LOGPROBS = 20
DEFAULT_DRAFT_LOOPS = 1
DEFAULT_DRAFT_AHEAD = 8  # a chain's (bench/speculative.py: 1.32-1.59x plain on the demo model, 4: 1.11-1.51x)
DEFAULT_TREE_AHEAD = 4  # a tree's levels
DEFAULT_K_BRANCHES = 2
MAX_DRAFT_AHEAD = 64
MAX_K_BRANCHES = 16
DEFAULT_NUM_BEAMS = 4
MAX_NUM_BEAMS = 16
# A penalty p scales a seen token's logit by up to max(p, 1/p): within these bounds a logit of
# any size a model produces (|x| < 3e36) stays finite, so softmax never sees inf - inf = NaN.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_STOP_CHARS = 256  # per stop string: matching costs O(len**2) per generated token
MAX_LOGIT_BIAS = 100.0  # OpenAI's range per token: [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024  # entries per request: the bias is applied per row each step
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "tool_calls")


class RequestState(enum.Enum):
    """A request's lifecycle: QUEUED -> DISPATCHED -> DECODING -> DONE | ERROR | CANCELLED."""

    QUEUED = "queued"
    DISPATCHED = "dispatched"
    DECODING = "decoding"
    DONE = "done"
    ERROR = "error"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RequestState.DONE, RequestState.ERROR, RequestState.CANCELLED)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise RequestError(message, param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen from the logits.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` and ``min_p == 0`` disable
    those filters. ``repetition_penalty`` (HF style, over prompt and output) divides positive
    logits and multiplies negative ones; ``presence_penalty``/``frequency_penalty`` (OpenAI
    style, over the output) subtract per token. ``seed`` seeds the request's generator.
    ``stop`` strings are cut from the text and not emitted; ``stop_token_ids`` end the request
    like EOS. ``logprobs`` asks for each chosen token's logprob, ``top_logprobs`` for that many
    alternatives.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check(not isinstance(self.stop, str), "stop must be a list of strings", "stop")
        for name in ("stop", "stop_token_ids", "logit_bias"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _check(_finite(self.temperature) and 0 <= self.temperature <= 100,
               "temperature must be a finite number in [0, 100]", "temperature")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]", "top_p")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0", "top_k")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]", "min_p")
        _check(_finite(self.repetition_penalty)
               and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]",
               "repetition_penalty")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
               "presence_penalty must be in [-2, 2]", "presence_penalty")
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
               "frequency_penalty must be in [-2, 2]", "frequency_penalty")
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63),
               "seed must be a 64-bit integer", "seed")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty", "stop")
        _check(len(self.stop) <= 16, "at most 16 stop strings", "stop")
        _check(all(len(s) <= MAX_STOP_CHARS for s in self.stop),
               f"stop strings must be at most {MAX_STOP_CHARS} characters", "stop")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids")
        _check(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS,
               f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens", "logit_bias")
        _check(all(isinstance(e, tuple) and len(e) == 2 and _is_int(e[0]) and e[0] >= 0 and _finite(e[1])
                   and -MAX_LOGIT_BIAS <= e[1] <= MAX_LOGIT_BIAS for e in self.logit_bias),
               f"logit_bias maps token ids (>= 0) to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
               "logit_bias")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be an integer >= 0",
               "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


DEFAULT_SAMPLING = SamplingParams()  # frozen: one shared instance, validated once


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's logprob and its top alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match (structured outputs): ``kind`` is one of
    ``CONSTRAINT_KINDS``, ``source`` its text: a JSON schema (``json_schema``; ``json_object``
    takes any JSON object and ignores ``source``), a regular expression (``regex``), a grammar
    in the documented dialect (``grammar``), or a tool-call spec as JSON (``tool_calls``, built
    by ``tinyloop/http/tools.py``). Compiled and checked by ``tinyloop.grammar``."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in CONSTRAINT_KINDS, f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}",
               "response_format")
        _check(isinstance(self.source, str), "constraint source must be a string", "response_format")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation: a tokenised prompt, how much to generate, and how.

    ``loops``/``cache_window`` default to the model's default loops and a full cache.
    ``warm_start`` starts each decoded token's core state from the previous token's final state:
    its raw core state (``warm_start_from="raw"``, Huginn's adaptive-compute generate) or that
    state after the final norm (``"normed"``, Huginn's other generate paths).
    ``mode`` is ``generate`` (plain, or through the prefix pool), ``speculative``, ``tree`` or
    ``beam``.

    Self-speculative modes draft with the same weights at ``draft_loops`` (default 1) and verify
    at ``loops``: ``speculative`` drafts a chain of ``draft_ahead`` tokens (default 8), ``tree``
    drafts ``k_branches`` (default 2) branches of ``draft_ahead`` tokens each (default 4). The output equals
    plain decoding at ``loops`` (token for token when greedy, in distribution when sampled).
    These fields are refused in the other modes, and ``warm_start`` is refused in these: a
    warm-started token needs the previous token's final state, so several tokens cannot be
    verified in one forward.

    ``beam`` keeps the ``num_beams`` (default 4; 1 is greedy decoding) best partial outputs by
    cumulative logprob of the raw logits and returns the finished one with the best
    ``sum_logprob / len ** length_penalty`` (default 1.0). Beam search is deterministic: the
    sampling fields other than ``stop``, ``stop_token_ids``, ``ignore_eos`` and ``logprobs``
    are ignored, and ``stop`` strings are applied to the chosen output only. A streamed beam
    request gets all its tokens in the step where the search ends.
    """

    prompt_tokens: tuple[int, ...]
    max_tokens: int = 16
    mode: str = "generate"
    loops: int | None = None
    cache_window: int | None = None
    warm_start: bool = False
    warm_start_from: str = "raw"
    sampling: SamplingParams = DEFAULT_SAMPLING
    request_id: str = field(default_factory=lambda: os.urandom(16).hex())  # 32 hex digits, like uuid4().hex
    draft_loops: int | None = None
    draft_ahead: int | None = None
    k_branches: int | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    exit: ExitRule | None = None  # adaptive exit for this request (default: the model's rule)
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt_tokens, list):
            object.__setattr__(self, "prompt_tokens", tuple(self.prompt_tokens))
        _check(isinstance(self.prompt_tokens, tuple) and len(self.prompt_tokens) > 0,
               "prompt must contain at least one token", "prompt")
        _check(all(_is_int(t) and t >= 0 for t in self.prompt_tokens),
               "prompt tokens must be non-negative integers", "prompt")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 0, "max_tokens must be an integer >= 0", "max_tokens")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
               f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "prompt_logprobs")
        _check(self.constraint is None or isinstance(self.constraint, Constraint),
               "constraint must be a Constraint", "response_format")
        _check(self.exit is None or isinstance(self.exit, ExitRule), "exit must be an ExitRule", "exit")
        _check(self.warm_start_from in ("raw", "normed"), "warm_start must be raw or normed", "warm_start")
        _check(self.mode in ("generate", "speculative", "tree", "beam"),
               "mode must be one of generate, speculative, tree, beam", "mode")
        _check(self.loops is None or (_is_int(self.loops) and self.loops >= 1),
               "loops must be an integer >= 1", "loops")
        _check(self.cache_window is None or (_is_int(self.cache_window) and self.cache_window >= 1),
               "cache_window must be an integer >= 1", "cache_window")
        self._check_speculation()
        self._check_beam()

    def _check_speculation(self) -> None:
        speculative = self.mode in ("speculative", "tree")
        limits = (("draft_loops", 1, None), ("draft_ahead", 1, MAX_DRAFT_AHEAD),
                  ("k_branches", 1, MAX_K_BRANCHES))
        for name, low, high in limits:
            value = getattr(self, name)
            if value is None:
                continue
            allowed = speculative if name != "k_branches" else self.mode == "tree"
            _check(allowed, f"{name} is only allowed with mode "
                   f"{'tree' if name == 'k_branches' else 'speculative or tree'}", name)
            _check(_is_int(value) and value >= low and (high is None or value <= high),
                   f"{name} must be an integer >= {low}" if high is None
                   else f"{name} must be an integer in [{low}, {high}]", name)
        _check(not (speculative and self.warm_start),
               "warm_start cannot be combined with speculative decoding", "warm_start")

    def _check_beam(self) -> None:
        beam = self.mode == "beam"
        _check(beam or (self.num_beams is None and self.length_penalty is None),
               "num_beams and length_penalty are only allowed with mode beam",
               "num_beams" if self.num_beams is not None else "length_penalty")
        _check(self.num_beams is None or (_is_int(self.num_beams) and 1 <= self.num_beams <= MAX_NUM_BEAMS),
               f"num_beams must be an integer in [1, {MAX_NUM_BEAMS}]", "num_beams")
        _check(self.length_penalty is None or (_finite(self.length_penalty) and abs(self.length_penalty) <= 10),
               "length_penalty must be a finite number in [-10, 10]", "length_penalty")

    @property
    def beam(self) -> tuple[int, float] | None:
        """(num_beams, length_penalty) with defaults in mode ``beam``, else None."""
        if self.mode != "beam":
            return None
        return (self.num_beams or DEFAULT_NUM_BEAMS,
                1.0 if self.length_penalty is None else float(self.length_penalty))

    @property
    def speculation(self) -> tuple[int, int, int] | None:
        """(draft_loops, draft_ahead, k_branches) with defaults, or None in the plain modes."""
        if self.mode not in ("speculative", "tree"):
            return None
        tree = self.mode == "tree"
        k = (self.k_branches or DEFAULT_K_BRANCHES) if tree else 1
        ahead = self.draft_ahead or (DEFAULT_TREE_AHEAD if tree else DEFAULT_DRAFT_AHEAD)
        return (self.draft_loops or DEFAULT_DRAFT_LOOPS, ahead, k)


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """One streamed step: the token and the text it completed (may be empty mid-character)."""

    token_id: int
    text: str
    index: int = 0
    logprob: TokenLogprob | None = None
    loops_used: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished generation.

    ``finish_reason`` is OpenAI's (``stop`` or ``length``); ``stop_reason`` says which stop
    fired (``eos``, ``stop_token``, ``stop_string``, ``length``). ``loops_used`` is the loop
    count the request ran at (lower than asked when downgraded); ``mean_loops`` the mean loops
    per generated token (lower with adaptive exit).

    Speculative requests (modes ``speculative`` and ``tree``) report ``draft_tokens`` (tokens
    drafted: for a tree, every node), ``accepted_draft_tokens`` (drafted tokens the verifier
    accepted) and ``rejected_draft_tokens`` (the rest); None for the other modes. A beam request
    reports ``beam_score``, the returned output's ``sum_logprob / len ** length_penalty``.
    ``prompt_logprobs``: one entry per prompt token when the request asked (the first None).
    ``cached_tokens``: prompt tokens whose KV came from the prefix cache or pool.
    """

    tokens: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    wall_ms: float
    stop_reason: StopReason = "length"
    logprobs: list[TokenLogprob] | None = None
    loops_used: int | None = None
    mean_loops: float | None = None
    time_to_first_token_ms: float | None = None
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    rejected_draft_tokens: int | None = None
    beam_score: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0

    def timed(self, wall_ms: float, time_to_first_token_ms: float | None) -> GenerationResult:
        """This result with its times taken on another clock (the runtime's)."""
        return dataclasses.replace(self, wall_ms=wall_ms, time_to_first_token_ms=time_to_first_token_ms)
