"""Automatic prefix caching: full blocks of ended sequences serve later prompts, shared, evictable."""

from __future__ import annotations

import pytest
import torch
import trio

import tinyloop
from tinyloop.engine.engine import Engine
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams

BS = 8
PREFIX = list(range(100, 140))  # 5 full blocks


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_engine(**options: object) -> Engine:
    from tinyloop.tokenizer import default_tokenizer

    model = init_model(PRESETS["tiny"].replace(max_position=256), seed=0)
    with torch.no_grad():  # peaked logits: no argmax ties between equal computations
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    options.setdefault("block_size", BS)
    return Engine(model, default_tokenizer(), max_seq_len=256, **options)  # type: ignore[arg-type]


def req(prompt: list[int], max_tokens: int = 6, **kw: object) -> GenerationRequest:
    kw.setdefault("sampling", SamplingParams(temperature=0, ignore_eos=True))
    kw.setdefault("loops", 2)
    return GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference() -> Engine:
    return make_engine(prefix_caching=False)


def test_a_shared_prefix_is_prefilled_once_and_gives_the_same_output(reference: Engine) -> None:
    eng = make_engine()
    eng.generate(req(PREFIX + [1, 2]))
    second = req(PREFIX + [3, 4, 5])
    before = eng.prefilled_tokens
    assert eng.generate(second).tokens == reference.generate(second).tokens
    assert eng.prefilled_tokens - before == 3  # only the suffix ran
    assert eng.kv_statistics().blocks_used == 0


def test_cached_blocks_are_shared_not_copied() -> None:
    eng = make_engine()
    eng.generate(req(PREFIX + [1]))
    cached = eng.kv_statistics().blocks_cached
    a, b = eng.start(req(PREFIX + [2, 3])), eng.start(req(PREFIX + [4]))
    slots = a.kv.n_slots
    assert (a.cached_tokens, b.cached_tokens) == (40, 40)
    assert a.kv.tables == b.kv.tables and a.kv.num_blocks == slots * 5
    stats = eng.kv_statistics()
    assert stats.blocks_used == slots * 5  # both sequences hold the same blocks
    assert stats.blocks_cached == cached - slots * 5
    eng.free(a)
    eng.free(b)
    assert eng.kv_statistics().blocks_used == 0


def test_the_last_prompt_token_always_runs() -> None:
    eng = make_engine()
    eng.generate(req(PREFIX))
    seq = eng.start(req(PREFIX))  # a prompt of exactly 5 cached blocks
    assert seq.cached_tokens == 32  # the fifth block holds the last token: it runs again
    eng.free(seq)


def test_decoded_tokens_are_cached_too(reference: Engine) -> None:
    eng = make_engine()
    first = eng.generate(req(PREFIX[:30], max_tokens=12))
    follow_up = req(PREFIX[:30] + first.tokens + [7])
    seq = eng.start(follow_up)
    assert seq.cached_tokens == 40  # prompt and decoded positions < kv.length
    eng.free(seq)
    assert eng.generate(follow_up).tokens == reference.generate(follow_up).tokens


def test_warm_start_decoded_blocks_are_not_reused() -> None:
    eng = make_engine()
    first = eng.generate(req(PREFIX[:30], max_tokens=12, warm_start=True))
    seq = eng.start(req(PREFIX[:30] + first.tokens + [7]))
    assert seq.cached_tokens == 24  # the prompt's full blocks only
    eng.free(seq)


def test_a_small_pool_evicts_idle_blocks_and_corrupts_no_running_sequence(reference: Engine) -> None:
    per_token = reference.kv_bytes_per_token(2)
    eng = make_engine(kv_cache_mb=per_token * 4 * 48 / 2**20)  # four sequences of 48 tokens
    family = [list(range(100, 140)), list(range(300, 340))]  # rounds alternate between two
    rounds = [[req(family[r % 2][: 8 + 8 * ((i + r) % 4)] + [200 + i, r], max_tokens=8)
               for i in range(4)] for r in range(5)]
    for batch in rounds:
        assert [x.tokens for x in eng.generate_many(batch)] == \
            [x.tokens for x in reference.generate_many(batch)]
    assert eng.pool.cache.evictions > 0
    assert eng.kv_statistics().blocks_used == 0


def test_speculative_and_tree_requests_use_the_pool_and_the_cache(reference: Engine) -> None:
    eng = make_engine()
    entry = eng.prefill_prefix(PREFIX[:20], loops=2)
    for i, mode in enumerate(("speculative", "tree")):
        r = req(PREFIX[:20] + [i] + PREFIX[20:], mode=mode, max_tokens=8)
        seq = eng.start(r, entry)
        assert seq.cached_tokens == 20
        eng.free(seq)
        expected = reference.generate(r).tokens
        assert eng.generate(r).tokens == expected
        seq = eng.start(r)  # the run above left its blocks in the cache
        assert seq.cached_tokens == 40
        eng.free(seq)
        assert eng.generate(r).tokens == expected
    eng.free(entry)
    assert eng.kv_statistics().blocks_used == 0


def test_other_loops_or_a_short_window_do_not_share() -> None:
    eng = make_engine()
    eng.generate(req(PREFIX + [1], loops=2))
    for kw in ({"loops": 3}, {"loops": 2, "cache_window": 1}):
        seq = eng.start(req(PREFIX + [1], **kw))
        assert seq.cached_tokens == 0
        eng.free(seq)


def test_turning_it_off_keeps_nothing() -> None:
    eng = make_engine(prefix_caching=False)
    eng.generate(req(PREFIX + [1]))
    assert eng.kv_statistics().blocks_cached == 0
    before = eng.prefilled_tokens
    eng.generate(req(PREFIX + [2]))
    assert eng.prefilled_tokens - before == 41


async def test_the_runtime_counts_cache_hits() -> None:
    eng = make_engine()
    with trio.fail_after(60):
        async with tinyloop.open_runtime(eng) as rt:
            await rt.submit(req(PREFIX + [1]))
            await rt.submit(req(PREFIX + [2]))
            text = rt.metrics_text()
    assert "tinyloop_prefix_cache_queried_tokens_total 82.0" in text
    assert "tinyloop_prefix_cache_hit_tokens_total 40.0" in text
    assert "tinyloop_prefix_pool_hits_total 0.0" in text


def test_block_keys_name_the_whole_prefix_and_the_salt() -> None:
    from tinyloop.model.blockcache import block_keys

    salt = (4, 4, 7, "fp32", "None")
    tokens = list(range(40))
    keys = block_keys(tokens, 16, 2, salt)
    assert len(keys) == 2 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert keys == block_keys(tokens + [99], 16, 2, salt)  # only full blocks count
    assert block_keys(tokens, 16, 1, salt) == keys[:1]
    changed_first = block_keys([1000] + tokens[1:], 16, 2, salt)
    assert changed_first[0] != keys[0] and changed_first[1] != keys[1]  # a chain: the prefix counts
    changed_second = block_keys(tokens[:16] + [1000] + tokens[17:], 16, 2, salt)
    assert changed_second[0] == keys[0] and changed_second[1] != keys[1]
    assert block_keys(tokens, 16, 2, (8, 8, 7, "fp32", "None")) != keys
    # Python's hash of an int tuple is -2 for both (-1,) and (-2,); the digest tells them apart.
    assert block_keys([-1] * 16, 16, 1, salt) != block_keys([-2] * 16, 16, 1, salt)
