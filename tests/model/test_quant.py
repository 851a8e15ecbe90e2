"""Weight-only int8 / int4 linear layers (quant.py): the products, the swap, an engine on them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.errors import RequestError
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.model.quant import QuantLinear, QuantWeight, quant_available, quantize_linears
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer

MODES = [pytest.param(m, marks=pytest.mark.skipif(not quant_available(m), reason=f"no {m} kernels"))
         for m in ("int8", "int4")]


@pytest.mark.parametrize("mode", MODES)
def test_the_product_is_the_dequantized_weight_s_and_close_to_float(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    x = torch.randn(2, 5, 64, generator=gen)
    q = QuantWeight(w, mode)
    deq = q.dequantize()
    exact = x @ deq.t()  # the product rounds to bfloat16 on the way: within 1% of it
    assert (q.linear(x) - exact).norm() / exact.norm() < 1e-2
    assert q.linear(x).dtype == torch.float32
    err = (deq - w).abs().max() / w.abs().max()
    assert err < (0.01 if mode == "int8" else 0.1)
    rel = (q.linear(x) - x @ w.t()).norm() / (x @ w.t()).norm()
    assert rel < (0.01 if mode == "int8" else 0.1)
    assert q.nbytes < w.nbytes / (3 if mode == "int8" else 5)


@pytest.mark.skipif(not quant_available("int8"), reason="no int8 kernels")
def test_grouped_int8_is_q8_0_s_weights_on_either_product() -> None:
    """A scale per 32 inputs, rounded to fp16 (q8_0's blocks): each weight within half its own
    group's step; the C kernels and torch's fallback (no panels) give the same product."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 96, generator=gen) * torch.logspace(-3, 0, 96)  # groups of very different sizes
    q = QuantWeight(w, "int8", 32)
    assert q.group == 32 and q.scales.shape == (48, 3) and torch.equal(q.scales, q.scales.half().float())
    step = q.scales.repeat_interleave(32, 1)
    assert ((q.dequantize() - w).abs() <= step / 2 * (1 + 1e-3)).all()
    per_output = QuantWeight(w, "int8")
    small = slice(0, 32)  # the smallest inputs: one scale per output rounds most of them to 0
    assert (q.dequantize() - w)[:, small].norm() < (per_output.dequantize() - w)[:, small].norm() / 10
    x = torch.randn(3, 96, generator=gen)
    exact = x @ q.dequantize().t()
    products = [q.linear(x)]  # no panels: torch, x and the weight rounded to bfloat16
    if kernels.available():
        q.set_panels(True)
        products.append(q.linear(x))  # x quantised per block of 32
    for y in products:
        assert (y - exact).norm() / exact.norm() < 1e-2
    for bad in (16, 48, -32):
        with pytest.raises(ValueError, match="an int8 group"):
            QuantWeight(w, "int8", bad)


def model() -> nn.Module:
    return init_model(PRESETS["tiny"].replace(max_position=128), seed=0)


@pytest.mark.parametrize("mode", MODES)
def test_quantize_swaps_every_linear_and_the_tied_head(mode: str) -> None:
    m = model()
    linears = sum(isinstance(x, nn.Linear) and x.out_features > 1 for x in m.modules())
    assert quantize_linears(m, mode) == linears + 1  # + the tied head
    assert not any(isinstance(x, nn.Linear) and x.out_features > 1 for x in m.modules())
    assert sum(isinstance(x, QuantLinear) for x in m.modules()) == linears
    assert isinstance(m.packed_head, QuantWeight)  # type: ignore[union-attr]
    # the head is int8 in both modes (int4's too), its activations in two int8 terms
    assert m.packed_head.mode == "int8" and m.packed_head.terms == 2  # type: ignore[union-attr]
    assert {x.quant.mode for x in m.modules() if isinstance(x, QuantLinear)} == {mode}
    assert {x.quant.terms for x in m.modules() if isinstance(x, QuantLinear)} == {1}
    # int8 weights: a scale per 32 inputs where the C kernels build (torch's kernel takes one per output)
    int8 = [x.quant for x in m.modules() if isinstance(x, QuantLinear) and x.quant.mode == "int8"]
    want = 32 if kernels.available() else 0
    assert {q.group for q in [*int8, m.packed_head]} == {want}  # type: ignore[list-item]
    flat = model()
    quantize_linears(flat, mode, grouped=False)
    assert flat.packed_head.group == 0 and flat.packed_head.scales.shape == (flat.packed_head.shape[0],)  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", MODES)
def test_an_untied_head_layer_is_the_int8_head(mode: str) -> None:
    m = init_model(PRESETS["tiny"].replace(max_position=128, tie_embeddings=False), seed=0)
    quantize_linears(m, mode)
    assert isinstance(m.lm_head, QuantLinear) and m.packed_head is m.lm_head.quant
    assert m.lm_head.quant.mode == "int8" and m.lm_head.quant.terms == 2


@pytest.mark.parametrize("mode", MODES)
def test_an_engine_on_quantized_weights_generates(mode: str) -> None:
    engine = Engine(model(), default_tokenizer(), max_seq_len=128, weights=mode)
    assert engine.weights == mode
    req = GenerationRequest(prompt_tokens=(5, 6, 7, 8), max_tokens=6, loops=2,
                            sampling=SamplingParams(temperature=0, ignore_eos=True))
    out = engine.generate_many([req, req])
    assert [len(r.tokens) for r in out] == [6, 6]
    assert out[0].tokens == out[1].tokens


def test_an_unknown_weight_mode_is_refused() -> None:
    with pytest.raises(RequestError, match="weights"):
        Engine(model(), default_tokenizer(), max_seq_len=128, weights="int3")


def test_an_int8_draft_twin_shares_all_but_the_linear_weights() -> None:
    from tinyloop.model.quant import QuantLinear, draft_copy

    model = init_model(PRESETS["tiny"], seed=0)
    before = {name: p.clone() for name, p in model.named_parameters()}
    twin = draft_copy(model, "int8")
    assert twin is not model and draft_copy(model, "same") is model
    assert any(isinstance(m, QuantLinear) for m in twin.modules())
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # the model is untouched
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    shared = {id(p) for p in model.parameters()}
    assert all(id(p) in shared for p in twin.parameters())  # no float32 tensor copied
    assert all(id(b) in {id(x) for x in model.buffers()} for b in twin.buffers())
    with pytest.raises(ValueError, match="draft weights"):
        draft_copy(model, "int4")
