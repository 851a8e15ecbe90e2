"""The Inkling-2 loop model's C steps (``tinyloop/cpu/inkling2.c``) against the torch code they
replace in ``tinyloop.model.inkling2``, on random shapes (odd widths, several rows, strided
inputs, every option), and the engine's decode with them against its decode without them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import nn

from tests.convert.checkpoints import CHECKPOINTS
from tinyloop.convert import convert
from tinyloop.cpu import inkling2 as native
from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.model import inkling2
from tinyloop.model.inkling2 import _attend_states, _clip, _Controller, _MoE, _rms, _ShortConv, _weighted_rms
from tinyloop.requests import GenerationRequest

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C kernels do not build here")

TOL = 2e-5  # float32 sums in another order, and the kernels' exp within 2 ulp of libm's


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    assert got.shape == want.shape
    scale = max(want.abs().max().item(), 1.0)
    assert (got - want).abs().max().item() <= tol * scale


@pytest.mark.parametrize(("lead", "n", "h", "q"), [((1, 1), 1, 8, 1), ((3, 1), 4, 37, 3), ((2, 5), 7, 64, 4),
                                                   ((8, 1), 3, 512, 1)])
def test_attend_states_is_the_attention_residual(lead: tuple[int, int], n: int, h: int, q: int) -> None:
    gen = torch.Generator().manual_seed(n * h + q)
    states = torch.randn(*lead, n, h, generator=gen) * 3
    queries = torch.randn(q, h, generator=gen)
    _close(native.attend_states(states, queries, 1e-6), _attend_states(queries, states))
    weight = torch.randn(q, h, generator=gen)
    want = torch.stack([_weighted_rms(_attend_states(queries, states)[..., i, :], weight[i], 1e-5) for i in range(q)],
                       dim=-2)
    _close(native.attend_states(states, queries, 1e-6, weight, 1e-5), want)
    one = torch.randn(h, generator=gen)  # one weight for every query
    _close(native.attend_states(states, queries, 1e-6, one, 1e-5),
           _weighted_rms(_attend_states(queries, states), one, 1e-5))


@pytest.mark.parametrize(("rows", "h", "rank"), [(1, 16, 4), (5, 37, 8), (8, 512, 16)])
def test_controller_is_the_torch_controller(rows: int, h: int, rank: int) -> None:
    torch.manual_seed(rows + h)
    ctl = _Controller(h, rank, 1e-6)
    for layer in (ctl.down, ctl.forget, ctl.message):
        nn.init.normal_(layer.weight, std=0.5)
    x = torch.randn(rows, 1, h) * 2
    messages = torch.randn(rows, 1, 4, h)  # a message is a strided slice of the four
    weight = torch.randn(h)
    with torch.no_grad():
        want = _weighted_rms(ctl(x, messages[..., 2, :]), weight, 1e-5)
        _close(ctl.normed(x, messages[..., 2, :], weight, 1e-5), want)
        _close(native.controller(x, messages[..., 2, :], ctl.down.weight, ctl.forget.weight.t(),
                                 ctl.message.weight.t(), 1e-6, weight, 1e-5), want)
        ctl.forget.weight.mul_(2)  # changed weights: transposed again
        _close(ctl.normed(x, messages[..., 2, :], weight, 1e-5),
               _weighted_rms(ctl(x, messages[..., 2, :]), weight, 1e-5))


class _Tail:
    """A ``_CacheMemory``'s convolution context with a given tail."""

    def __init__(self, tail: torch.Tensor) -> None:
        self.tail = tail

    def conv_context(self, slot: str, x: torch.Tensor, kernel: int) -> torch.Tensor:
        return torch.cat([self.tail, x], dim=1)


@pytest.mark.parametrize(("rows", "length", "channels", "kernel", "heads"),
                         [(1, 1, 8, 4, 0), (3, 1, 37, 3, 0), (2, 5, 24, 4, 0), (4, 1, 128, 4, 2), (2, 6, 48, 2, 3),
                          (1, 3, 16, 4, 4)])
