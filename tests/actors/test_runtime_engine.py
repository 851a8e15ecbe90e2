"""The runtime around the real engine on a tiny model (real clock, worker threads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import trio
from prometheus_client.parser import text_string_to_metric_families

import tinyloop
from tinyloop.engine.engine import Engine
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, RequestState, SamplingParams
from tinyloop.tokenizer import default_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def make_engine() -> Engine:
    model = init_model(PRESETS["tiny"].replace(max_position=256), seed=1)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return Engine(model, default_tokenizer(), max_seq_len=256, block_size=8)


def requests() -> list[GenerationRequest]:
    out = []
    for i in range(8):
        sampling = (SamplingParams(temperature=0, ignore_eos=True) if i % 2 == 0
                    else SamplingParams(temperature=0.8, top_k=50, seed=100 + i, ignore_eos=True))
        out.append(GenerationRequest(prompt_tokens=tuple(range(5 + i, 12 + 2 * i)), max_tokens=6 + i,
                                     loops=1 + i % 4, sampling=sampling))
    return out


def bucket(text: str, name: str, le: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket" and s.labels["le"] == le:
                return s.value
    raise KeyError(name)


async def test_eight_streams_share_one_batch_and_match_running_alone() -> None:
    reqs = requests()
    reference = make_engine()
    alone = [reference.generate(r).tokens for r in reqs]
    engine = make_engine()
    got: dict[int, list[int]] = {}
    with trio.fail_after(120):
        async with tinyloop.open_runtime(engine, tinyloop.Settings(max_batch_size=8)) as rt:
            async def run(i: int) -> None:
                async with rt.submit_stream(reqs[i]) as stream:
                    got[i] = [chunk.token_id async for chunk in stream]
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(run, i)
            text = rt.metrics_text()
            assert rt.statistics().in_flight == 0
    assert [got[i] for i in range(8)] == alone
    assert bucket(text, "tinyloop_batch_size", "8.0") - bucket(text, "tinyloop_batch_size", "4.0") > 0
    assert engine.kv_statistics().blocks_used == 0


async def test_cancel_mid_stream_frees_kv_and_spares_the_others() -> None:
    engine = make_engine()
    long = GenerationRequest(prompt_tokens=(1, 2, 3), max_tokens=200,
                             sampling=SamplingParams(temperature=0, ignore_eos=True))
    short = GenerationRequest(prompt_tokens=(4, 5, 6), max_tokens=20,
                              sampling=SamplingParams(temperature=0, ignore_eos=True))
    with trio.fail_after(120):
        async with tinyloop.open_runtime(engine, tinyloop.Settings(max_batch_size=4)) as rt:
            result = {}

            async def other() -> None:
                result["short"] = await rt.submit(short)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(other)
                with trio.move_on_after(30) as scope:
                    async with rt.submit_stream(long) as stream:
                        async for chunk in stream:
                            if chunk.index == 3:
                                scope.cancel()
            while rt.statistics().in_flight:
                await trio.sleep(0.01)
            assert rt.request_state(long.request_id) is RequestState.CANCELLED
            assert engine.kv_statistics().blocks_used == 0
            assert "tinyloop_requests_cancelled_total 1.0" in rt.metrics_text()
    assert result["short"].completion_tokens == 20


async def test_prefix_pool_reuses_kv_with_identical_output() -> None:
    prefix = list(range(20, 52))
    req = GenerationRequest(prompt_tokens=tuple(prefix + [7, 8, 9]), max_tokens=8, loops=3,
                            sampling=SamplingParams(temperature=0, ignore_eos=True))
    expected = make_engine().generate(req).tokens
    engine = make_engine()
    with trio.fail_after(120):
        async with tinyloop.open_runtime(engine) as rt:
            await rt.register_prefix(prefix, loops=3)
            held = engine.kv_statistics().blocks_used
            assert held > 0
            assert (await rt.submit(req)).tokens == expected
            text = rt.metrics_text()
            assert engine.kv_statistics().blocks_used == held  # the entry stays, the request is freed
    assert "tinyloop_prefix_cache_hit_tokens_total 32.0" in text
    assert "tinyloop_prefix_pool_hits_total 1.0" in text
    assert engine.kv_statistics().blocks_used == 0  # closing the runtime frees the pool


def test_embedding_example_runs_from_plain_trio(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "embed.py")], capture_output=True,
                         text=True, timeout=180, check=True)
    # the stream samples (temperature 1, no seed) from a random model: it may draw EOS before 16 chunks
    assert "loops= 1" in out.stdout and "loops= 8" in out.stdout and "stream chunk 0" in out.stdout
    assert "in_flight=0" in out.stdout


async def stream_all(rt: tinyloop.Runtime, reqs: list[GenerationRequest]) -> tuple[list[list[int]], int]:
    """Stream every request at once: each one's tokens, and the most that were decoding together."""
    got: dict[int, list[int]] = {}
    peak = 0

    async def run(i: int) -> None:
        nonlocal peak
        async with rt.submit_stream(reqs[i]) as stream:
            got[i] = []
            async for chunk in stream:
                got[i].append(chunk.token_id)
                peak = max(peak, sum(rt.request_state(r.request_id) is RequestState.DECODING for r in reqs))

    async with trio.open_nursery() as nursery:
        for i in range(len(reqs)):
            nursery.start_soon(run, i)
    return [got[i] for i in range(len(reqs))], peak


