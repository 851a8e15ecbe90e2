"""Beam search on the tiny random model: greedy at one beam, never worse than greedy, exact on a
short case, KV shared between beams and all given back, and through the actor runtime."""

from __future__ import annotations

import math

import pytest
import torch
import trio

import tinyloop
from tests.engine.test_engine import make_engine, req
from tinyloop.engine.beam import BeamState, beam_score
from tinyloop.engine.engine import Engine
from tinyloop.engine.sequence import Sequence
from tinyloop.errors import RequestError
from tinyloop.model.kvcache import slot_count
from tinyloop.requests import GenerationRequest, SamplingParams

PROMPT = [5, 6, 7]


def search(seq: Sequence) -> BeamState | None:
    """A beam request's search, once its prompt is prefilled (the sequence's mode state)."""
    return seq.mode_state if isinstance(seq.mode_state, BeamState) else None


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(max_seq_len=256, block_size=8)


def beam(prompt: list[int], num_beams: int, **kw: object) -> GenerationRequest:
    return req(prompt, mode="beam", num_beams=num_beams, **kw)


def test_request_validates_the_beam_fields() -> None:
    for fields, param in [({"num_beams": 0}, "num_beams"), ({"num_beams": 17}, "num_beams"),
                          ({"length_penalty": math.inf}, "length_penalty")]:
        with pytest.raises(RequestError) as info:
            GenerationRequest(prompt_tokens=(1,), mode="beam", **fields)  # type: ignore[arg-type]
        assert info.value.param == param
    with pytest.raises(RequestError) as info:
        GenerationRequest(prompt_tokens=(1,), num_beams=2)
    assert info.value.param == "num_beams"
    assert GenerationRequest(prompt_tokens=(1,), mode="beam").beam == (4, 1.0)


def test_one_beam_is_greedy(engine: Engine) -> None:
    greedy = engine.generate(req(PROMPT, max_tokens=8, sampling=SamplingParams(temperature=0, logprobs=True)))
    one = engine.generate(beam(PROMPT, 1, max_tokens=8))
    assert one.tokens == greedy.tokens and one.text == greedy.text
    assert greedy.logprobs is not None and one.beam_score is not None
    assert one.beam_score == pytest.approx(sum(lp.logprob for lp in greedy.logprobs) / 8, abs=1e-4)
    assert engine.kv_statistics().blocks_used == 0


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -0.5])
def test_more_beams_score_at_least_as_well_as_greedy(engine: Engine, length_penalty: float) -> None:
    scores = []
    for n in (1, 4):
        r = engine.generate(beam(PROMPT, n, max_tokens=6, length_penalty=length_penalty,
                                 sampling=SamplingParams(temperature=0, logprobs=True)))
        assert r.logprobs is not None and r.beam_score is not None
        assert r.beam_score == pytest.approx(
            beam_score(sum(lp.logprob for lp in r.logprobs), len(r.tokens), length_penalty), abs=1e-5)
        scores.append(r.beam_score)
    assert scores[1] >= scores[0] - 1e-6
    assert engine.kv_statistics().blocks_used == 0


def test_as_many_beams_as_first_tokens_finds_the_best_pair(engine: Engine) -> None:
    """Two tokens, 16 beams: the best of the 16 likeliest first tokens times every second one."""
    first = torch.log_softmax(_logits(engine, PROMPT), -1)
    best_first = first.topk(16).indices.tolist()
    total = torch.stack([first[t] + torch.log_softmax(_logits(engine, PROMPT + [t]), -1)
                         for t in best_first])  # [16, V]
    row, second = divmod(int(total.argmax()), total.shape[1])
    ignore = SamplingParams(temperature=0, ignore_eos=True)
    r = engine.generate(beam(PROMPT, 16, max_tokens=2, length_penalty=0.0, sampling=ignore))
    assert r.tokens == [best_first[row], second]
    assert r.beam_score == pytest.approx(float(total.max()), abs=1e-4)
    narrow = engine.generate(beam(PROMPT, 2, max_tokens=2, length_penalty=0.0, sampling=ignore))
    assert narrow.beam_score is not None and narrow.beam_score <= float(total.max()) + 1e-5


