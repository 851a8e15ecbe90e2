"""The kernels' torch references against the model they stand for, on the CPU.

A kernel is checked against its reference on a GPU (``bench/gpu_check.py``, the ``gpu`` tests);
these tests pin the references to the model: ``Block``'s norms and adds in every style,
``Attention``'s bias and RoPE, ``MLP``'s activation, and ``PagedContext``'s gather and masks
(slots, GQA, cache-window slots, exit gaps) in the form the paged kernel reads them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tinyloop.cuda import reference as ref
from tinyloop.model.config import ModelConfig
from tinyloop.model.context import PagedContext
from tinyloop.model.kvcache import KVPool, SeqKV
from tinyloop.model.layers import MLP, Block, rope_for

CFG = ModelConfig(vocab_size=64, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                  n_prelude=1, n_core=2, n_coda=1, default_loops=3, max_loops=8, max_position=256)


class Fixed(nn.Module):
    """A stand-in sublayer: ``f(x) = x * scale + shift`` (attention takes and ignores the rest)."""

    def __init__(self, scale: float, shift: torch.Tensor) -> None:
        super().__init__()
        self.scale, self.shift = scale, shift

    def forward(self, x: torch.Tensor, *rest: object) -> torch.Tensor:
        return x * self.scale + self.shift


@pytest.mark.parametrize("style", ["pre_ln", "peri_ln", "sandwich", "post_ln"])
@pytest.mark.parametrize("order", ["weight_in_float32", "cast_then_weight"])
def test_residual_rmsnorm_composes_into_block(style: str, order: str) -> None:
    cfg = CFG.replace(block_style=style, norm_order=order)
    torch.manual_seed(0)
    block = Block(cfg).to(torch.bfloat16)
    for p in block.parameters():
        nn.init.normal_(p, 1.0, 0.2)
    h = cfg.hidden
    attn, mlp = Fixed(-1.5, torch.randn(h).bfloat16()), Fixed(0.7, torch.randn(h).bfloat16())
    block.attn, block.mlp = attn, mlp  # type: ignore[assignment]
    x = torch.randn(3, 5, h).bfloat16()
    want = block(x, None, None, None, torch.zeros(3, dtype=torch.long))  # type: ignore[arg-type]

    eps, cf = cfg.norm_eps, order == "cast_then_weight"
    w = {n: getattr(block, n).weight for n in ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm")
         if hasattr(block, n)}
    attn_in = x if style == "post_ln" else ref.rms_norm_ref(x, w["attn_norm"], eps, cf)
    r1, y1 = ref.residual_rmsnorm_ref(x, attn(attn_in), w.get("attn_post_norm"), w.get("mlp_norm"), style, eps, cf)
    mlp_in = r1 if y1 is None else y1
    r2, _ = ref.residual_rmsnorm_ref(r1, mlp(mlp_in), w.get("mlp_post_norm"), None, style, eps, cf)
    assert torch.equal(r2, want)


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("compute", ["input", "float32"])
def test_rope_ref_is_attention_bias_then_rope(style: str, compute: str) -> None:
    cfg = CFG.replace(rope_style=style, rope_compute=compute)
    rope = rope_for(cfg)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, cfg.heads, cfg.head_dim, generator=g).bfloat16()  # [N, H, D] token-major
    k = torch.randn(6, cfg.kv_heads, cfg.head_dim, generator=g).bfloat16()
    qb, kb = torch.randn(cfg.heads, cfg.head_dim).bfloat16(), torch.randn(cfg.kv_heads, cfg.head_dim).bfloat16()
    pos = torch.tensor([0, 3, 17, 100, 101, 255])
    cos, sin = rope.tables(pos)  # [N, D]
    got_q, got_k = ref.rope_ref(q, k, cos, sin, style, qb, kb, compute == "float32")
    # Attention.forward: bias on [R, T, H, D], transpose to [R, H, T, D], Rope.apply with [R, T, D] tables
    want_q = rope.apply((q + qb)[None].transpose(1, 2), cos[None], sin[None]).transpose(1, 2)[0]
    want_k = rope.apply((k + kb)[None].transpose(1, 2), cos[None], sin[None]).transpose(1, 2)[0]
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_swiglu_ref_is_the_mlp_activation() -> None:
    torch.manual_seed(2)
    mlp = MLP(CFG).to(torch.bfloat16)
    x = torch.randn(4, CFG.hidden).bfloat16()
    assert torch.equal(mlp.proj(ref.swiglu_ref(mlp.fc(x))), mlp(x))


@pytest.mark.parametrize("gaps", [False, True])
def test_paged_decode_ref_matches_the_paged_context(gaps: bool) -> None:
    """One decode step of three sequences of different lengths over scattered blocks: the
    context's attend against the reference over ``decode_index``'s tables, lengths and gaps."""
    torch.manual_seed(3)
    bs, window = 4, 2
    pool = KVPool(CFG, 200, block_size=bs)
    n_slots = CFG.n_prelude + window * CFG.n_core + CFG.n_coda
    filler = SeqKV(pool, n_slots)  # takes blocks between the others' so their tables interleave
    seqs = []
    for length in (1, 9, 22):
        s = SeqKV(pool, n_slots)
        s.reserve(length + 1)
        filler.reserve(filler.length + bs)
        filler.length += bs
        s.length = length
        seqs.append(s)
    pool.k.normal_()
    pool.v.normal_()
    if gaps:  # keys that exited after loop 1: unwritten at core loop slot 1
        seqs[1].gaps.update({2: 1, 5: 1})
        seqs[2].gaps.update({0: 1, 7: 1, 20: 1})
    starts = [s.length for s in seqs]
    ctx = PagedContext(pool, rope_for(CFG), seqs, starts, 1)
    # rows at the prelude slot, core layer 1 of loop 3 (window slot 1), and the coda slot
    slots = torch.tensor([0, CFG.n_prelude + (3 % window) * CFG.n_core + 1, n_slots - 1])
    q = torch.randn(3, CFG.heads, 1, CFG.head_dim)
    k = torch.randn(3, CFG.kv_heads, 1, CFG.head_dim)
    v = torch.randn(3, CFG.kv_heads, 1, CFG.head_dim)
    want = ctx.attend(q, k, v, None, slots)[:, :, 0]  # writes the new K, V, then attends
    tables, seq_lens, written, depth = ref.decode_index(ctx, slots)
    assert seq_lens.tolist() == [n + 1 for n in starts]
    assert (written is None) == (not gaps)
    if gaps:
        assert depth is not None and depth.tolist() == [-1, 3 % window, -1]
    store = pool.store.fields
    got = ref.paged_decode_ref(q[:, :, 0], store["k"].data, store["v"].data,  # type: ignore[union-attr]
                               tables, seq_lens, bs, written, depth)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    keys = ctx._flat_index(None, slots)[1]  # [R, L]: the pool rows Backend.decode_attention is handed
    from_rows = ref.tables_of(keys, bs)  # what CudaBackend gives the kernel
    assert torch.equal(from_rows, tables[:, :from_rows.shape[1]])
    if not gaps:
        again = ref.paged_decode_ref(q[:, :, 0], store["k"].data, store["v"].data,  # type: ignore[union-attr]
                                     from_rows, seq_lens, bs)
        torch.testing.assert_close(again, want, rtol=1e-6, atol=1e-6)
    if gaps:  # the gaps changed what row 1 sees
        plain = ref.paged_decode_ref(q[:, :, 0], store["k"].data, store["v"].data,  # type: ignore[union-attr]
                                     tables, seq_lens, bs)
        assert not torch.allclose(plain[1], got[1])
