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
