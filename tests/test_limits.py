"""ModelLimits: the one check of a request against the model (``Engine.validate`` and the runtime's
admission use it), held to the rules the engine checked before they moved there."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tinyloop.engine.engine import Engine
from tinyloop.errors import PromptTooLongError, RequestError
from tinyloop.limits import KVLimits, ModelLimits, Resolved
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest
from tinyloop.tokenizer import default_tokenizer
from tinyloop.vocabulary import ExitRule, kv_slots_per_token

MAX_SEQ_LEN = 256
# KV_MB holds 512 blocks of 8 tokens: a full-length request fits at 4 loops, not at 16
KV_MB = 1.0


def engine(preset: str) -> Engine:
    model = init_model(PRESETS[preset].replace(max_position=MAX_SEQ_LEN), seed=0)
    return Engine(model, default_tokenizer(), max_seq_len=MAX_SEQ_LEN, kv_cache_mb=KV_MB, block_size=8)


@pytest.fixture(scope="module", params=["tiny", "tiny-ouro"])
def real(request: pytest.FixtureRequest) -> Engine:
    return engine(request.param)


MODES: list[dict[str, Any]] = [
    {}, {"mode": "speculative"}, {"mode": "speculative", "draft_loops": 3},
    {"mode": "tree", "draft_loops": 2, "k_branches": 3}, {"mode": "beam", "num_beams": 4},
]
EXITS = [None, ExitRule(), ExitRule("gate", 0.5), ExitRule("kl", 0.1, min_loops=3)]


def grid(vocab: int) -> Iterator[GenerationRequest]:
    """Requests across every limit: loops, context, vocabulary, exit, speculation, KV."""
    prompts = [(1, 2, 3), tuple(range(10, 210)), (5, vocab), (vocab + 7, 1)]
    for prompt, max_tokens, loops, window, mode, rule in itertools.product(
            prompts, [1, 40, 250], [None, 1, 2, 8, 16, 17], [None, 1, 2, 64], MODES, EXITS):
        try:
            yield GenerationRequest(prompt_tokens=prompt, max_tokens=max_tokens, loops=loops,
                                    cache_window=window, exit=rule, **mode)
        except RequestError:  # refused on construction: neither check sees it
            continue


def outcome(check: Any, req: GenerationRequest) -> tuple[Any, ...]:
    try:
        loops, window = check(req)[:2]
    except RequestError as exc:
        return (type(exc), exc.param, str(exc))
    return ("ok", loops, window)


def reference_validate(engine: Engine, req: GenerationRequest) -> tuple[int, int]:
    """The engine's own checks from before they moved to ``ModelLimits``, kept as the reference."""
    c = engine.config
    loops = req.loops or c.default_loops
    if loops > c.max_loops:
        raise RequestError(f"loops must be <= {c.max_loops} for this model", param="loops")
    window = min(req.cache_window or loops, loops)
    if len(req.prompt_tokens) + req.max_tokens > engine.max_seq_len:
        raise PromptTooLongError(len(req.prompt_tokens), req.max_tokens, engine.max_seq_len)
    if max(req.prompt_tokens) >= c.vocab_size:
        raise RequestError(f"prompt token id {max(req.prompt_tokens)} is outside the "
                           f"vocabulary ({c.vocab_size})", param="prompt")
    rule = req.exit or c.exit
    if rule.kind == "gate" and c.exit.kind != "gate":
        raise RequestError(f"this model has no exit gate: exit kind {rule.kind} needs one; use "
                           "kl, minp_kl, entropy_diff, latent_diff, cosine or argmax_stability", param="exit")
    if rule.min_loops > loops and rule.kind != "none":
        raise RequestError(f"exit.min_loops ({rule.min_loops}) exceeds loops ({loops})", param="exit")
    if req.speculation is not None:
        if rule.kind != "none":
            raise RequestError("speculative decoding is not available with an "
                               f"adaptive exit rule ({rule.kind}): verification "
                               "cannot exit per token, so the output would differ from plain "
                               "decoding", param="mode")
        if req.speculation[0] > loops:
            raise RequestError(f"draft_loops ({req.speculation[0]}) must be <= the verifier's loops "
                               f"({loops})", param="draft_loops")
        if window < loops:
            raise RequestError("speculative decoding needs the full cache (cache_window >= loops)",
                               param="cache_window")
    length = min(len(req.prompt_tokens) + req.max_tokens, engine.max_seq_len)
    beams = req.beam[0] if req.beam is not None else 1
    worst = kv_slots_per_token(c, loops, window) * -(-length // engine.pool.block_size) * beams
    if worst > engine.pool.num_blocks:
        raise RequestError(
            f"this request can hold up to {worst} KV blocks (prompt + max_tokens at {loops} "
            f"loops, cache_window {window}) but the whole KV pool has {engine.pool.num_blocks}: "
            "lower max_tokens, loops or cache_window", param="max_tokens")
    return loops, window


def test_limits_agree_with_the_engines_former_checks_on_a_grid_of_requests(real: Engine) -> None:
    limits = ModelLimits.from_engine(real)

    def resolved(req: GenerationRequest) -> tuple[int, int]:
        r = limits.check(req)
        assert r.kv_blocks == real.kv_blocks_needed(req)  # the same KV worst case
        assert r.exit == (req.exit or real.config.exit)
        return r.loops, r.window

    params: set[Any] = set()
    accepted = 0
    for req in grid(real.config.vocab_size):
        ours, theirs = outcome(resolved, req), outcome(lambda r: reference_validate(real, r), req)
        assert outcome(real.validate, req) == ours  # the engine checks through the limits
        assert ours == theirs, req
        if ours[0] == "ok":
            accepted += 1
        else:
            params.add(ours[1])
    assert accepted > 100
    expected = {"loops", "max_tokens", "prompt", "exit", "mode", "draft_loops", "cache_window"}
    assert params >= expected, params  # the grid reaches every limit


def test_from_engine_reads_the_model_and_its_kv_pool(real: Engine) -> None:
    limits = ModelLimits.from_engine(real)
    c = real.config
    assert (limits.max_seq_len, limits.vocab_size, limits.default_loops, limits.max_loops) == \
        (MAX_SEQ_LEN, c.vocab_size, c.default_loops, c.max_loops)
    assert limits.has_gate == (c.exit.kind == "gate") and limits.exit == c.exit
    assert limits.kv is not None
    assert (limits.kv.num_blocks, limits.kv.block_size) == (real.pool.num_blocks, 8)


def plain(**kw: Any) -> ModelLimits:
    return ModelLimits(**{"max_seq_len": 100, "vocab_size": 50, "default_loops": 4, "max_loops": 8, **kw})


def test_defaults_are_resolved_once() -> None:
    r = plain().check(GenerationRequest(prompt_tokens=(1, 2), max_tokens=5))
    assert r == Resolved(loops=4, window=4, exit=ExitRule(), kv_blocks=None)
    r = plain().check(GenerationRequest(prompt_tokens=(1, 2), max_tokens=5, loops=6, cache_window=2))
    assert (r.loops, r.window) == (6, 2)
    assert plain().check(GenerationRequest(prompt_tokens=(1,), loops=3, cache_window=9)).window == 3


@pytest.mark.parametrize(("fields", "error", "param", "message"), [
    ({"loops": 9}, RequestError, "loops", "loops must be <= 8 for this model"),
    ({"max_tokens": 99}, PromptTooLongError, "max_tokens",
     "prompt (2 tokens) + max_tokens (99) exceeds max_seq_len (100)"),
    ({"prompt_tokens": (1, 60, 55)}, RequestError, "prompt", "prompt token id 60 is outside the vocabulary (50)"),
    ({"exit": ExitRule("gate", 0.5)}, RequestError, "exit", "this model has no exit gate"),
    ({"exit": ExitRule("kl", 0.1, min_loops=5)}, RequestError, "exit", "exit.min_loops (5) exceeds loops (4)"),
    ({"mode": "speculative", "exit": ExitRule("kl", 0.1)}, RequestError, "mode", "adaptive exit rule (kl)"),
    ({"mode": "tree", "draft_loops": 5}, RequestError, "draft_loops",
     "draft_loops (5) must be <= the verifier's loops (4)"),
    ({"mode": "speculative", "cache_window": 3}, RequestError, "cache_window", "cache_window >= loops"),
])
def test_each_limit_names_its_field(fields: dict[str, Any], error: type[RequestError], param: str,
                                    message: str) -> None:
    req = GenerationRequest(**{"prompt_tokens": (1, 2), "max_tokens": 4, **fields})
    with pytest.raises(error) as info:
        plain().check(req)
    assert type(info.value) is error and info.value.param == param and message in str(info.value)


def test_the_kv_worst_case_counts_slots_blocks_and_beams() -> None:
    layers = PRESETS["tiny"]  # 1 prelude, 2 core, 1 coda: 2 + 2 * min(window, loops) slots
    limits = plain(kv=KVLimits(num_blocks=39, block_size=8, layers=layers))
    req = GenerationRequest(prompt_tokens=(1, 2), max_tokens=14)  # 16 tokens: 2 blocks a slot
    assert limits.check(req).kv_blocks == (2 + 2 * 4) * 2
    assert limits.check(GenerationRequest(prompt_tokens=(1, 2), max_tokens=14, cache_window=1)).kv_blocks == 8
    with pytest.raises(RequestError, match="whole KV pool has 39") as info:
        limits.check(GenerationRequest(prompt_tokens=(1, 2), max_tokens=14, mode="beam", num_beams=2))
    assert info.value.param == "max_tokens"
    assert limits.has_gate is False and plain(exit=ExitRule("gate", 0.9)).has_gate


def test_importing_the_limits_loads_neither_torch_nor_trio() -> None:
    code = "import sys, tinyloop.limits; print(sorted({'torch', 'trio'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
