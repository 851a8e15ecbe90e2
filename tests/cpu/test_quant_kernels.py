"""The quantised products (tinyloop/cpu/qmatmul.c) against a float64 reference, on every path the
CPU's build has (AVX-512 VNNI, AVX2, portable C), forced in turn: odd sizes, short last panels,
tails of 4 inputs, row counts past every block size, one and two threads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tinyloop.cpu import kernels
from tinyloop.model.quant import QuantWeight

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels")
pytestmark = [needs_kernel, pytest.mark.usefixtures("one_torch_thread")]

ROWS = [1, 2, 3, 5, 8, 9, 17, 40]
SHAPES_Q8 = [(16, 4), (21, 36), (72, 100), (130, 262)]  # (N, K): short panels, K % 4 and K % 32 tails
SHAPES_Q4 = [(16, 32, 32), (21, 64, 32), (72, 128, 64), (130, 288, 96)]  # (N, K, group)


def paths() -> list[str]:
    """The paths this build has (all of them where the kernels cannot be built: each then skips)."""
    if not kernels.available():
        return list(kernels.QUANT_ISAS)
    return list(kernels.QUANT_ISAS[:kernels.QUANT_ISAS.index(kernels.best_quant_isa()) + 1])


@pytest.fixture(params=paths())
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    assert kernels.set_quant_isa(request.param) == request.param
    try:
        yield request.param
    finally:
        kernels.set_quant_isa(None)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    kernels.set_threads(request.param)
    try:
        yield request.param
    finally:
        kernels.set_threads(1)


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply: x quantised per block of 32 (``quantize_activations``), in float64."""
    xq, d, _ = kernels.quantize_activations(x)
    scale = d.double().repeat_interleave(kernels.QBLOCK, 1)[:, :xq.shape[1]]
    return (xq.double() * scale)[:, :x.shape[1]]


def assert_matches(y: torch.Tensor, want: torch.Tensor) -> None:
    assert y.dtype == torch.float32 and y.shape == want.shape
    err = (y.double() - want).abs().max().item()
    assert err <= 2e-6 * max(want.abs().max().item(), 1.0), err


def test_activations_are_quantised_per_block_of_32_as_q8_0_rounds() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 70, generator=gen) * torch.tensor([1.0, 100.0, 1e-3])[:, None]
    x[1, 32:64] = 0  # an all-zero block: scale 0, codes 0
    x[2, 5] = 2.5 * (x[2, :32].abs().max() / 127)  # a tie, rounded to even
    xq, d, sums = kernels.quantize_activations(x)
    assert xq.shape == (3, 72) and d.shape == sums.shape == (3, 3)
    blocks = torch.nn.functional.pad(x, (0, 2)).view(3, -1)
    for b in range(3):
        part = blocks[:, 32 * b:32 * b + 32]
        scale = part.abs().amax(1) / 127
        codes = torch.where(scale[:, None] > 0, torch.round(part / scale[:, None]), 0).to(torch.int8)
        assert torch.equal(d[:, b], scale)
        assert torch.equal(xq[:, 32 * b:32 * b + 32], codes)
        assert torch.equal(sums[:, b], codes.int().sum(1))
    assert xq[:, 70:].eq(0).all() and xq.abs().max() <= 127


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES_Q8)
def test_int8_products_equal_the_dequantised_weight_times_the_dequantised_activations(
        path: str, threads: int, rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 31 + n + k)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales, bias = torch.rand(n, generator=gen) * 0.01, torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    panels = kernels.pack_q8(codes)
    weight = codes.double() * scales.double()[:, None]
    want = dequantized_activations(x) @ weight.t()
    assert_matches(kernels.matmul_q8(x, panels, n, scales, bias), want + bias.double())
    assert_matches(kernels.matmul_q8(x, panels, n, scales, None), want)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k", "group"), SHAPES_Q4)