def test_short_conv_is_the_torch_convolution(rows: int, length: int, channels: int, kernel: int, heads: int) -> None:
    torch.manual_seed(rows * channels + kernel)
    hidden = 20
    conv = _ShortConv(channels, kernel, hidden, heads)
    nn.init.normal_(conv.weight)
    if conv.dynamic is not None:
        nn.init.normal_(conv.dynamic.weight)
    wide = torch.randn(rows, length, channels + 5)  # x a slice of a wider output (strided rows)
    x = wide[..., 2:2 + channels]
    tail = torch.randn(rows, kernel - 1, channels + 3)  # the pool's rows are as wide as the widest field
    source = torch.randn(rows, length, hidden)
    with torch.no_grad():
        want = conv(x, _Tail(tail[..., :channels]), "k", source)  # type: ignore[arg-type]
        dynamic = None if conv.dynamic is None else conv.dynamic(source)
        got = native.short_conv(x, tail, conv.weight, conv.denominator, dynamic, heads)
        _close(got, want)
        group = channels // (heads or 1)
        clipped = _clip(want.view(rows, length, -1, group), 0.5).view_as(want)
        _close(native.short_conv(x, tail, conv.weight, conv.denominator, dynamic, heads, "clip", group, 0.5), clipped)
        normed = _rms(want.view(rows, length, -1, group), 1e-6).view_as(want)
        _close(native.short_conv(x, tail, conv.weight, conv.denominator, dynamic, heads, "rms", group, 1e-6), normed)
        residual = torch.randn(rows, length, channels)
        _close(native.short_conv(x, tail, conv.weight, conv.denominator, dynamic, heads, residual=residual),
               want + residual)


