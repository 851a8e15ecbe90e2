"""bfloat16 models on the CPU: the engine keeps their linear weights bfloat16 (``weights`` bf16,
half of float32's bytes, on ``kernels.matmul_bf16``) and computes the rest in float32; the
logits are torch's bfloat16 reference's to bfloat16 rounding."""

from __future__ import annotations

import copy

import pytest
import torch

from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.model.context import FullContext
from tinyloop.model.looped import LoopedLM, RowSpec
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.model.quant import QuantLinear, quant_weights
from tinyloop.settings import Settings
from tinyloop.tokenizer import default_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels")


def model(style: str = "sandwich") -> LoopedLM:
    m = init_model(PRESETS["tiny"].replace(max_position=256, block_style=style), seed=0)
    with torch.no_grad():  # larger weights than a fresh init: logits far from flat
        gen = torch.Generator().manual_seed(0)
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return m.to(torch.bfloat16)


def logits(m: LoopedLM, loops: int) -> torch.Tensor:
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.inference_mode():
        out = m(tokens, FullContext(m.rope, 1, 8), [RowSpec(loops=loops, window=loops)], last_only=False)
    return out.logits.float()


@needs_kernel
def test_a_bfloat16_model_keeps_bfloat16_weights_and_float32_activations() -> None:
    eng = Engine(model(), default_tokenizer(), max_seq_len=64)
    assert eng.weights == "bf16" and eng.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())  # norms, embedding
    quants = quant_weights(eng.model)
    assert quants and all(q.mode == "bf16" and q.panels is not None for q in quants)
    layers = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    assert layers and eng.model.packed_head is not None  # every layer and the tied head
    weight_bytes = sum(q.panels.numel() * q.panels.element_size() for q in quants if q.panels is not None)
    assert weight_bytes <= 2 * sum(q.shape[0] * q.shape[1] for q in quants) * 1.1  # 2 bytes a weight (+ padding)


@needs_kernel
@pytest.mark.parametrize("style", ["sandwich", "peri_ln"])
@pytest.mark.parametrize("loops", [1, 3])
def test_its_logits_are_torchs_bfloat16_reference_to_bfloat16_rounding(style: str, loops: int) -> None:
    reference = model(style)
    exact = logits(copy.deepcopy(reference).float(), loops)  # the same bf16 weights, float32 throughout
    torch_bf16 = logits(reference, loops)  # every op rounded to bfloat16
    eng = Engine(copy.deepcopy(reference), default_tokenizer(), max_seq_len=64)
    ours = logits(eng.model, loops)
    rounding = (torch_bf16 - exact).abs().max()
    assert rounding > 0
    assert (ours - exact).abs().max() <= rounding  # products of bf16-rounded inputs, float32 elsewhere
    assert (ours - torch_bf16).abs().max() <= 2 * rounding


def test_without_the_kernels_a_bfloat16_model_stays_bfloat16() -> None:
    eng = Engine(model(), default_tokenizer(), max_seq_len=64, cpu_kernels=False)
    assert eng.weights == "float" and eng.dtype == torch.bfloat16


def test_bf16_weights_are_a_setting() -> None:
    assert Settings(weights="bf16").weights == "bf16"