def test_grouped_int8_products_equal_the_dequantised_weight_times_the_dequantised_activations(
        path: str, threads: int, rows: int, n: int, k: int, group: int) -> None:
    """A scale per group of inputs (``pack_q8(codes, scales, group)``): the fp16 scales in the
    panels, each group's sums times its own."""
    gen = torch.Generator().manual_seed(rows * 13 + n + k)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-4
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    panels = kernels.pack_q8(codes, scales, group)
    scales_bytes = -(-(k // group) * 32 // 64) * 64  # a panel's 16 fp16 scales a group, to a cache line
    assert panels.numel() == -(-n // 16) * (scales_bytes + k * 16)  # 8.5 bits a weight at group 32
    weight = codes.double() * scales.half().double().repeat_interleave(group, 1)
    want = dequantized_activations(x) @ weight.t()
    assert_matches(kernels.matmul_q8(x, panels, n, None, bias, group=group), want + bias.double())
    assert_matches(kernels.matmul_q8(x, panels, n, None, None, group=group), want)
    two = kernels.matmul_q8(x, panels, n, None, None, 2, group)  # two-term activations: near x @ W^T
    exact = x.double() @ weight.t()
    assert ((two.double() - exact).abs() <= two_term_bound(x, weight) + 2e-6 * exact.abs().max()).all()


def test_grouped_int8_panels_refuse_what_they_cannot_lay_out() -> None:
    codes = torch.zeros(16, 64, dtype=torch.int8)
    for group, scales in [(48, torch.ones(16, 1)), (128, torch.ones(16, 0)), (32, torch.ones(16, 3)),
                          (32, None), (-32, torch.ones(16, 2))]:
        with pytest.raises(ValueError, match="grouped int8 panels"):
            kernels.pack_q8(codes, scales, group)
    with pytest.raises(ValueError, match="a scale per output"):
        kernels.matmul_q8(torch.zeros(1, 64), kernels.pack_q8(codes), 16, None, None)


def int4_weight(n: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales, zeros = torch.rand(k // group, n, generator=gen) * 0.1, torch.randn(k // group, n, generator=gen) * 0.1
    # the panels hold scale and shift (zero - 8 scale) as fp16
    scale16, shift16 = scales.half().double(), (zeros - 8 * scales).half().double()
    weight = codes.double() * scale16.t().repeat_interleave(group, 1) + shift16.t().repeat_interleave(group, 1)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales, zeros, weight


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k", "group"), SHAPES_Q4)
def test_int4_products_equal_the_dequantised_weight_times_the_dequantised_activations(
        path: str, threads: int, rows: int, n: int, k: int, group: int) -> None:
    gen = torch.Generator().manual_seed(rows * 17 + n + k)
    packed, scales, zeros, weight = int4_weight(n, k, group, gen)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    panels = kernels.pack_q4(packed, scales, zeros, group)
    assert panels.numel() == -(-n // 16) * (k // group) * (group * 8 + 64)  # 5 bits a weight at group 32
    want = dequantized_activations(x) @ weight.t()
    assert_matches(kernels.matmul_q4(x, panels, n, group, bias), want + bias.double())
    assert_matches(kernels.matmul_q4(x, panels, n, group, None), want)


def two_term_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What two-term activations may be off by, per output: each input within half the second
    term's step, max|block| / (127 * 254) (the residual is within half the first's), times |W|."""
    blocks = torch.nn.functional.pad(x.double().abs(), (0, -x.shape[1] % kernels.QBLOCK))
    peak = blocks.view(x.shape[0], -1, kernels.QBLOCK).amax(-1).repeat_interleave(kernels.QBLOCK, 1)
    return (peak[:, :x.shape[1]] / (2 * 127 * 254)) @ weight.abs().t()


@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("bits", [8, 4])
def test_two_term_activations_take_the_products_near_the_float_activations(
        path: str, threads: int, rows: int, bits: int) -> None:
    """``terms=2`` adds the residual's codes as rows of their own: each output within the second
    term's rounding of x @ W^T (about 250 times nearer than one term), the bias added once."""
    gen = torch.Generator().manual_seed(rows * 5 + bits)
    n, k, group = 70, 288, 96
    x, bias = torch.randn(rows, k, generator=gen) * 3, torch.randn(n, generator=gen)
    if bits == 8:
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scales = torch.rand(n, generator=gen) * 0.01
        weight = codes.double() * scales.double()[:, None]
        panels = kernels.pack_q8(codes)
        def product(terms: int, b: torch.Tensor | None) -> torch.Tensor:
            return kernels.matmul_q8(x, panels, n, scales, b, terms)
    else:
        packed, scales4, zeros, weight = int4_weight(n, k, group, gen)
        panels = kernels.pack_q4(packed, scales4, zeros, group)
        def product(terms: int, b: torch.Tensor | None) -> torch.Tensor:
            return kernels.matmul_q4(x, panels, n, group, b, terms)
    exact = x.double() @ weight.t()
    one, two = product(1, None), product(2, None)
    bound = two_term_bound(x, weight) + 2e-6 * exact.abs().max()
    assert ((two.double() - exact).abs() <= bound).all()
    assert (one.double() - exact).abs().max() > 20 * (two.double() - exact).abs().max()
    assert_matches(product(2, bias), two.double() + bias.double())


def test_two_term_activations_keep_a_bad_rows_nan_in_its_row_and_refuse_other_counts() -> None:
    gen = torch.Generator().manual_seed(8)
    codes = torch.randint(-127, 128, (20, 64), generator=gen, dtype=torch.int8)
    panels, scales = kernels.pack_q8(codes), torch.rand(20, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    x[1, 3] = float("inf")
    y = kernels.matmul_q8(x, panels, 20, scales, None, 2)
    assert y[1].isnan().all() and torch.isfinite(y[[0, 2]]).all()
    for terms in (0, 3):
        with pytest.raises(ValueError, match="1 or 2 int8 terms"):
            kernels.matmul_q8(x, panels, 20, scales, None, terms)


def test_a_product_split_among_threads_equals_it_on_one() -> None:
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (1000, 512), generator=gen, dtype=torch.int8)  # 512 kB: split
    scales, x = torch.rand(1000, generator=gen), torch.randn(3, 512, generator=gen)
    panels = kernels.pack_q8(codes)
    alone = kernels.matmul_q8(x, panels, 1000, scales, None)
    kernels.set_threads(2)
    try:
        before = kernels.task_counts()[0]
        shared = kernels.matmul_q8(x, panels, 1000, scales, None)
        assert kernels.task_counts()[0] > before  # it was published to the helpers
    finally:
        kernels.set_threads(1)
    assert torch.equal(alone, shared)  # each output's sums in the same order whichever thread runs it


def test_every_path_gives_the_same_products_to_float32_rounding() -> None:
    gen = torch.Generator().manual_seed(4)
    packed, scales, zeros, _ = int4_weight(40, 96, 32, gen)
    codes8 = torch.randint(-127, 128, (40, 96), generator=gen, dtype=torch.int8)
    x, s8 = torch.randn(5, 96, generator=gen), torch.rand(40, generator=gen)
    p4, p8 = kernels.pack_q4(packed, scales, zeros, 32), kernels.pack_q8(codes8)
    outs = []
    try:
        for name in paths():
            kernels.set_quant_isa(name)
            outs.append((kernels.matmul_q4(x, p4, 40, 32, None), kernels.matmul_q8(x, p8, 40, s8, None)))
    finally:
        kernels.set_quant_isa(None)
    for q4, q8 in outs[1:]:
        torch.testing.assert_close(q4, outs[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(q8, outs[0][1], rtol=1e-5, atol=1e-5)


def test_a_path_the_build_lacks_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="not built here"):
        kernels.set_quant_isa("neon")
    assert kernels.quant_isa() == kernels.best_quant_isa()


def test_layouts_the_kernels_cannot_read_are_refused() -> None:
    codes, params = torch.zeros(16, 24, dtype=torch.uint8), torch.zeros(3, 16)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.pack_q4(codes, params[:3], params[:3], 16)  # groups of 16 inputs
    with pytest.raises(ValueError, match="uint8 codes"):
        kernels.pack_q4(torch.zeros(16, 16, dtype=torch.int8), params[:1], params[:1], 32)
    with pytest.raises(ValueError, match="int8 codes"):
        kernels.pack_q8(torch.zeros(16, 24))


@pytest.mark.parametrize("mode", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_a_quantised_layer_runs_on_the_kernels_once_it_has_panels(mode: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    quant = QuantWeight(torch.randn(80, 96, generator=gen) * 0.05, mode)  # (torch packs int4 by 16 rows)
    x, bias = torch.randn(2, rows, 96, generator=gen), torch.randn(80, generator=gen)
    exact = torch.nn.functional.linear(x, quant.dequantize(), bias)
    torch_path = quant.linear(x, bias)  # torch's kernel: x rounded to bfloat16
    quant.set_panels(True)
    assert quant.panels is not None and quant.panels.dtype == (torch.bfloat16 if mode == "bf16" else torch.uint8)
    ours = quant.linear(x, bias)
    assert ours.shape == exact.shape
    # the weights' rounding is the same on both: only the activations' (8 bits or bfloat16, against
    # torch's bfloat16; bf16: torch also rounds the result) differs
    assert (ours - exact).abs().max() <= 2 * (torch_path - exact).abs().max() + 1e-3
    flat = x.reshape(-1, 96)
    used = flat.bfloat16().double() if mode == "bf16" else dequantized_activations(flat)
    want = used @ quant.dequantize().double().t() + bias.double()
    tol = 2e-3 if mode == "int4" else 1e-5  # int4: the panels' scales are fp16, dequantize's float32
    torch.testing.assert_close(ours.reshape(-1, 80).double(), want, rtol=tol, atol=tol)
    quant.set_panels(False)
    torch.testing.assert_close(quant.linear(x, bias), torch_path)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(16, 2), (21, 37), (72, 100), (130, 262)])  # odd K: a padded pair
def test_bf16_products_equal_the_bf16_activations_times_the_bf16_weight(
        path: str, threads: int, rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 13 + n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    panels = kernels.pack_bf16(weight)
    want = x.bfloat16().double() @ weight.double().t()  # x rounded to bfloat16 as torch rounds it
    assert_matches(kernels.matmul_bf16(x, panels, n, bias), want + bias.double())
    assert_matches(kernels.matmul_bf16(x, panels, n, None), want)


@pytest.fixture(params=[True, False], ids=["amx", "avx512"])
def amx(request: pytest.FixtureRequest) -> Iterator[bool]:
    if request.param and not kernels.bf16_amx():
        pytest.skip("no AMX-BF16 on this CPU (or Linux refused its tile state)")
    kernels.set_bf16_amx(request.param)
    try:
        yield request.param
    finally:
        kernels.set_bf16_amx(True)


@pytest.mark.parametrize("rows", [16, 17, 31, 33, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (21, 64), (40, 96), (130, 288)])  # K % 32 == 0: AMX's tiles
def test_a_prefills_bf16_products_on_amx_tiles_equal_the_reference(amx: bool, threads: int, rows: int, n: int,
                                                                   k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    panels = kernels.pack_bf16(weight)
    want = x.bfloat16().double() @ weight.double().t()
    assert_matches(kernels.matmul_bf16(x, panels, n, bias), want + bias.double())
    x[rows // 2, k // 3] = float("nan")  # one row's NaN stays in its row (the padding rows' tiles too)
    y = kernels.matmul_bf16(x, panels, n, None)
    assert y[rows // 2].isnan().all()
    assert torch.isfinite(y[:rows // 2]).all() and torch.isfinite(y[rows // 2 + 1:]).all()


def test_bf16_panels_refuse_another_dtype() -> None:
    with pytest.raises(ValueError, match="bfloat16 weight"):
        kernels.pack_bf16(torch.zeros(16, 8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_activation_makes_its_rows_outputs_nan_and_no_others(path: str, bad: float) -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 64, generator=gen)
    x[1, 40] = bad  # row 1's second block
    packed, scales, zeros, _ = int4_weight(20, 64, 32, gen)
    codes8 = torch.randint(-127, 128, (20, 64), generator=gen, dtype=torch.int8)
    for y in (kernels.matmul_q8(x, kernels.pack_q8(codes8), 20, torch.rand(20, generator=gen), None),
              kernels.matmul_q4(x, kernels.pack_q4(packed, scales, zeros, 32), 20, 32, None)):
        assert y[1].isnan().all()
        assert torch.isfinite(y[[0, 2]]).all()
    xq, d, _ = kernels.quantize_activations(x)
    assert d[1, 1].isnan() and (xq[1, 32:] == 0).all() and torch.isfinite(d[[0, 2]]).all()
