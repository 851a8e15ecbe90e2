"""``logit_bias`` in every sampling path: the single-row sampler and its greedy and speculative
helpers, the batched tensor path (``sample_rows``, ``sample_on_device``), ``sample_batch``'s
plain-greedy shortcut, and the engine's plain, speculative, tree and beam modes. +100 forces a
token, -100 forbids one; reported logprobs stay those of the raw logits."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine import make_engine, req
from tinyloop.engine.batch_sampling import sample_on_device, sample_rows
from tinyloop.engine.engine import Engine
from tinyloop.engine.sampling import (
    greedy_token,
    greedy_token_prob,
    make_generator,
    sample_batch,
    sample_token,
    target_probs,
)
from tinyloop.errors import RequestError
from tinyloop.requests import SamplingParams

VOCAB = 64
LOGITS = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2  # [V]
TOP = int(LOGITS.argmax())
SECOND = int(LOGITS.topk(2).indices[1])
FORCED = int(LOGITS.argmin())  # the least likely token: only a bias can make it come out
PEAKED = torch.zeros(VOCAB).index_fill(0, torch.tensor([TOP]), 30.0)  # [V] sampling always picks TOP


def one(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> int:
    return sample_token(logits, params, make_generator(seed), prompt_tokens=(), output_tokens=()).token_id


def test_plus_100_forces_and_minus_100_forbids_on_the_single_row_path() -> None:
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    assert one(LOGITS, greedy) == TOP
    assert one(LOGITS, SamplingParams(temperature=0, logit_bias=((FORCED, 100.0),))) == FORCED
    assert one(LOGITS, SamplingParams(temperature=0, logit_bias=((TOP, -100.0),))) == SECOND
    assert {one(PEAKED, sampled, s) for s in range(40)} == {TOP}
    forced = SamplingParams(temperature=1.0, logit_bias=((FORCED, 100.0),))
    assert {one(LOGITS, forced, s) for s in range(40)} == {FORCED}
    forbidden = SamplingParams(temperature=1.0, logit_bias=((TOP, -100.0),))
    assert TOP not in {one(PEAKED, forbidden, s) for s in range(40)}


def test_the_helpers_speculation_and_beams_use_honour_it() -> None:
    forced = SamplingParams(temperature=0, logit_bias=((FORCED, 100.0),))
    assert greedy_token(LOGITS, forced, (), ()) == FORCED
    token, prob = greedy_token_prob(LOGITS, forced, (), ())
    assert token == FORCED and prob == pytest.approx(1.0)
    p = target_probs(LOGITS, SamplingParams(temperature=0.7, logit_bias=((FORCED, 100.0),)), (), ())
    assert float(p[FORCED]) == pytest.approx(1.0)
    assert float(target_probs(PEAKED, SamplingParams(logit_bias=((TOP, -100.0),)), (), ())[TOP]) < 1e-20


def test_reported_logprobs_stay_those_of_the_raw_logits() -> None:
    params = SamplingParams(temperature=0, logprobs=True, top_logprobs=2, logit_bias=((FORCED, 100.0),))
    result = sample_token(LOGITS, params, make_generator(0), prompt_tokens=(), output_tokens=())
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert result.token_id == FORCED and result.logprob is not None
    assert result.logprob.logprob == pytest.approx(float(raw[FORCED]))
    assert [t for t, _ in result.logprob.top] == [TOP, SECOND]


def test_a_repeated_token_takes_its_last_bias_on_both_paths() -> None:
    params = SamplingParams(temperature=0, logit_bias=((FORCED, 100.0), (FORCED, -100.0)))
    assert one(LOGITS, params) != FORCED
    assert sample_rows(LOGITS[None], [params], [make_generator(0)], [[]], [[]]).tolist() != [FORCED]


ROWS = [
    SamplingParams(temperature=0, logit_bias=((FORCED, 100.0),)),  # greedy, forced
    SamplingParams(temperature=0),  # plain greedy: the shortcut's row
    SamplingParams(temperature=1.0, seed=1, logit_bias=((FORCED, 100.0), (3, -5.0))),  # sampled, forced
    SamplingParams(temperature=0.8, seed=2, top_k=5),  # sampled, no bias: untouched
    SamplingParams(temperature=0, logit_bias=((TOP, -100.0),)),  # greedy, its argmax forbidden
    SamplingParams(temperature=1.0, seed=3, logit_bias=((TOP, -100.0),)),  # sampled, argmax forbidden
]


def batch_logits() -> torch.Tensor:
    rows = torch.stack([LOGITS] * len(ROWS))  # [B, V]
    rows[5] = PEAKED
    return rows


def alone() -> list[int]:
    return [one(row, p, p.seed or 0) for row, p in zip(batch_logits(), ROWS)]


def test_each_row_of_the_batched_tensor_path_picks_what_it_picks_alone() -> None:
    want = alone()
    assert want[0] == want[2] == FORCED and want[1] == TOP and want[4] == SECOND and want[5] != TOP
    gens = [make_generator(p.seed or 0) for p in ROWS]
    assert sample_rows(batch_logits(), ROWS, gens, [[]] * 6, [[]] * 6).tolist() == want
    picked = sample_on_device(batch_logits(), ROWS, [make_generator(p.seed or 0) for p in ROWS], [[]] * 6, [[]] * 6)
    assert [r[0] for r in picked if r is not None] == want


def test_sample_batch_takes_no_shortcut_past_a_biased_greedy_row() -> None:
    """All-greedy rows take one vectorised argmax unless they carry a bias."""
    rows = [ROWS[0], ROWS[1], ROWS[4]]
    logits = torch.stack([LOGITS] * 3)
    picked = sample_batch(logits, rows, [make_generator(0)] * 3, [[]] * 3, [[]] * 3)
    assert [r.token_id for r in picked if r is not None] == [FORCED, TOP, SECOND]


# -- the engine ----------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(max_seq_len=256, block_size=8)


def biased(bias: dict[int, float], temperature: float = 0.0, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=temperature, ignore_eos=True, seed=5, logit_bias=tuple(bias.items()),
                          **kw)  # type: ignore[arg-type]


def test_the_engine_forces_and_forbids_in_greedy_and_sampled_requests(engine: Engine) -> None:
    plain = engine.generate(req(PROMPT, max_tokens=6, sampling=GREEDY)).tokens
    reqs = [req(PROMPT, max_tokens=6, sampling=biased({777: 100.0})),
            req(PROMPT, max_tokens=6, sampling=biased({777: 100.0}, temperature=1.0)),
            req(PROMPT, max_tokens=6, sampling=biased({plain[0]: -100.0})),
            req(PROMPT, max_tokens=6, sampling=GREEDY)]
    results = engine.generate_many(reqs)  # one batch: the biased rows beside an unbiased one
    assert results[0].tokens == results[1].tokens == [777] * 6
    assert results[2].tokens[0] != plain[0] and plain[0] not in results[2].tokens
    assert results[3].tokens == plain
    assert [engine.generate(r).tokens for r in reqs[:3]] == [r.tokens for r in results[:3]]


@pytest.mark.parametrize("mode", [{"mode": "speculative", "draft_ahead": 3}, {"mode": "tree", "k_branches": 2}])
def test_speculative_greedy_output_is_plain_greedy_output_under_a_bias(engine: Engine, mode: dict[str, object]) -> None:
    plain = engine.generate(req(PROMPT, max_tokens=10, loops=3, sampling=GREEDY)).tokens
    bias = biased({plain[1]: -100.0, 600: 2.5, 3638: 4.0})
    want = engine.generate(req(PROMPT, max_tokens=10, loops=3, sampling=bias)).tokens
    assert want != plain
    got = engine.generate(req(PROMPT, max_tokens=10, loops=3, sampling=bias, **mode))
    assert got.tokens == want and (got.draft_tokens or 0) > 0
    sampled = engine.generate(req(PROMPT, max_tokens=8, loops=3, sampling=biased({777: 100.0}, 1.0), **mode))
    assert sampled.tokens == [777] * 8


def test_beam_search_honours_the_bias(engine: Engine) -> None:
    plain = engine.generate(req(PROMPT, max_tokens=5, mode="beam", num_beams=3, sampling=GREEDY)).tokens
    forced = engine.generate(req(PROMPT, max_tokens=5, mode="beam", num_beams=3,
                                 sampling=biased({777: 100.0}, logprobs=True)))
    assert forced.tokens == [777] * 5
    assert forced.logprobs is not None and all(lp.logprob < -1 for lp in forced.logprobs)  # raw, not ~0
    other = engine.generate(req(PROMPT, max_tokens=5, mode="beam", num_beams=3, sampling=biased({plain[0]: -100.0})))
    assert plain[0] not in other.tokens


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(engine: Engine) -> None:
    vocab = engine.config.vocab_size
    engine.validate(req(PROMPT, sampling=biased({vocab - 1: 1.0})))
    with pytest.raises(RequestError, match="outside the vocabulary") as info:
        engine.validate(req(PROMPT, sampling=biased({5: 1.0, vocab: 1.0})))
    assert info.value.param == "logit_bias"
