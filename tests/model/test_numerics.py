"""Reference numerics a converted checkpoint selects (``ModelConfig.rope_tables``,
``rope_compute``, ``norm_order``): each computes what the reference code computes, and differs
from TinyLoop's own default where the issue says it does."""

from __future__ import annotations

import torch

from tinyloop.model.backend import TORCH
from tinyloop.model.layers import RMSNorm, Rope


def reference_tables(head_dim: int, positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin as the references build them: everything in float32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def test_float32_tables_are_the_references_and_float64_ones_drift_at_long_positions() -> None:
    cos, sin = reference_tables(128, 4097, 1e6)
    ref32 = Rope(128, 4097, 1e6, "half", tables="float32")
    assert torch.equal(ref32.cos, cos) and torch.equal(ref32.sin, sin)
    own = Rope(128, 4097, 1e6, "half")  # float64 tables, rounded to float32
    assert (own.cos[4096] - cos[4096]).abs().max().item() > 1e-5  # float32 angles lose digits far out
    assert (own.cos[:8] - cos[:8]).abs().max().item() < 1e-6  # the same where both are exact


def test_rotating_in_float32_is_rotating_the_float32_value_then_casting() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 16, generator=gen).to(torch.bfloat16)  # [R, H, T, D]
    rope = Rope(16, 8, 50000.0, "interleaved", tables="float32", compute="float32")
    cos, sin = rope.tables(torch.arange(5)[None])
    expected = TORCH.rope(x.float(), cos, sin, "interleaved").to(torch.bfloat16)
    assert torch.equal(rope.apply(x, cos, sin), expected)
    in_bf16 = Rope(16, 8, 50000.0, "interleaved", tables="float32").apply(x, cos, sin)
    assert not torch.equal(in_bf16, expected)  # rotating in bf16 rounds differently


def test_cast_then_weight_is_the_references_rms_norm() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    norm = RMSNorm(64, 1e-6, cast_first=True)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
        got = norm(x)
        xf = x.float()
        expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) \
            * norm.weight.to(torch.bfloat16)
        ours = RMSNorm(64, 1e-6)
        ours.weight.copy_(norm.weight)
        assert torch.equal(got, expected)
        assert not torch.equal(ours(x), expected)  # the weight applied in float32 rounds differently
