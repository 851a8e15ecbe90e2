"""The engine contract on a tiny random model: batching, sampling, stops, limits, KV lifetime."""

from __future__ import annotations

import pytest
import torch

from tinyloop.engine.engine import Engine
from tinyloop.errors import KVCacheExhausted, PromptTooLongError, RequestError
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationChunk, GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer


def make_engine(config_changes: dict[str, object] | None = None, **options: object) -> Engine:
    model = init_model(PRESETS["tiny"].replace(max_position=256, **(config_changes or {})), seed=0)
    with torch.no_grad():  # larger weights than a fresh init: peaked logits, no argmax ties
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return Engine(model, default_tokenizer(), **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(max_seq_len=256, block_size=8)


def req(prompt: list[int], **kw: object) -> GenerationRequest:
    sampling = kw.pop("sampling", SamplingParams(temperature=0))
    return GenerationRequest(prompt_tokens=tuple(prompt), sampling=sampling, **kw)  # type: ignore[arg-type]


MIXED = [
    req([5, 6, 7], max_tokens=9, loops=1),
    req(list(range(10, 31)), max_tokens=6, loops=4, cache_window=2),
    req([40, 41, 42, 43, 44], max_tokens=8, loops=3,
        sampling=SamplingParams(temperature=0.9, top_k=40, seed=123, ignore_eos=True)),
    req([50] * 12, max_tokens=7, loops=2, warm_start=True,
        sampling=SamplingParams(temperature=1.1, top_p=0.9, presence_penalty=0.5, seed=9,
                                ignore_eos=True)),
    req([60, 61], max_tokens=5, sampling=SamplingParams(temperature=0, repetition_penalty=1.3)),
]


def test_batched_generation_equals_each_request_alone(engine: Engine) -> None:
    together = engine.generate_many(MIXED)
    alone = [engine.generate(r) for r in MIXED]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]
    assert len({tuple(r.tokens) for r in alone}) == len(MIXED)
    assert engine.kv_statistics().blocks_used == 0


def test_same_seed_same_tokens_different_seed_differs(engine: Engine) -> None:
    def run(seed: int) -> list[int]:
        s = SamplingParams(temperature=1.0, seed=seed, ignore_eos=True)
        return engine.generate(req([1, 2, 3], max_tokens=12, sampling=s)).tokens
    assert run(4) == run(4)
    assert run(4) != run(5)


def test_chunked_prefill_gives_the_same_output() -> None:
    small = make_engine(max_seq_len=256, prefill_chunk=3)
    big = make_engine(max_seq_len=256, prefill_chunk=512)
    r = req(list(range(100, 140)), max_tokens=5, loops=3)
    assert small.generate(r).tokens == big.generate(r).tokens


def test_loops_change_the_output(engine: Engine) -> None:
    outs = {loops: engine.generate(req(list(range(7, 27)), max_tokens=8, loops=loops)).tokens
            for loops in (1, 2, 8)}
    assert len({tuple(v) for v in outs.values()}) == 3


def test_cache_window_allocates_exactly_its_slots(engine: Engine) -> None:
    cfg = engine.config
    for window, loops in [(1, 6), (2, 6), (6, 6)]:
        seq = engine.start(req(list(range(16)), max_tokens=2, loops=loops, cache_window=window))
        engine.prefill(seq)
        slots = cfg.n_prelude + cfg.n_coda + cfg.n_core * window
        assert seq.kv.n_slots == slots
        assert engine.kv_statistics().blocks_used == slots * 2  # 16 tokens, blocks of 8
        used = engine.kv_statistics().blocks_used * engine.kv_statistics().bytes_per_block
        assert used == 16 * engine.kv_bytes_per_token(loops, window)
        engine.free(seq)
    assert engine.kv_statistics().blocks_used == 0


def test_stop_string_is_cut_exactly(engine: Engine) -> None:
    base = engine.generate(req(list(range(30, 40)), max_tokens=12))
    text = base.text
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = text[: text.index(stop)]
    out = engine.generate(req(list(range(30, 40)), max_tokens=12,
                              sampling=SamplingParams(temperature=0, stop=(stop,))))
    assert out.text == cut
    assert (out.finish_reason, out.stop_reason) == ("stop", "stop_string")


