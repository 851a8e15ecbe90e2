"""NVFP4 and MXFP8 expert weights (``tinyloop.convert.microscale``): dequantised as the formats
define them, checked against values written here from those definitions and, where transformers
is installed, against its Inkling-2 loop loader's own dequantisation; malformed tensors refused
by name."""

from __future__ import annotations

import math

import pytest
import torch

from tinyloop.convert.microscale import E2M1_VALUES, dequantize_mxfp8, dequantize_nvfp4
from tinyloop.errors import ArtifactError

E4M3_MAX = 448.0
E2M1_MAX = 6.0


def nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[E, R, C]`` in NVFP4 (the format's recipe): the per-expert factor
    ``amax / (6 * 448)``, an E4M3 scale per 16 values, E2M1 codes rounded to nearest."""
    experts, rows, columns = weight.shape
    amax = weight.abs().amax(dim=(1, 2))  # [E]
    denominator = torch.full((experts,), E2M1_MAX * E4M3_MAX)
    factor = amax / denominator
    blocks = weight.view(experts, rows, columns // 16, 16)
    scale = (blocks.abs().amax(-1) / E2M1_MAX / factor[:, None, None]).to(torch.float8_e4m3fn)
    step = scale.float()[..., None] * factor[:, None, None, None]
    grid = torch.tensor(E2M1_VALUES)
    codes = (blocks / step.clamp_min(1e-30))[..., None].sub(grid).abs().argmin(-1)  # nearest code
    codes = codes.view(experts, rows, columns // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return packed, scale, amax, denominator


def mxfp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in MXFP8 (OCP MX): a shared power of two per 32 values, so that the block's
    largest magnitude lands in E4M3's top binade (emax 8), then E4M3 values."""
    experts, rows, columns = weight.shape
    blocks = weight.view(experts, rows, columns // 32, 32)
    exponent = torch.floor(torch.log2(blocks.abs().amax(-1).clamp_min(2.0 ** -120))) - 8
    scaled = (blocks / torch.exp2(exponent)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)  # the spec saturates
    values = scaled.to(torch.float8_e4m3fn).view(experts, rows, columns)
    return values, (exponent + 127).to(torch.uint8)


def test_an_nvfp4_byte_holds_the_even_value_in_its_low_nibble() -> None:
    codes = torch.tensor([[[0x21, 0xF7] + [0] * 6]], dtype=torch.uint8)  # 16 values: 0.5, 1, 6, -6, 0...
    scale = torch.full((1, 1, 1), 2.0).to(torch.float8_e4m3fn)
    out = dequantize_nvfp4("w", codes, scale, torch.tensor([3.0]), torch.tensor([1.5]))
    assert out[0, 0, :4].tolist() == [0.5 * 4, 1.0 * 4, 6.0 * 4, -6.0 * 4] and out[0, 0, 4:].abs().sum() == 0


@pytest.mark.parametrize(("experts", "rows", "columns"), [(3, 5, 32), (9, 2, 64)])
def test_nvfp4_round_trips_within_the_formats_step(experts: int, rows: int, columns: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(experts, rows, columns)
    packed, scale, amax, denominator = nvfp4(weight)
    out = dequantize_nvfp4("w", packed, scale, amax, denominator)
    # each value is on its block's E2M1 grid: off by at most half the widest step (2 of 6) of the block's scale
    step = (scale.float() * (amax / denominator)[:, None, None]).repeat_interleave(16, -1)
    assert ((out - weight).abs() <= step * 1.0 + 1e-6).all()
    assert (out - weight).abs().mean() < 0.1 * weight.abs().mean()
    manual = torch.tensor([E2M1_VALUES[int(packed[1, 1, 3]) & 0xF], E2M1_VALUES[int(packed[1, 1, 3]) >> 4]])
    assert torch.equal(out[1, 1, 6:8], manual * float(scale[1, 1, 0].float()) * float(amax[1] / denominator[1]))


@pytest.mark.parametrize(("experts", "rows", "columns"), [(2, 3, 32), (10, 4, 96)])
def test_mxfp8_round_trips_within_the_formats_step(experts: int, rows: int, columns: int) -> None:
    torch.manual_seed(1)
    weight = torch.randn(experts, rows, columns) * 3
    values, scale = mxfp8(weight)
    out = dequantize_mxfp8("w", values, scale)
    assert torch.equal(out, (values.float().view(experts, rows, -1, 32)
                             * torch.exp2(scale.float() - 127)[..., None]).view_as(out))
    # 3 mantissa bits: half a step of the value's binade (2^-4 of it), of E4M3's subnormals (2^-10 under the
    # block's power), or a block maximum saturated from up to 511 to 448 (under 2^-3 of it)
    floor = torch.exp2(scale.float() - 127 - 10).repeat_interleave(32, -1)
    error = (out - weight).abs()
    assert (error <= weight.abs() * 2.0 ** -3 + floor).all()
    assert (error <= weight.abs() * 2.0 ** -4 + floor).float().mean() > 0.9


def test_dequantisation_equals_the_reference_loaders() -> None:
    loading = pytest.importorskip("transformers.core_model_loading")
    op = getattr(loading, "Inkling2LoopDequantizeExperts", None)
    if op is None:
        pytest.skip("this transformers has no Inkling-2 loop loader")
    torch.manual_seed(2)
    weight = torch.randn(3, 4, 64)
    packed, scale, amax, denominator = nvfp4(weight)
    names = ["w", "w_scale", "w_amax", "w_den"]
    ref = op().convert(dict(zip(names, (packed, scale, amax, denominator))), names, ["out"],
                       full_layer_name=None)["out"]
    assert torch.equal(dequantize_nvfp4("w", packed, scale, amax, denominator).to(ref.dtype), ref)
    values, exps = mxfp8(weight)
    names = ["w", "w_scale"]
    ref = op().convert({"w": values, "w_scale": exps}, [*names, "a", "d"], ["out"], full_layer_name=None)["out"]
    assert torch.equal(dequantize_mxfp8("w", values, exps).to(ref.dtype), ref)


def test_malformed_tensors_are_refused_by_name() -> None:
    weight = torch.randn(2, 2, 32)
    packed, scale, amax, denominator = nvfp4(weight)
    with pytest.raises(ArtifactError, match="w_scale has shape"):
        dequantize_nvfp4("w", packed, scale[:, :, :1], amax, denominator)
    with pytest.raises(ArtifactError, match="w has dtype torch.int8"):
        dequantize_nvfp4("w", packed.to(torch.int8), scale, amax, denominator)
    with pytest.raises(ArtifactError, match="w_amax is not finite"):
        dequantize_nvfp4("w", packed, scale, torch.tensor([math.inf, 1.0]), denominator)
    with pytest.raises(ArtifactError, match="one value per expert"):
        dequantize_nvfp4("w", packed, scale, torch.ones(3), denominator)
    values, exps = mxfp8(weight)
    with pytest.raises(ArtifactError, match="E8M0 NaN"):
        dequantize_mxfp8("w", values, torch.full_like(exps, 255))
    with pytest.raises(ArtifactError, match="not a multiple of 32"):
        dequantize_mxfp8("w", values[..., :16], exps[..., :1])
    nan = values.clone()
    nan.view(torch.uint8)[0, 0, 0] = 0x7F  # E4M3's NaN
    with pytest.raises(ArtifactError, match="not finite"):
        dequantize_mxfp8("w", nan, exps)
