"""Prompt logprobs (``prompt_logprobs``) and ``max_tokens == 0`` in the engine: the prefill the
request runs anyway gives every prompt token's logprob, equal to a teacher-forced forward of the
whole prompt, whatever the chunking, the batch, the prefix cache, the prefix pool or a
preemption did to that prefill."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine import make_engine, req
from tinyloop.engine.engine import Engine
from tinyloop.engine.sequence import Sequence
from tinyloop.errors import RequestError
from tinyloop.model.context import FullContext
from tinyloop.model.looped import RowSpec
from tinyloop.requests import GenerationRequest, GenerationResult, SamplingParams, TokenLogprob

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
PROMPT = [(17 * i + 5) % 700 + 3 for i in range(29)]  # 29 tokens: 3 blocks of 8 and 5, chunks of 5 and 4
LOOPS = 3


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(max_seq_len=256, block_size=8)


def reference(engine: Engine, prompt: list[int], loops: int = LOOPS) -> torch.Tensor:
    """Teacher forcing: ``log_softmax`` of one uncached forward of the whole prompt ``[T, V]``."""
    model = engine.model
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), FullContext(model.rope, 1, len(prompt)),
                    [RowSpec(loops=loops, window=loops)], last_only=False)
        logits = out.logits[0].float()  # [T, V]
        logits[:, engine.vocab_limit:] = float("-inf")  # the engine's rule for checkpoint padding
        return torch.log_softmax(logits, dim=-1)


def expect_reference(entries: list[TokenLogprob | None] | None, want: torch.Tensor, prompt: list[int],
                     top: int = 0) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        assert entry is not None and entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(want[i - 1, prompt[i]]), abs=1e-5)
        values, ids = want[i - 1].sort(descending=True, stable=True)
        assert [t for t, _ in entry.top] == ids[:top].tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values[:top].tolist(), abs=1e-5)


def asking(prompt: list[int] = PROMPT, top: int = 0, **kw: object) -> GenerationRequest:
    kw.setdefault("max_tokens", 3)
    kw.setdefault("sampling", GREEDY)
    return req(prompt, loops=LOOPS, prompt_logprobs=top, **kw)


def test_prompt_logprobs_equal_a_teacher_forced_forward(engine: Engine) -> None:
    result = engine.generate(asking())
    expect_reference(result.prompt_logprobs, reference(engine, PROMPT), PROMPT)
    assert engine.generate(req(PROMPT, max_tokens=3, loops=LOOPS, sampling=GREEDY)).prompt_logprobs is None


def test_the_output_is_the_same_with_and_without_them(engine: Engine) -> None:
    plain = engine.generate(req(PROMPT, max_tokens=6, loops=LOOPS, sampling=GREEDY))
    assert engine.generate(asking(top=2, max_tokens=6)).tokens == plain.tokens


def test_chunked_prefill_keeps_the_entry_across_each_chunk_boundary() -> None:
    for chunk in (1, 4, 5, 28):
        small = make_engine(max_seq_len=256, block_size=8, prefill_chunk=chunk)
        result = small.generate(asking(top=3))
        expect_reference(result.prompt_logprobs, reference(small, PROMPT), PROMPT, top=3)


def test_top_alternatives_are_the_best_first(engine: Engine) -> None:
    result = engine.generate(asking(top=20))
    expect_reference(result.prompt_logprobs, reference(engine, PROMPT), PROMPT, top=20)
    assert all(len(e.top) == 20 for e in (result.prompt_logprobs or [])[1:] if e is not None)


def test_the_device_way_to_the_alternatives_is_the_hosts() -> None:
    """A GPU sorts every row (``_sorted_tops``), the host cuts each off (``_top_logprobs``): the
    same entries, ties to the lower id."""
    from tinyloop.engine.sampling import _sorted_tops, _top_logprobs

    logprobs = torch.log_softmax(torch.randn(6, 40, generator=torch.Generator().manual_seed(1)).round(), dim=-1)
    for n in (1, 5, 40):
        assert _sorted_tops(logprobs, n) == [_top_logprobs(row, n) for row in logprobs]


def test_a_one_token_prompt_has_one_entry(engine: Engine) -> None:
    assert engine.generate(asking([42])).prompt_logprobs == [None]


def test_in_a_batch_with_other_requests(engine: Engine) -> None:
    others = [req(list(range(30, 30 + n)), max_tokens=5, loops=LOOPS, sampling=GREEDY) for n in (9, 17, 4)]
    alone = [engine.generate(r).tokens for r in others]
    mine = asking(PROMPT, top=1, max_tokens=4)
    results = engine.generate_many([others[0], mine, others[1], others[2]])
    expect_reference(results[1].prompt_logprobs, reference(engine, PROMPT), PROMPT, top=1)
    assert [results[i].tokens for i in (0, 2, 3)] == alone
    assert [results[i].prompt_logprobs for i in (0, 2, 3)] == [None] * 3


def test_several_asking_in_one_step_each_get_their_own(engine: Engine) -> None:
    prompts = [PROMPT, PROMPT[:11], list(range(100, 120))]
    results = engine.generate_many([asking(p, top=2) for p in prompts])
    for p, r in zip(prompts, results):
        expect_reference(r.prompt_logprobs, reference(engine, p), p, top=2)


def test_the_last_logits_are_not_a_view_of_every_positions() -> None:
    """Only the entries and the last position's logits outlive the chunk's forward."""
    eng = make_engine(max_seq_len=256, block_size=8)
    seq = eng.start(asking())
    logits = eng.prefill(seq)
    eng.free(seq)
    assert logits.untyped_storage().nbytes() == logits.numel() * logits.element_size()


# -- the prefix cache, the prefix pool, preemption ---------------------------------------------

def test_a_prefix_cache_hit_still_reports_every_entry() -> None:
    """A request asking for prompt logprobs takes no cached blocks (``cached_tokens == 0``) and
    reports what a cold cache gives; its own blocks still go to the cache for the next one."""
    eng = make_engine(max_seq_len=256, block_size=8)
    want = reference(eng, PROMPT)
    warm = eng.generate(req(PROMPT, max_tokens=3, loops=LOOPS, sampling=GREEDY))
    hit = eng.generate(req(PROMPT, max_tokens=3, loops=LOOPS, sampling=GREEDY))
    assert (warm.cached_tokens, hit.cached_tokens) == (0, 24)  # the cache works for a plain request
    first = eng.generate(asking(top=2))
    second = eng.generate(asking(top=2))
    for r in (first, second):
        expect_reference(r.prompt_logprobs, want, PROMPT, top=2)
        assert r.cached_tokens == 0 and r.tokens == warm.tokens
    assert first.prompt_logprobs == second.prompt_logprobs
    assert eng.generate(req(PROMPT, max_tokens=3, loops=LOOPS, sampling=GREEDY)).cached_tokens == 24
    assert eng.kv_statistics().blocks_used == 0


def test_a_prefix_pool_entry_is_not_shared_with_a_request_asking() -> None:
    eng = make_engine(max_seq_len=256, block_size=8, prefix_caching=False)
    entry = eng.prefill_prefix(PROMPT[:20], loops=LOOPS)
    try:
        plain = eng.start(req(PROMPT, max_tokens=2, loops=LOOPS, sampling=GREEDY), prefix=entry)
        mine = eng.start(asking(top=1, max_tokens=2), prefix=entry)
        assert (plain.cached_tokens, mine.cached_tokens) == (20, 0)
        results = finish(eng, [plain, mine])
    finally:
        eng.free(entry)
    expect_reference(results[1].prompt_logprobs, reference(eng, PROMPT), PROMPT, top=1)
    assert results[0].tokens == results[1].tokens


def finish(eng: Engine, seqs: list[Sequence]) -> list[GenerationResult]:
    try:
        while not all(s.finished for s in seqs):
            eng.step([s for s in seqs if not s.finished])
        assert all(s.error is None for s in seqs)
        return [s.result() for s in seqs]
    finally:
        for s in seqs:
            eng.free(s)


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_mid_prompt_neither_repeats_nor_loses_an_entry(caching: bool) -> None:
    eng = make_engine(max_seq_len=256, block_size=8, prefill_chunk=10, prefix_caching=caching)
    expected = eng.generate(req(PROMPT, max_tokens=4, loops=LOOPS, sampling=GREEDY)).tokens  # caches 24
    seq = eng.start(asking(top=1, max_tokens=4))
    assert seq.kv.length == 0
    eng.step([seq])
    eng.step([seq])  # 20 of 29 prompt positions in: the None and the entries of tokens 1..20
    assert seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == 21
    eng.preempt(seq)
    eng.resume(seq)  # the cache has 24 positions, but position 20's logits are still needed
    assert seq.kv.length == (16 if caching else 0)
    result = finish(eng, [seq])[0]
    expect_reference(result.prompt_logprobs, reference(eng, PROMPT), PROMPT, top=1)
    assert result.tokens == expected


def test_preempted_while_decoding_keeps_its_entries() -> None:
    # one token a step (no burst): the sequence is preempted with half its output made
    eng = make_engine(max_seq_len=256, block_size=8, prefill_chunk=10, decode_burst=1)
    expected = eng.generate(req(PROMPT, max_tokens=6, loops=LOOPS, sampling=GREEDY)).tokens
    seq = eng.start(asking(max_tokens=6))
    while len(seq.output) < 3:
        eng.step([seq])
    eng.preempt(seq)
    eng.resume(seq)  # everything made: the cache serves the prompt and the output as for anyone
    assert seq.kv.length == 24 and seq.resumed
    result = finish(eng, [seq])[0]
    expect_reference(result.prompt_logprobs, reference(eng, PROMPT), PROMPT)
    assert result.tokens == expected


# -- max_tokens == 0 ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [{}, {"mode": "speculative"}, {"mode": "tree"}, {"mode": "beam", "num_beams": 2}])
def test_max_tokens_zero_prefills_and_samples_nothing(engine: Engine, mode: dict[str, object]) -> None:
    result = engine.generate(asking(PROMPT, 1, max_tokens=0, **mode))
    assert (result.tokens, result.text, result.completion_tokens) == ([], "", 0)
    assert (result.finish_reason, result.stop_reason, result.prompt_tokens) == ("length", "length", len(PROMPT))
    assert result.time_to_first_token_ms is None and result.mean_loops is None
    expect_reference(result.prompt_logprobs, reference(engine, PROMPT), PROMPT, top=1)
    assert engine.kv_statistics().blocks_used == 0


def test_max_tokens_zero_streams_no_chunk_and_sits_beside_decoding_requests(engine: Engine) -> None:
    other = req(list(range(30, 39)), max_tokens=5, loops=LOOPS, sampling=GREEDY)
    chunks: list[int] = []
    results = engine.generate_many([asking(max_tokens=0), other],
                                   emit=lambda i, _chunk: chunks.append(i))
    assert results[0].tokens == [] and chunks == [1] * 5
    assert results[1].tokens == engine.generate(other).tokens


def test_max_tokens_zero_fits_a_pool_its_prompt_fills() -> None:
    """Starting asks for the prompt only (no room for a first token that never comes)."""
    probe = make_engine(max_seq_len=256, block_size=8)
    small = make_engine(max_seq_len=256, block_size=8,  # room for 32 positions at LOOPS loops
                        kv_cache_mb=32 * probe.kv_bytes_per_token(LOOPS) / 2**20)
    prompt = list(range(3, 35))  # 32 tokens: four blocks per slot, the whole pool
    r = asking(prompt, max_tokens=0)
    assert small.kv_start_blocks(r) == small.pool.num_blocks
    assert len(small.generate(r).prompt_logprobs or []) == 32
    with pytest.raises(RequestError, match="KV blocks"):  # the pool holds the prompt and nothing more
        small.validate(asking(prompt, max_tokens=1))