def test_stop_token_ids_eos_and_length(engine: Engine) -> None:
    base = engine.generate(req([3, 4, 5], max_tokens=10, sampling=SamplingParams(temperature=0, ignore_eos=True)))
    assert (base.finish_reason, base.completion_tokens) == ("length", 10)
    target = base.tokens[4]
    out = engine.generate(req([3, 4, 5], max_tokens=10,
                              sampling=SamplingParams(temperature=0, stop_token_ids=(target,), ignore_eos=True)))
    assert out.tokens == base.tokens[: base.tokens.index(target) + 1]
    assert out.stop_reason == "stop_token"


def test_stream_chunks_add_up_to_the_result(engine: Engine) -> None:
    chunks: list[GenerationChunk] = []
    r = req([9, 8, 7], max_tokens=10, sampling=SamplingParams(temperature=0, logprobs=True, top_logprobs=3))
    result = engine.generate_stream(r, chunks.append)
    assert [c.token_id for c in chunks] == result.tokens
    assert "".join(c.text for c in chunks) == result.text
    assert result.logprobs is not None and len(result.logprobs) == len(result.tokens)
    assert all(len(lp.top) == 3 and lp.top[0][0] == lp.token_id for lp in result.logprobs)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert result.mean_loops == engine.default_loops


def test_limits_raise_typed_errors(engine: Engine) -> None:
    with pytest.raises(PromptTooLongError, match="exceeds max_seq_len"):
        engine.generate(req(list(range(200)), max_tokens=57))
    with pytest.raises(RequestError, match="loops must be <= 16") as info:
        engine.generate(req([1], loops=17))
    assert info.value.param == "loops"
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate(req([4096]))


def test_kv_exhaustion_fails_only_the_sequence_that_needs_blocks() -> None:
    eng = make_engine(max_seq_len=256, block_size=4, kv_cache_mb=1.0)  # 1024 blocks
    total = eng.kv_statistics().blocks_total
    others = eng.pool.allocate(total - 50)  # held elsewhere: 50 blocks left
    small = eng.start(req([1, 2, 3], max_tokens=3, loops=1))  # 4 slots x 1 block
    big = eng.start(req(list(range(60)), max_tokens=3, loops=8))  # 2+2*8 slots x 15 blocks
    events = eng.step([small, big])
    assert isinstance(big.error, KVCacheExhausted) and big.finish_reason == "error"
    assert [e.sequence for e in events] == [small]
    while not small.finished:
        eng.step([small])
    assert small.result().completion_tokens == 3
    eng.free(small)
    eng.free(big)
    eng.pool.release(others)
    stats = eng.kv_statistics()  # nothing held: idle prefix-cache blocks are evictable
    assert (stats.blocks_used, stats.blocks_free + stats.blocks_cached) == (0, total)


def test_warm_start_changes_decoding(engine: Engine) -> None:
    prompt = list(range(70, 80))
    cold = engine.generate(req(prompt, max_tokens=10, loops=2))
    warm = engine.generate(req(prompt, max_tokens=10, loops=2, warm_start=True))
    assert cold.tokens[0] == warm.tokens[0]  # the first token comes from the prompt alone
    assert cold.tokens != warm.tokens


def test_padded_vocabulary_rows_are_never_sampled() -> None:
    """A checkpoint whose embedding has more rows than the tokenizer (padding) never samples them."""
    model = init_model(PRESETS["tiny"].replace(vocab_size=4200, max_position=64), seed=3)
    with torch.no_grad():
        model.embed.weight[4096:] = 5.0  # the padding rows would win every argmax
    eng = Engine(model, default_tokenizer(), max_seq_len=64)
    for sampling in (SamplingParams(temperature=0, ignore_eos=True),
                     SamplingParams(temperature=1.0, seed=0, ignore_eos=True)):
        out = eng.generate(req([1, 2, 3], max_tokens=8, sampling=sampling))
        assert max(out.tokens) < 4096 and len(out.tokens) == 8
