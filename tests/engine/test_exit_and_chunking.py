"""Adaptive exit per request, and chunked prefill interleaved with running decodes."""

from __future__ import annotations

import pytest

from tests.engine.test_engine import make_engine
from tinyloop.engine.engine import Engine
from tinyloop.errors import RequestError
from tinyloop.requests import GenerationChunk, GenerationRequest, SamplingParams
from tinyloop.vocabulary import ExitRule


def greedy(prompt: list[int], **kw: object) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=tuple(prompt), sampling=SamplingParams(temperature=0, ignore_eos=True),
                             **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(max_seq_len=256, block_size=8)


def test_an_exit_rule_that_fires_cuts_mean_loops_and_shows_per_token(engine: Engine) -> None:
    prompt = list(range(40, 60))
    full = engine.generate(greedy(prompt, max_tokens=8, loops=8))
    assert full.mean_loops == 8.0
    chunks: list[GenerationChunk] = []
    rule = ExitRule(kind="latent_diff", threshold=10.0, min_loops=3)  # converged after 3 loops
    early = engine.generate_stream(greedy(prompt, max_tokens=8, loops=8, exit=rule), chunks.append)
    # The first token comes from the prompt's prefill, which runs every loop; decoded tokens exit.
    assert [c.loops_used for c in chunks] == [8] + [3] * 7
    assert early.mean_loops == pytest.approx((8 + 3 * 7) / 8)
    assert engine.kv_statistics().blocks_used == 0


def test_a_rule_that_never_fires_changes_nothing(engine: Engine) -> None:
    prompt = list(range(10, 30))
    rule = ExitRule(kind="latent_diff", threshold=1e-9, min_loops=1)
    plain = engine.generate(greedy(prompt, max_tokens=6, loops=4))
    ruled = engine.generate(greedy(prompt, max_tokens=6, loops=4, exit=rule))
    assert ruled.tokens == plain.tokens and ruled.mean_loops == 4.0


def test_exit_rules_are_validated_against_the_model(engine: Engine) -> None:
    with pytest.raises(RequestError, match="no exit gate") as info:
        engine.validate(greedy([1, 2], exit=ExitRule(kind="gate", threshold=0.5)))
    assert info.value.param == "exit"
    with pytest.raises(RequestError, match="min_loops"):
        engine.validate(greedy([1, 2], loops=2, exit=ExitRule(kind="kl", threshold=0.1, min_loops=3)))


def test_a_long_prompt_prefills_in_chunks_between_decode_steps() -> None:
    eng = make_engine(max_seq_len=256, block_size=8, prefill_chunk=16)
    running = eng.start(greedy([1, 2, 3], max_tokens=20))
    eng.step([running])  # its prefill: one token out
    long = eng.start(greedy(list(range(100, 228)), max_tokens=2))  # 128 tokens = 8 chunks
    steps = 0
    while long.prefilling:
        events = eng.step([running, long])
        steps += 1
        # Every step that prefills a chunk of the long prompt also decodes the running stream.
        assert [e.sequence for e in events if e.sequence is running] == [running]
    assert steps == 8 and len(running.output) == 1 + 8
    while not (running.finished and long.finished):
        eng.step([s for s in (running, long) if not s.finished])
    alone = make_engine(max_seq_len=256, block_size=8, prefill_chunk=512)
    assert long.output == alone.generate(greedy(list(range(100, 228)), max_tokens=2)).tokens
    assert running.output == alone.generate(greedy([1, 2, 3], max_tokens=20)).tokens


def test_the_models_own_exit_rule_governs_a_request_that_names_none() -> None:
    """The rule is resolved once (``limits.check``) and carried on the sequence: the forward, the
    KV reservation and the prefix cache's salt all go by it."""
    rule = ExitRule(kind="latent_diff", threshold=10.0, min_loops=3)
    engine = make_engine({"exit": rule}, max_seq_len=256, block_size=8)  # a model with a default rule
    prompt = list(range(40, 60))
    seq = engine.start(greedy(prompt, max_tokens=8, loops=8))
    assert seq.exit == rule
    demand = engine.kv_demand(seq)
    assert demand is not None and not demand.preemptible  # an adaptive rule's KV is set aside at start
    engine.free(seq)
    chunks: list[GenerationChunk] = []
    engine.generate_stream(greedy(prompt, max_tokens=8, loops=8), chunks.append)
    assert [c.loops_used for c in chunks] == [8] + [3] * 7