def _logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    seq = engine.start(req(prompt, max_tokens=1))
    try:
        return engine.prefill(seq).float()
    finally:
        engine.free(seq)


def test_beams_share_the_prompt_blocks_and_give_every_block_back(engine: Engine) -> None:
    prompt, num_beams, max_tokens = list(range(100, 130)), 4, 6
    r = beam(prompt, num_beams, max_tokens=max_tokens, loops=2,
             sampling=SamplingParams(temperature=0, ignore_eos=True))
    seq = engine.start(r)
    peak = 0
    try:
        while not seq.finished:
            engine.step([seq])
            peak = max(peak, engine.kv_statistics().blocks_used)
            state = search(seq)
            if state is not None and state.live:
                assert len(state.live) <= num_beams
    finally:
        engine.free(seq)
    assert seq.error is None and len(seq.output) == max_tokens
    unshared = slot_count(engine.config, seq.loops, seq.window) * -(-(len(prompt) + max_tokens) // 8)
    assert 0 < peak < num_beams * unshared
    assert engine.kv_statistics().blocks_used == 0


def test_stop_token_and_streamed_burst(engine: Engine) -> None:
    plain = engine.generate(beam(PROMPT, 3, max_tokens=6))
    stop = plain.tokens[2]
    chunks: list[object] = []
    r = engine.generate_stream(beam(PROMPT, 3, max_tokens=6,
                                    sampling=SamplingParams(temperature=0, stop_token_ids=(stop,))),
                               chunks.append)
    assert r.tokens[-1] == stop or r.finish_reason == "length"
    assert len(chunks) == len(r.tokens)
    assert engine.kv_statistics().blocks_used == 0


async def test_beam_request_through_the_runtime(engine: Engine) -> None:
    r = beam(PROMPT, 3, max_tokens=6)
    expected = engine.generate(r)
    with trio.fail_after(30):
        async with tinyloop.open_runtime(engine, tinyloop.Settings(max_batch_size=4)) as rt:
            results = []

            async def run(request: GenerationRequest) -> None:
                results.append(await rt.submit(request))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, r)
                nursery.start_soon(run, req(PROMPT, max_tokens=5))
    got = next(x for x in results if x.beam_score is not None)
    assert got.tokens == expected.tokens and got.beam_score == pytest.approx(expected.beam_score)
    assert engine.kv_statistics().blocks_used == 0


def test_free_mid_search_gives_every_beam_back(engine: Engine) -> None:
    seq = engine.start(beam(PROMPT, 4, max_tokens=20, sampling=SamplingParams(temperature=0, ignore_eos=True)))
    for _ in range(4):
        engine.step([seq])
    state = search(seq)
    assert state is not None and len(state.live) > 1 and not seq.finished
    engine.free(seq)  # a cancelled request
    assert engine.kv_statistics().blocks_used == 0


def test_kv_exhaustion_fails_the_beam_request_alone() -> None:
    # The pool could hold the search (a larger one is refused up front), but other holders
    # leave it 40 free blocks.
    small = make_engine(max_seq_len=256, block_size=8, kv_cache_mb=1500 * 2048 / 2**20)
    others = small.pool.allocate(small.pool.num_blocks - 40)
    wide = beam(list(range(100, 130)), 16, max_tokens=40, sampling=SamplingParams(temperature=0, ignore_eos=True))
    seq = small.start(wide)
    while not seq.finished:
        small.step([seq])
    assert seq.finish_reason == "error" and seq.error is not None
    state = search(seq)
    assert state is not None and not state.live  # failed mid-search, its beams freed
    small.free(seq)
    small.pool.release(others)
    assert small.kv_statistics().blocks_used == 0
    assert small.generate(req(PROMPT, max_tokens=4)).completion_tokens == 4
