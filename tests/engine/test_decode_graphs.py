"""The decode step that CUDA graphs capture (``engine/graphs.py``), run eagerly on the CPU.

What a graph replays is ``DecodeGraphs._step`` on a ``StaticContext``: fixed shapes, the batch
padded to a bucket, every block table padded to the engine's longest context. These tests hold
that step to the engine's own eager decode (same logits, same tokens), check which batches it
covers, and check that it reads nothing back to the host: a capture would fail on any such read.
The capture and replay themselves run only on a GPU (``tests/cuda/test_cuda_gpu.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.engine.test_device import default_device_meta
from tests.engine.test_engine import req
from tinyloop.engine.engine import Engine
from tinyloop.engine.graphs import DecodeGraphs
from tinyloop.engine.sequence import Sequence
from tinyloop.errors import ConfigError, RequestError
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.settings import Settings
from tinyloop.tokenizer import default_tokenizer
from tinyloop.vocabulary import ExitRule

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=3, ignore_eos=True)

# the tiny preset (sandwich, concat adapter, randn initial state) and an Ouro-like variant
# (peri-LN, the state normed every loop, embed initial state, interleaved RoPE with q/k bias)
CONFIGS = {
    "tiny": {},
    "ouro-like": dict(n_prelude=0, n_coda=0, block_style="peri_ln", injection="none", state_init="embed",
                      loop_norm="every_loop", rope_style="interleaved", qk_bias=True, tie_embeddings=False),
}


def make_engine(config: str = "tiny", *, graphs: bool, **options: Any) -> Engine:
    model = init_model(PRESETS["tiny"].replace(max_position=256, **CONFIGS[config]), seed=0)
    with torch.no_grad():  # peaked logits: no argmax ties between the two paths
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    engine = Engine(model, default_tokenizer(), max_seq_len=96, block_size=8, **options)
    if graphs:  # the graphs' step without capturing (the CPU): what a replay computes
        engine.graphs = DecodeGraphs.of(engine, capture=False, max_rows=8)
    return engine


def prefilled(engine: Engine, requests: list[GenerationRequest]) -> list[Sequence]:
    """Sequences past their prompts, each with its first token pending."""
    seqs = [engine.start(r) for r in requests]
    for s in seqs:
        logits = engine.prefill(s)
        s.pending = int(logits.argmax())
    return seqs


def batch(loops: int = 3, window: int | None = None, **kw: Any) -> list[GenerationRequest]:
    """Three prompts of different lengths (9, 17 and 2 tokens: across block boundaries)."""
    return [req(list(range(10 + 3 * i, 10 + 3 * i + n)), max_tokens=12, loops=loops, cache_window=window,
                sampling=GREEDY, **kw) for i, n in enumerate((9, 17, 2))]


@pytest.mark.parametrize("config,kv_mode", [("tiny", "full"), ("ouro-like", "full"), ("tiny", "int4")])
@pytest.mark.parametrize("loops,window", [(3, None), (4, 2), (1, None)])
def test_the_static_step_gives_the_eager_logits(config: str, kv_mode: str, loops: int, window: int | None) -> None:
    # int4: torch's ops on both paths. The C panels round a 4-row product (the bucket) a few ulps
    # apart from a 3-row one, and a 4-bit code can flip on that: then the logits differ by ~1e-3.
    options = {"kv_mode": kv_mode, "cpu_kernels": kv_mode != "int4"}
    eager, static = make_engine(config, graphs=False, **options), make_engine(config, graphs=True, **options)
    requests = batch(loops, window)
    a, b = prefilled(eager, requests), prefilled(static, requests)
    assert [s.pending for s in a] == [s.pending for s in b]
    for _ in range(10):  # past the 16- and 24-token block boundaries of the shorter rows
        want, got = eager.decode(a), static.decode(b)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for sa, sb, row in zip(a, b, want):
            sa.pending = sb.pending = int(row.argmax())
        assert [s.kv.length for s in a] == [s.kv.length for s in b]
    assert static.graphs is not None and static.graphs.replays == 10
    assert list(static.graphs.graphs) == [(4, loops, False)]  # 3 rows: bucket 4, every row at `loops`
    # the same work counted as the eager forward counts it
    assert static.model.counters["core_row_loops"] - eager.model.counters["core_row_loops"] == 0


@pytest.mark.parametrize("config,kv_mode", [("tiny", "full"), ("ouro-like", "full"), ("tiny", "int4")])
def test_rows_of_different_loops_and_windows_share_one_graph(config: str, kv_mode: str) -> None:
    """The dial turned per request: rows at 4, 1, 3 and 2 loops with full and shared windows in
    one graph (the largest loop count, each row's slots mapped through its tables, the shorter
    rows held past their loops) give the eager logits, and write nothing the eager step does not."""
    options = {"kv_mode": kv_mode, "cpu_kernels": kv_mode != "int4"}
    eager, static = make_engine(config, graphs=False, **options), make_engine(config, graphs=True, **options)
    requests = [req(list(range(10, 19)), max_tokens=12, loops=4, sampling=GREEDY),
                req(list(range(20, 37)), max_tokens=12, loops=1, sampling=GREEDY),
                req([5, 6], max_tokens=12, loops=3, cache_window=2, sampling=GREEDY),
                req(list(range(40, 47)), max_tokens=12, loops=2, cache_window=1, sampling=GREEDY),
                req(list(range(50, 62)), max_tokens=12, loops=4, cache_window=3, sampling=GREEDY)]
    a, b = prefilled(eager, requests), prefilled(static, requests)
    for _ in range(10):  # past block boundaries
        want, got = eager.decode(a), static.decode(b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for sa, sb, row in zip(a, b, want):
            sa.pending = sb.pending = int(row.argmax())
    assert static.graphs is not None and static.graphs.replays == 10
    assert list(static.graphs.graphs) == [(8, 4, True)]  # five rows in bucket 8, up to 4 loops
    assert [s.last_loops for s in b] == [s.last_loops for s in a] == [4, 1, 3, 2, 4]
    assert static.model.counters["core_row_loops"] == eager.model.counters["core_row_loops"]
    for x, y in zip(eager.pool.store.fields.values(), static.pool.store.fields.values()):  # the same KV
        real = eager.pool.null_block * eager.pool.block_size
        for t, u in zip(x.tensors, y.tensors):
            torch.testing.assert_close(u[:real].float(), t[:real].float(), rtol=1e-5, atol=1e-5)


def test_generation_through_the_static_step_equals_eager() -> None:
    """Whole requests through ``generate_many``: warm starts, sampling (drawn on the host), a
    speculative request (its verifies stay eager, its fallback decodes may not), a beam search
    (its beams share blocks copy-on-write: a copied block changes a table row in place), requests
    of different loops (one graph for the mix)."""
    requests = [*batch(3),
                req([7, 8, 9], max_tokens=10, loops=3, warm_start=True, sampling=GREEDY),
                req([7, 8, 9, 10], max_tokens=10, loops=3, warm_start=True, warm_start_from="normed",
                    sampling=SAMPLED),
                req(list(range(30, 44)), max_tokens=8, loops=3, mode="speculative", draft_ahead=2,
                    sampling=GREEDY),
                req(list(range(50, 61)), max_tokens=9, loops=3, mode="beam", num_beams=3)]  # forks: shared blocks
    eager, static = make_engine(graphs=False), make_engine(graphs=True)
    want = [r.tokens for r in eager.generate_many(requests)]
    assert [r.tokens for r in static.generate_many(requests)] == want
    assert static.graphs is not None and static.graphs.replays > 0
    mixed = [*batch(3)[:2], *batch(2)[1:], *batch(4, window=2)[:1],  # with a beam's forks and a warm start
             req(list(range(50, 58)), max_tokens=6, loops=2, mode="beam", num_beams=2),
             req([7, 8, 9], max_tokens=8, loops=1, warm_start=True, sampling=SAMPLED)]
    replays = static.graphs.replays
    assert [r.tokens for r in static.generate_many(mixed)] == [r.tokens for r in eager.generate_many(mixed)]
    assert static.graphs.replays > replays and any(key[2] for key in static.graphs.graphs)
    assert eager.kv_statistics().blocks_used == static.kv_statistics().blocks_used == 0


def test_what_the_graphs_cover() -> None:
    engine = make_engine(graphs=True)
    graphs = engine.graphs
    assert graphs is not None
    assert graphs.buckets == (1, 2, 4, 8)
    three = prefilled(engine, batch(3))
    assert graphs.key(three) == (4, 3, False)
    assert graphs.key(three[:1]) == (1, 3, False)
    assert graphs.key([]) is None
    assert graphs.key(three + prefilled(engine, batch(2))) == (8, 3, True)  # two loop counts: one graph
    assert graphs.key(prefilled(engine, batch(2)) + three[:1]) == (4, 3, True)
    assert graphs.key(three + prefilled(engine, batch(3, window=2))) == (8, 3, False)  # windows: in the tables
    stopping = prefilled(engine, [req([1, 2, 3], max_tokens=4, loops=4, exit=ExitRule.of("kl", 1e9))])
    assert graphs.key(stopping) is None and graphs.key(three[:1] + stopping) is None
    nine = prefilled(engine, batch(3) * 3)
    assert graphs.key(nine[:8]) == (8, 3, False) and graphs.key(nine) is None  # past max_rows
    graphs.failed.add((4, 3, False))  # a key whose capture failed runs eagerly
    assert graphs.key(three) is None
    hmode = make_engine(graphs=True, kv_mode="h-mode")
    assert hmode.graphs is not None and hmode.graphs.key(prefilled(hmode, batch(3))) is None


class NoHostReads(TorchFunctionMode):
    """Raise at any op that reads a tensor's values back to the host or sizes its result by
    them: inside a CUDA graph capture each is an error (a synchronisation)."""

    READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero",
             "masked_select", "unique", "bincount", "repeat_interleave"}

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.READS:
            raise AssertionError(f"{func.__name__} reads a tensor on the host")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("config,kv_mode", [("tiny", "full"), ("ouro-like", "full"), ("tiny", "int4")])
def test_the_static_step_reads_nothing_back(config: str, kv_mode: str) -> None:
    """The step a graph captures, on torch's kernels as on a GPU without CuPy: no host read (the
    check catches one: the sampler's read of the logits)."""
    engine = make_engine(config, graphs=True, cpu_kernels=False, pack_weights=False, kv_mode=kv_mode)
    graphs = engine.graphs
    assert graphs is not None
    seqs = prefilled(engine, [*batch(3), req([4, 5], max_tokens=3, loops=3, warm_start=True, sampling=GREEDY)])
    for s, row in zip(seqs, engine.decode(seqs)):  # fills a warm state
        s.pending = int(row.argmax())
    g = graphs.graphs[(4, 3, False)]
    with torch.inference_mode():
        graphs._fill(g, seqs)
        with NoHostReads():
            logits, state = graphs._step(g)
    assert logits.shape == (4, 1, engine.config.vocab_size) and state.shape == (4, 1, engine.config.hidden)
    mixed = seqs[:3] + prefilled(engine, [req([4, 5, 6], max_tokens=3, loops=2, cache_window=1, sampling=GREEDY)])
    assert graphs.key(mixed) == (4, 3, True)
    g = graphs._open(4, 3, True)
    with torch.inference_mode():
        graphs._fill(g, mixed)
        with NoHostReads():
            graphs._step(g)  # the held rows' selects too
    with NoHostReads(), pytest.raises(AssertionError, match="reads a tensor on the host"):
        logits.argmax(-1).tolist()