async def test_sequences_grow_their_kv_and_the_youngest_is_preempted_when_it_runs_short() -> None:
    """A pool with room for two requests' full length: eight at once start together (each
    takes blocks as it grows), the youngest are preempted and recomputed when the pool runs dry,
    and every one completes with its solo output."""
    reqs = [GenerationRequest(prompt_tokens=tuple(range(5 + i, 17 + i)), max_tokens=36, loops=4,
                              sampling=SamplingParams(temperature=0, ignore_eos=True)) for i in range(8)]
    reference = make_engine()
    alone = [reference.generate(r).tokens for r in reqs]
    need = reference.kv_blocks_needed(reqs[0])
    per_block = reference.kv_statistics().bytes_per_block
    engine = Engine(reference.model, default_tokenizer(), max_seq_len=256, block_size=8,
                    kv_cache_mb=(2 * need + need // 2) * per_block / 2**20, prefix_caching=False)
    assert 2 * need <= engine.kv_statistics().blocks_total < 3 * need
    with trio.fail_after(120):
        async with tinyloop.open_runtime(engine, tinyloop.Settings(max_batch_size=8)) as rt:
            got, peak = await stream_all(rt, reqs)
            assert rt.statistics().in_flight == 0
            preempted = rt.metrics.registry.get_sample_value("tinyloop_preemptions_total")
    assert got == alone
    assert peak > 2  # more side by side than their worst cases would allow
    assert preempted and preempted > 0
    assert engine.kv_statistics().blocks_used == 0


async def test_blocks_a_registered_prefix_pins_are_never_taken() -> None:
    """A pool with room for three requests, a third of it pinned by a registered prefix: all
    complete with their solo output (preempting each other, never the prefix), and the prefix
    keeps its blocks."""
    reqs = [GenerationRequest(prompt_tokens=tuple(range(5 + i, 17 + i)), max_tokens=36, loops=4,
                              sampling=SamplingParams(temperature=0, ignore_eos=True)) for i in range(3)]
    reference = make_engine()
    alone = [reference.generate(r).tokens for r in reqs]
    need = reference.kv_blocks_needed(reqs[0])
    per_block = reference.kv_statistics().bytes_per_block
    engine = Engine(reference.model, default_tokenizer(), max_seq_len=256, block_size=8,
                    kv_cache_mb=(3 * need + need // 2) * per_block / 2**20, prefix_caching=False)
    with trio.fail_after(120):
        async with tinyloop.open_runtime(engine, tinyloop.Settings(max_batch_size=8)) as rt:
            await rt.register_prefix(list(range(900, 948)), loops=4)  # 48 tokens: `need` blocks
            assert engine.kv_statistics().blocks_used == need
            got, _ = await stream_all(rt, reqs)
            assert engine.kv_statistics().blocks_used == need
    assert got == alone


async def test_registering_a_prefix_prefills_a_chunk_per_step_beside_running_streams() -> None:
    """A 240-token prefix registered in chunks of 16 while a stream decodes: the stream keeps
    getting tokens between the chunks (the whole prefill in one call would stall it), and the
    registered prefix then serves a request with the same output as without it."""
    reference = make_engine()
    engine = Engine(reference.model, default_tokenizer(), max_seq_len=256, block_size=8, prefill_chunk=16)
    stream_req = GenerationRequest(prompt_tokens=(5, 6, 7), max_tokens=200, loops=1,
                                   sampling=SamplingParams(temperature=0, ignore_eos=True))
    prefix = list(range(300, 540))
    later = GenerationRequest(prompt_tokens=(*prefix, 9, 9), max_tokens=6, loops=4,
                              sampling=SamplingParams(temperature=0))
    during: list[int] = []
    registering = False
    with trio.fail_after(120):
        async with tinyloop.open_runtime(engine, tinyloop.Settings(max_batch_size=4)) as rt:
            async with trio.open_nursery() as nursery:
                async def stream() -> None:
                    async with rt.submit_stream(stream_req) as s:
                        async for chunk in s:
                            if registering:
                                during.append(chunk.index)
                nursery.start_soon(stream)
                while engine.prefilled_tokens < 3:
                    await trio.sleep(0.001)
                registering = True
                await rt.register_prefix(prefix, loops=4)
                registering = False
            assert rt.statistics().prefix_pool_size == 1
            result = await rt.submit(later)
    assert len(during) >= 240 // 16 - 1  # a token of the stream beside (nearly) every chunk
    assert result.tokens == reference.generate(later).tokens
    assert result.prompt_tokens == len(prefix) + 2


async def test_a_prefix_that_can_never_fit_is_refused() -> None:
    engine = Engine(make_engine().model, default_tokenizer(), max_seq_len=256, block_size=8,
                    kv_cache_mb=64 * 2048 / 2**20)  # 64 blocks; 240 tokens at 4 loops need 300
    with trio.fail_after(30):
        async with tinyloop.open_runtime(engine, tinyloop.Settings()) as rt:
            try:
                await rt.register_prefix(list(range(300, 540)), loops=4)
            except tinyloop.RequestError as exc:
                assert "KV" in str(exc)
            else:
                raise AssertionError("a prefix larger than the pool was registered")
            assert rt.statistics().prefix_pool_size == 0
            assert engine.kv_statistics().blocks_used == 0
