"""On an NVIDIA device with CuPy: every kernel against its torch reference, and the torch engine
on CUDA against the CPU. Skipped (cleanly, at collection) anywhere else."""

from __future__ import annotations

import pytest
import torch

from tinyloop.cuda import gpu_available, parity

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", parity.cases(), ids=lambda c: c.name)
def test_kernel_matches_its_reference(case: parity.Case, dtype: torch.dtype) -> None:
    result = parity.run_case(case, torch.device("cuda"), dtype)
    assert result.ok, result


def test_engine_on_cuda_generates_the_cpu_tokens() -> None:
    from tests.engine.test_device import make_engine
    from tests.engine.test_engine import req
    from tinyloop.engine.engine import Engine
    from tinyloop.requests import SamplingParams

    cpu = make_engine("full")
    gpu = Engine(make_engine("full").model.to("cuda"), cpu.tokenizer, max_seq_len=128, block_size=8)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    reqs = [req(list(range(20, 30)), max_tokens=8, loops=n, sampling=greedy) for n in (1, 3)]
    reqs.append(req(list(range(20, 30)), max_tokens=8, mode="speculative", loops=3, sampling=greedy))
    assert [r.tokens for r in gpu.generate_many(reqs)] == [r.tokens for r in cpu.generate_many(reqs)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_replicas_step_on_streams_of_their_own_in_parallel_threads(graphs: bool) -> None:
    """Two engines on one GPU, each in its own thread on its own stream (``device_stream.py``):
    every forward runs on its engine's stream, and both give the CPU's tokens; with CUDA graphs
    each captures its own while the other steps (one capture at a time in the process)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.engine.test_device import make_engine
    from tests.engine.test_engine import req
    from tinyloop.engine.engine import Engine
    from tinyloop.requests import SamplingParams

    cpu = make_engine("full")
    first = Engine(make_engine("full").model.to("cuda"), cpu.tokenizer, max_seq_len=128, block_size=8,
                   cuda_graphs=graphs)
    twin = first.replica()
    default = torch.cuda.default_stream()
    assert first.stream is not None and twin.stream is not None
    assert len({first.stream, twin.stream, default}) == 3
    seen: list[int] = []
    inner = first.model.forward

    def forward(*args: object, **kwargs: object) -> object:
        seen.append(torch.cuda.current_stream().cuda_stream)
        return inner(*args, **kwargs)

    first.model.forward = forward  # type: ignore[method-assign]  # the replicas share the model
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    reqs = [req(list(range(20, 30 + n)), max_tokens=12, loops=3, sampling=greedy) for n in range(3)]
    want = [r.tokens for r in cpu.generate_many(reqs)]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda e: [r.tokens for r in e.generate_many(reqs)], [first, twin]))
    assert got == [want, want]
    assert set(seen) == {first.stream.cuda_stream, twin.stream.cuda_stream}
    if graphs:
        assert first.graphs is not None and twin.graphs is not None and first.graphs is not twin.graphs
        assert first.graphs.replays > 0 and twin.graphs.replays > 0 and not first.graphs.failed | twin.graphs.failed
    logits = first.prefill(first.start(reqs[0]))  # returned to the caller's stream: readable at once
    assert torch.cuda.current_stream() == default and torch.isfinite(logits).all()


def test_engine_on_the_cuda_backend_generates_the_cpu_tokens() -> None:
    """The kernels wired into the model (RMSNorm, RoPE, paged decode attention) in a whole engine."""
    from tests.engine.test_device import make_engine
    from tests.engine.test_engine import req
    from tinyloop.cuda.backend import CudaBackend
    from tinyloop.engine.engine import Engine
    from tinyloop.requests import SamplingParams

    cpu = make_engine("full")
    gpu = Engine(make_engine("full").model.to("cuda"), cpu.tokenizer, max_seq_len=128, block_size=8)
    gpu.model.use_backend(CudaBackend())
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    reqs = [req(list(range(20, 20 + n)), max_tokens=8, loops=loops, sampling=greedy)
            for n, loops in ((10, 1), (3, 3), (17, 2))]
    assert [r.tokens for r in gpu.generate_many(reqs)] == [r.tokens for r in cpu.generate_many(reqs)]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_decode_graphs_replay_the_eager_step(kernels: bool) -> None:
    """Decode captured as CUDA graphs (``engine/graphs.py``): the CPU's tokens (rows of one loop
    count, and of several in one graph), the eager GPU step's logits, one graph per bucket
    captured once and replayed."""
    from tests.engine.test_device import make_engine
    from tests.engine.test_engine import req
    from tinyloop.cuda.backend import CudaBackend
    from tinyloop.engine.engine import Engine
    from tinyloop.requests import SamplingParams

    cpu = make_engine("full")
    eager = Engine(make_engine("full").model.to("cuda"), cpu.tokenizer, max_seq_len=128, block_size=8)
    graphed = Engine(make_engine("full").model.to("cuda"), cpu.tokenizer, max_seq_len=128, block_size=8,
                     cuda_graphs=True)
    if kernels:
        eager.model.use_backend(CudaBackend())
        graphed.model.use_backend(CudaBackend())
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    reqs = [req(list(range(20, 20 + n)), max_tokens=12, loops=3, sampling=greedy) for n in (10, 3, 17)]
    reqs.append(req([5, 6, 7], max_tokens=12, loops=3, warm_start=True, sampling=greedy))
    want = [r.tokens for r in cpu.generate_many(reqs)]
    assert [r.tokens for r in graphed.generate_many(reqs)] == want
    assert graphed.graphs is not None and graphed.graphs.replays > 0
    mixed = [req(list(range(30, 30 + n)), max_tokens=10, loops=loops, cache_window=window, sampling=greedy)
             for n, loops, window in ((5, 3, None), (9, 1, None), (4, 2, 1), (12, 3, 2))]
    assert [r.tokens for r in graphed.generate_many(mixed)] == [r.tokens for r in cpu.generate_many(mixed)]
    assert any(mixed for _, _, mixed in graphed.graphs.graphs)  # one graph for rows of 1 to 3 loops
    assert all(g.graph is not None for g in graphed.graphs.graphs.values()) and not graphed.graphs.failed
    seqs_e, seqs_g = ([e.start(r) for r in reqs[:3]] for e in (eager, graphed))
    for e, seqs in ((eager, seqs_e), (graphed, seqs_g)):
        for s in seqs:
            s.pending = int(e.prefill(s).argmax())
    for _ in range(5):
        a, b = eager.decode(seqs_e), graphed.decode(seqs_g)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        for sa, sb, row in zip(seqs_e, seqs_g, a):
            sa.pending = sb.pending = int(row.argmax())


def test_sampling_cuda_logits_equals_the_host() -> None:
    """``sample_batch`` on CUDA logits (every row sampled on the device with its logprobs, one
    transfer) picks what it picks from the same logits on the host (up to the rounding of the
    device's reductions: none at these margins), with the same logprobs to 1e-4; a row of NaN
    comes back None on both."""
    from tinyloop.engine.sampling import make_generator, sample_batch
    from tinyloop.requests import SamplingParams

    logits = torch.randn(8, 4096, generator=torch.Generator().manual_seed(0)) * 3
    logits[7, 100] = float("nan")  # a broken row beside a top-p row: None, and no device-side assert
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=1.0, top_k=20, seed=2), SamplingParams(temperature=0),
              SamplingParams(temperature=0.9, seed=3, top_logprobs=5), SamplingParams(temperature=0.7, seed=4)]
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        host, dev = (sample_batch(t, params, [make_generator(p.seed) for p in params], [[1, 2, 3]] * 8, [[4]] * 8)
                     for t in (x, x.cuda()))
        assert host[7] is None and dev[7] is None
        assert [r.token_id for r in dev[:7] if r] == [r.token_id for r in host[:7] if r]
        for h, d in zip(host[:7], dev[:7]):
            assert h is not None and d is not None and (h.logprob is None) == (d.logprob is None)
            if h.logprob is not None and d.logprob is not None:
                assert d.logprob.logprob == pytest.approx(h.logprob.logprob, abs=1e-4)
                assert [i for i, _ in d.logprob.top] == [i for i, _ in h.logprob.top]
                assert [v for _, v in d.logprob.top] == pytest.approx([v for _, v in h.logprob.top], abs=1e-4)
        assert len(dev[6].logprob.top) == 5  # type: ignore[union-attr]
        torch.cuda.synchronize()  # the context is still usable