def _attention_reference(q: torch.Tensor, q_scale: torch.Tensor, rel: torch.Tensor, rel_scale: torch.Tensor,
                         rel_proj: torch.Tensor, sink: torch.Tensor, gate: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, key_positions: torch.Tensor, visible: torch.Tensor,
                         positions: torch.Tensor, kv_heads: int, window: int, log_scale: tuple[float, float] | None,
                         qk_clip: float, rel_clip: float) -> torch.Tensor:
    """What ``_Attention.forward`` does after its projections, written out plainly for one token a row."""
    hq, d = q_scale.shape
    dr, extent = rel_proj.shape
    r, n_keys = key_positions.shape
    qh = _clip(q.view(r, hq, d) * q_scale, qk_clip)
    rh = _clip(rel.view(r, hq, dr) * rel_scale, rel_clip)
    if log_scale is not None:
        alpha, floor = log_scale
        scale = 1 + alpha * torch.log(((positions + 1).float() / floor).clamp(min=1.0))
        qh, rh = qh * scale[:, None, None], rh * scale[:, None, None]
    k = keys[..., :kv_heads * d].view(r, n_keys, kv_heads, d).repeat_interleave(hq // kv_heads, dim=2)
    v = values[..., :kv_heads * d].view(r, n_keys, kv_heads, d).repeat_interleave(hq // kv_heads, dim=2)
    scores = torch.einsum("rhd,rlhd->rhl", qh, k) * d ** -0.5
    distance = positions[:, None] - key_positions  # [R, L]
    profiles = rh @ rel_proj  # [R, HQ, extent]
    bias = profiles.gather(-1, distance.clamp(0, extent - 1)[:, None].expand(-1, hq, -1))
    bias = bias.masked_fill(((distance < 0) | (distance >= extent))[:, None], 0.0)
    allowed = visible & (distance >= 0)
    if window:
        allowed &= distance < window
    scores = (scores + bias).masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.cat([scores, sink[..., None]], dim=-1).softmax(-1)[..., :-1]
    out = torch.einsum("rhl,rlhd->rhd", weights, v).reshape(r, hq * d)
    return out * torch.sigmoid(gate)


@pytest.mark.parametrize(("rows", "n_keys", "heads", "kv_heads", "dim", "dr", "extent", "window", "full"),
                         [(1, 1, 1, 1, 8, 4, 3, 0, False), (3, 9, 4, 2, 16, 8, 5, 4, False),
                          (2, 17, 8, 2, 64, 16, 12, 0, True), (5, 40, 6, 3, 24, 3, 64, 7, True)])
def test_decode_attention_is_the_attention_after_its_projections(rows: int, n_keys: int, heads: int, kv_heads: int,
                                                                 dim: int, dr: int, extent: int, window: int,
                                                                 full: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n_keys + heads)
    width = kv_heads * dim + 3  # the pool's rows wider than this layer's K/V
    fused = torch.randn(rows, heads * (2 * dim + dr + 1) + 7, generator=gen) * 4  # one wide projection output
    q, rel, gate, sink = fused[:, :heads * dim], fused[:, heads * dim:heads * (dim + dr)], \
        fused[:, heads * (dim + dr):heads * (2 * dim + dr)], fused[:, heads * (2 * dim + dr):heads * (2 * dim + dr + 1)]
    q_scale, rel_scale = torch.rand(heads, dim, generator=gen) * 2, torch.rand(heads, dr, generator=gen) * 2
    rel_proj = torch.randn(dr, extent, generator=gen)
    keys, values = torch.randn(rows, n_keys, width, generator=gen), torch.randn(rows, n_keys, width, generator=gen)
    positions = torch.randint(n_keys - 1, n_keys + 30, (rows,), generator=gen)
    key_positions = positions[:, None] - n_keys + 1 + torch.arange(n_keys)  # the last key is the token's own
    visible = torch.rand(rows, n_keys, generator=gen) > 0.2
    visible[:, -1] = True
    args = (q, q_scale, rel, rel_scale, rel_proj, sink, gate, keys, values, key_positions, visible, positions,
            kv_heads, window, (0.3, 4.0) if full else None, 1.5, 0.7)
    _close(native.decode_attention(*args), _attention_reference(*args))


@pytest.mark.parametrize(("tokens", "hidden", "experts", "top_k"), [(1, 16, 4, 2), (8, 37, 8, 2), (13, 64, 16, 4)])
def test_routing_activation_and_recombination_are_the_torch_moe(tokens: int, hidden: int, experts: int,
                                                                top_k: int) -> None:
    torch.manual_seed(tokens + hidden)
    config = inkling2.Inkling2Config.from_hf(_text_config(hidden=hidden, experts=experts, top_k=top_k))
    moe = _MoE(config)
    for p in moe.parameters():
        nn.init.normal_(p, std=0.3)
    x = torch.randn(2, tokens, hidden)
    with torch.no_grad():
        _close(moe.decode(x), moe(x))
    gate_up = torch.randn(9, 2 * config.moe_intermediate) * 10
    _close(native.activation(gate_up, config.gate_softcap, config.up_softcap), moe._activation(gate_up))


def _text_config(hidden: int = 32, experts: int = 4, top_k: int = 2) -> dict[str, object]:
    return {"model_type": "inkling2_loop_text", "num_hidden_layers": 2, "vocab_size": 40, "unpadded_vocab_size": 40,
            "hidden_size": hidden,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "swa_num_attention_heads": 2,
            "swa_num_key_value_heads": 1, "swa_head_dim": 8, "sliding_window_size": 4, "d_rel": 4, "rel_extent": 4,
            "log_scaling_n_floor": 2, "log_scaling_alpha": 0.1, "qk_l2_clip_threshold": 8.0,
            "rel_l2_clip_threshold": 2.0, "conv_kernel_size": 4, "n_routed_experts": experts,
            "num_experts_per_tok": top_k, "moe_intermediate_size": 24, "route_scale": 2.5, "mlp_gate_softcap": 4.0,
            "mlp_up_softcap": 25.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
            "n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1, "loop_layer_index_end": 2,
            "loop_num_passes": 2, "loop_gate_rank": 4, "layer_types": ["hybrid_sliding", "hybrid"]}


def _decode_trace(engine: Engine, prompts: list[list[int]], passes: list[int], steps: int) -> list[torch.Tensor]:
    """Each step's logits of rows that decode together (fixed tokens fed: the same in every run)."""
    seqs = [engine.start(GenerationRequest(prompt_tokens=tuple(p), loops=n, max_tokens=steps + 1))
            for p, n in zip(prompts, passes, strict=True)]
    try:
        for seq in seqs:
            engine.prefill(seq)
        out = []
        for step in range(steps):
            for i, seq in enumerate(seqs):
                seq.pending = (7 * step + 3 * i + 1) % 250
            out.append(engine.decode(seqs).clone())
            assert [seq.kv.length for seq in seqs] == [len(p) + step + 1 for p in prompts]
        return out
    finally:
        for seq in seqs:
            engine.free(seq)


def test_the_engines_decode_in_c_is_its_decode_in_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny fixture with its attention scales raised (so that q, k and the relative states
    are clipped), rows at different lengths (past the sliding window and the bias's extent) and
    pass counts decoding together: the same logits with the C steps as without."""
    out = tmp_path / "i.tinyloop"
    convert(CHECKPOINTS / "inkling2-tiny", out)
    engine = Engine.load(out, dtype=torch.float32, kv_cache_mb=4)
    with torch.no_grad():
        for layer in cast(inkling2.Inkling2LM, engine.model).layers:
            layer.attn.q_scale.mul_(40)
            layer.attn.rel_scale.mul_(200)
            layer.attn.k_conv.weight.mul_(30)
    prompts = [list(range(5, 8)), list(range(20, 33)), list(range(40, 61))]
    passes = [1, 3, 2]
    calls = {"attention": 0}
    real = native.decode_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls["attention"] += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "decode_attention", counted)
    with_c = _decode_trace(engine, prompts, passes, 6)
    assert calls["attention"] > 0  # the C path ran
    monkeypatch.setattr(inkling2, "NATIVE", [False])
    calls["attention"] = 0
    without = _decode_trace(engine, prompts, passes, 6)
    assert calls["attention"] == 0
    n = engine.tokenizer.vocab_size
    for a, b in zip(with_c, without, strict=True):
        assert torch.isfinite(b[:, :n]).all()
        _close(a[:, :n], b[:, :n], 1e-5)


def test_an_engine_without_cpu_kernels_decodes_on_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "i.tinyloop"
    convert(CHECKPOINTS / "inkling2-tiny", out)
    engine = Engine.load(out, dtype=torch.float32, kv_cache_mb=4, cpu_kernels=False)

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the C steps ran with cpu_kernels=False")

    monkeypatch.setattr(native, "decode_attention", refuse)
    assert len(_decode_trace(engine, [[5, 6, 7]], [2], 2)) == 2


def test_shapes_beyond_the_kernels_scratch_are_refused_and_their_models_decode_on_torch() -> None:
    with pytest.raises(ValueError, match="65 states"):
        native.attend_states(torch.randn(1, 65, 8), torch.randn(1, 8), 1e-6)
    with pytest.raises(ValueError, match="rank 300"):
        native.controller(torch.randn(1, 8), torch.randn(1, 8), torch.randn(300, 16), torch.randn(300, 8),
                          torch.randn(300, 8), 1e-6)
    with pytest.raises(ValueError, match="2 of 2000 experts"):
        native.route(torch.randn(1, 8), torch.randn(2000, 8), torch.zeros(2000), 2, 1.0)
    config = inkling2.Inkling2Config.from_hf({**_text_config(), "loop_gate_rank": 300})
    assert inkling2.Inkling2LM(inkling2.Inkling2Config.from_hf(_text_config())).native_fits
    assert not inkling2.Inkling2LM(config).native_fits


def test_attention_over_more_keys_than_a_stack_buffer() -> None:
    """Keys are a row's whole context (no fixed cap): 20000 here."""
    gen = torch.Generator().manual_seed(0)
    n_keys, heads, dim = 20000, 2, 8
    q, gate = torch.randn(1, heads * dim, generator=gen), torch.randn(1, heads * dim, generator=gen)
    rel, sink = torch.randn(1, heads * 4, generator=gen), torch.randn(1, heads, generator=gen)
    keys, values = torch.randn(1, n_keys, dim, generator=gen), torch.randn(1, n_keys, dim, generator=gen)
    positions = torch.tensor([n_keys - 1])
    args = (q, torch.ones(heads, dim), rel, torch.ones(heads, 4), torch.randn(4, 16, generator=gen), sink, gate,
            keys, values, torch.arange(n_keys)[None], torch.ones(1, n_keys, dtype=torch.bool), positions, 1, 0,
            (0.1, 8.0), 8.0, 2.0)
    _close(native.decode_attention(*args), _attention_reference(*args))


def test_vexp_covers_the_softmax_range() -> None:
    """The kernels' exp (inside the activation's sigmoid and tanh) against torch's over the
    range the maths reaches, extremes included."""
    extremes = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 88.0, -87.0])
    x = torch.cat([torch.linspace(-120, 100, 20001), extremes])
    gate_up = torch.cat([x, x])[None]
    got = native.activation(gate_up, 1.0, 1.0)
    want = torch.tanh(x) * torch.tanh(x) * torch.sigmoid(x)
    assert torch.isfinite(got).all()
    assert (got[0] - want).abs().max().item() <= 1e-6 * max(1.0, math.e)