def test_the_static_path_makes_no_tensor_off_the_model_device() -> None:
    engine = make_engine(graphs=True)
    requests = [*batch(3), req([7, 8, 9], max_tokens=6, loops=3, warm_start=True, sampling=GREEDY)]
    want = [r.tokens for r in engine.generate_many(requests)]
    engine.graphs = DecodeGraphs.of(engine, capture=False, max_rows=8)  # new buffers, opened under meta
    with default_device_meta():
        assert [r.tokens for r in engine.generate_many(requests)] == want
    assert engine.graphs.replays > 0


def test_cuda_graphs_and_kernels_need_a_cuda_engine() -> None:
    with pytest.raises(RequestError, match="CUDA device"):
        make_engine(graphs=False, cuda_graphs=True)
    with pytest.raises(ConfigError, match="CUDA device"):
        make_engine(graphs=False, cuda_kernels=True)
    for flag in ("cuda_graphs", "cuda_kernels"):
        with pytest.raises(ConfigError, match="--device cuda"):
            Settings(**{flag: True})
        Settings(**{flag: True, "device": "cuda"})  # checked when the engine loads (server.check_device)
    engine = make_engine(graphs=False)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs.of(engine, capture=True)


def test_graphs_made_ahead_touch_only_the_null_block() -> None:
    """``capture_ahead`` runs each bucket's step on a batch of padding only (at startup, before
    any request): every bucket up to the batch limit gets its graph, and the K and V of every
    real block stay as they were."""
    engine = make_engine(graphs=True)
    graphs, pool = engine.graphs, engine.pool
    assert graphs is not None
    before = [t.clone() for t in pool.store.fields["k"].tensors]
    assert graphs.capture_ahead(3, rows=3) == 3  # buckets 1, 2 and 4 (three rows run in 4)
    assert graphs.capture_ahead(3, rows=3, mixed=True) == 3  # and for rows some of which run fewer loops
    assert sorted(graphs.graphs) == [(1, 3, False), (1, 3, True), (2, 3, False), (2, 3, True), (4, 3, False),
                                     (4, 3, True)]
    after = pool.store.fields["k"].tensors
    real = pool.null_block * pool.block_size  # the pool's rows before the null block
    assert all(torch.equal(a[:real], b[:real]) for a, b in zip(after, before))
    assert not all(torch.equal(a[real:], b[real:]) for a, b in zip(after, before))  # the padding wrote there
    seqs = prefilled(engine, batch(3))
    replays = graphs.replays
    for s, row in zip(seqs, engine.decode(seqs)):
        s.pending = int(row.argmax())
    assert graphs.replays == replays + 1 and len(graphs.graphs) == 6  # the graph made ahead served
    engine.decode(seqs[:2] + prefilled(engine, batch(2))[:1])
    assert graphs.replays == replays + 2 and len(graphs.graphs) == 6  # and the mixed one
