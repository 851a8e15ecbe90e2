"""A block's decode step as one C call (``cpu.block.FusedBlock``): the same tokens and logprobs
as the block's modules run one by one, in every layout and weight kind it covers; the steps it
does not cover (prefill, an h-mode KV pool, other layouts) run unfused; stale panels are noticed."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from tests.engine.test_engine import req
from tinyloop.cpu import kernels
from tinyloop.cpu.backend import use_cpu_kernels
from tinyloop.cpu.block import FusedBlock
from tinyloop.engine.engine import Engine
from tinyloop.model.layers import Block
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.model.quant import QuantLinear
from tinyloop.requests import GenerationResult, SamplingParams
from tinyloop.tokenizer import default_tokenizer

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels"),
              pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many block steps ran fused ([fused, declined]); each fused one is checked against the
    block's modules run on the same input (their K and V writes are the same values again)."""
    counts = [0, 0]
    run = FusedBlock.run

    def counted(self: FusedBlock, *args: object) -> object:
        out = run(self, *args)  # type: ignore[arg-type]
        counts[out is None] += 1
        if out is not None:
            self.block.fused = None
            try:
                x, ctx, rows, slots, normed, then, ids = (*args, None)[:7]
                want = self.block.run(x, ctx, ctx._rope, rows, slots, normed, then,  # type: ignore[arg-type,attr-defined]
                                      ids)
            finally:
                self.block.fused = self
            for got, expected in zip(out, want, strict=True):
                if expected is None:
                    assert got is None
                else:
                    assert got is not None
                    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5 * float(expected.abs().max()))
        return out

    monkeypatch.setattr(FusedBlock, "run", counted)
    yield counts


def engine(style: str = "sandwich", weights: str = "float", kv_mode: str | None = None,
           scale: dict[str, float] | None = None, step: bool = True, **changes: object) -> Engine:
    """``scale``: parameters whose name ends so, times that (before the engine packs them);
    ``step=False``: without the whole-step call (``cpu.step``), so that the stacks run."""
    config = PRESETS["tiny"].replace(max_position=256, block_style=style, **changes)
    model = init_model(config, seed=0)
    with torch.no_grad():  # peaked logits: no argmax ties between the two runs' roundings
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            factor = next((f for end, f in (scale or {}).items() if name.endswith(end)), 1.0)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15 * factor)
    eng = Engine(model, default_tokenizer(), max_seq_len=128, block_size=8, weights=weights, kv_mode=kv_mode)
    if not step:
        eng.model.fused_step = None
    return eng


GREEDY = SamplingParams(temperature=0, logprobs=True, ignore_eos=True)
REQUESTS = [req([5, 6, 7], max_tokens=8, loops=1, sampling=GREEDY),
            req(list(range(10, 31)), max_tokens=6, loops=3, sampling=GREEDY),
            req([40, 41, 42], max_tokens=6, loops=2,
                sampling=SamplingParams(temperature=0.9, top_k=40, seed=123, ignore_eos=True, logprobs=True))]


def both(eng: Engine) -> tuple[list[GenerationResult], list[GenerationResult]]:
    fused = eng.generate_many(REQUESTS)
    use_cpu_kernels(eng.model, True, fused=False)
    try:
        return fused, eng.generate_many(REQUESTS)
    finally:
        use_cpu_kernels(eng.model, True)


def assert_same(fused: list[GenerationResult], plain: list[GenerationResult], weights: str = "float") -> None:
    """The same tokens and logprobs. With int8, int4 or bf16 weights the products round their
    activations (to int8 per block of 32, or to bfloat16): where the two paths' float32 roundings
    differ in the last bit (the C step's SwiGLU exp against torch's, its residual sums) an input
    on a rounding edge moves by one step, and a logprob by up to a few 1e-3 after a few steps
    (seen on an Intel Xeon)."""
    tolerance = 1e-2 if weights in ("int8", "int4", "bf16") else 1e-4
    for a, b in zip(fused, plain, strict=True):
        assert a.tokens == b.tokens
        assert a.logprobs is not None and b.logprobs is not None
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.logprobs]),
                                   torch.tensor([lp.logprob for lp in b.logprobs]), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("style", ["pre_ln", "sandwich", "peri_ln"])
@pytest.mark.parametrize("weights", ["float", "int8", "int4", "bf16"])
def test_a_fused_decode_step_equals_the_blocks_modules(fused_calls: list[int], style: str, weights: str) -> None:
    eng = engine(style, weights)
    blocks = [m for m in eng.model.modules() if isinstance(m, Block)]
    assert blocks and all(b.fused is not None for b in blocks)
    fused, plain = both(eng)
    assert fused_calls[0] > 0 and fused_calls[1] > 0  # decode steps fused; prefills declined
    assert_same(fused, plain, weights)


@pytest.mark.parametrize("weights", ["float", "int8", "bf16"])
@pytest.mark.parametrize("changes", [{"qk_bias": True}, {"fused_qkv": False}, {"qk_bias": True, "fused_qkv": False}],
                         ids=["huginn-qk-bias", "ouro-three-projections", "both"])
def test_q_k_biases_and_three_projections_are_fused_too(fused_calls: list[int], weights: str,
                                                         changes: dict[str, object]) -> None:
    eng = engine("peri_ln" if changes.get("fused_qkv") is False else "sandwich", weights, **changes)
    assert all(b.fused is not None for b in eng.model.modules() if isinstance(b, Block))
    if changes.get("qk_bias"):
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # biases far from zero: a step that dropped them would show
            for b in eng.model.modules():
                if isinstance(b, Block):
                    b.attn.q_bias.copy_(torch.randn(b.attn.q_bias.shape, generator=gen) * 0.5)
                    b.attn.k_bias.copy_(torch.randn(b.attn.k_bias.shape, generator=gen) * 0.5)
    fused, plain = both(eng)
    assert fused_calls[0] > 0
    assert_same(fused, plain, weights)


@pytest.mark.parametrize("weights", ["float", "int8", "bf16"])
@pytest.mark.parametrize("style", ["pre_ln", "sandwich"])
def test_parcae_blocks_relu2_and_per_head_norms_are_fused_too(fused_calls: list[int], weights: str, style: str) -> None:
    """Parcae's layout: ``0.5 relu(fc)^2`` MLPs and a weightless RMS norm per q/k head after RoPE."""
    eng = engine(style, weights, mlp="relu2", qk_head_norm=True)
    assert all(b.fused is not None for b in eng.model.modules() if isinstance(b, Block))
    fused, plain = both(eng)
    assert fused_calls[0] > 0
    assert_same(fused, plain, weights)


def test_parcae_value_embeddings_are_fused_too(fused_calls: list[int]) -> None:
    """v plus the token's gated value embedding, in the step (the stack call declines: block by block)."""
    eng = engine("pre_ln", mlp="relu2", qk_head_norm=True, value_embeds=(0, 2),  # tables and gates far from
                 scale={"value_table.weight": 5.0, "value_gate.weight": 5.0})  # zero: dropping them would show
    blocks = [b for b in eng.model.modules() if isinstance(b, Block)]
    assert all(b.fused is not None for b in blocks)
    fused, plain = both(eng)
    assert fused_calls[0] > 0
    assert_same(fused, plain)


@pytest.mark.parametrize("weights", ["int8", "int4", "bf16"])
def test_quantised_weights_leave_the_value_gate_float_and_its_layers_fuse(fused_calls: list[int],
                                                                         weights: str) -> None:
    eng = engine("pre_ln", weights, mlp="relu2", qk_head_norm=True, value_embeds=(0,),
                 scale={"value_table.weight": 5.0, "value_gate.weight": 5.0})
    blocks = [b for b in eng.model.modules() if isinstance(b, Block)]
    assert type(blocks[0].attn.value_gate) is torch.nn.Linear
    assert all(b.fused is not None for b in blocks)
    fused, plain = both(eng)
    assert fused_calls[0] > 0
    assert_same(fused, plain, weights)


def test_a_value_gate_that_is_not_a_float_linear_runs_its_layers_modules() -> None:
    eng = engine("pre_ln", mlp="relu2", qk_head_norm=True, value_embeds=(0,))
    block = next(b for b in eng.model.modules() if isinstance(b, Block))
    block.attn.value_gate = QuantLinear(torch.nn.Linear(32, block.attn.config.kv_heads, bias=False), "int8")
    assert FusedBlock.for_block(block) is None


def test_blocks_it_does_not_cover_run_their_modules() -> None:
    for eng in (engine("post_ln"), engine(qk_norm=True)):
        assert all(b.fused is None for b in eng.model.modules() if isinstance(b, Block))
        assert eng.generate_many(REQUESTS[:1])[0].completion_tokens == 8


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_a_4bit_kv_pool_is_fused_too(fused_calls: list[int], weights: str) -> None:
    fused, plain = both(engine(weights=weights, kv_mode="int4"))
    assert fused_calls[0] > 0
    assert_same(fused, plain, weights)


def test_an_h_mode_pool_declines_and_runs_unfused(fused_calls: list[int]) -> None:
    fused, plain = both(engine(kv_mode="h-mode"))
    assert fused_calls[0] == 0 and fused_calls[1] > 0
    assert_same(fused, plain)


def test_new_panels_make_the_fused_step_stand_down(fused_calls: list[int]) -> None:
    eng = engine(weights="int8")
    block = next(m for m in eng.model.modules() if isinstance(m, Block))
    assert block.fused is not None and block.fused.current()
    layer = block.mlp.fc
    assert isinstance(layer, QuantLinear)
    layer.quant.set_panels(False)  # e.g. weights re-packed: the struct's pointers would be stale
    assert not block.fused.current()
    layer.quant.set_panels(True)
    assert not block.fused.current()  # new panels, new memory
    eng.generate_many(REQUESTS[:1])
    assert fused_calls[1] > 0
    use_cpu_kernels(eng.model, True)  # rebuilt on the panels the layer has now
    assert block.fused is not None and block.fused.current()


def test_turning_the_kernels_off_drops_the_fused_steps() -> None:
    eng = engine()
    use_cpu_kernels(eng.model, False)
    assert all(b.fused is None for b in eng.model.modules() if isinstance(b, Block))


def test_a_copied_block_runs_unfused_until_given_its_own() -> None:
    eng = engine(weights="int8")
    block = next(m for m in eng.model.modules() if isinstance(m, Block))
    assert block.fused is not None
    twin = copy.deepcopy(block)  # (the struct points at the original's panels)
    assert twin.fused is None and block.fused is not None


@pytest.fixture
def stack_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many stacks of blocks ran as one call ([stacked, declined]); each stacked one is
    checked against its blocks run one by one on the same input (each fused on its own)."""
    counts = [0, 0]
    run_stack = FusedBlock.run_stack

    def counted(self: FusedBlock, blocks: torch.nn.ModuleList, x: torch.Tensor, ctx: object,
                slot0: int) -> torch.Tensor | None:
        out = run_stack(self, blocks, x, ctx, slot0)  # type: ignore[arg-type]
        counts[out is None] += 1
        if out is not None:
            layers = list(blocks)
            want, normed = x, None
            for i, layer in enumerate(layers):
                then = layers[i + 1].attn_norm if i + 1 < len(layers) else None
                want, normed = layer.run(want, ctx, ctx._rope, None, slot0 + i, normed, then)  # type: ignore[attr-defined]
            torch.testing.assert_close(out, want, rtol=0, atol=0)
        return out

    monkeypatch.setattr(FusedBlock, "run_stack", counted)
    yield counts


# rows with one loop count share every slot: their stacks of blocks run as one call each
SAME_LOOPS = [req([5, 6, 7], max_tokens=8, loops=3, sampling=GREEDY),
              req(list(range(10, 31)), max_tokens=6, loops=3, sampling=GREEDY)]


@pytest.mark.parametrize("style", ["pre_ln", "sandwich", "peri_ln"])
@pytest.mark.parametrize("weights", ["float", "int8", "int4", "bf16"])
@pytest.mark.parametrize("kv_mode", [None, "int4"])
def test_a_decode_stack_is_one_call_and_equals_its_blocks(stack_calls: list[int], style: str, weights: str,
                                                         kv_mode: str | None) -> None:
    eng = engine(style, weights, kv_mode=kv_mode, step=False)
    stacked = eng.generate_many(SAME_LOOPS)
    assert stack_calls[0] > 0  # (prelude, every loop of the core, coda: each one call)
    use_cpu_kernels(eng.model, True, fused=False)
    assert_same(stacked, eng.generate_many(SAME_LOOPS), weights)


def test_a_stack_with_a_block_it_cannot_fuse_runs_block_by_block(stack_calls: list[int],
                                                                 fused_calls: list[int]) -> None:
    eng = engine(weights="int8", step=False)
    core = [m for m in eng.model.core if isinstance(m, Block)]
    core[1].fused = None  # e.g. a layout the C step does not cover
    stacked = eng.generate_many(SAME_LOOPS)
    assert stack_calls[0] > 0 and stack_calls[1] > 0  # prelude and coda stacked, the core declined
    assert fused_calls[0] > 0  # the core's other blocks still fused one by one
    use_cpu_kernels(eng.model, True, fused=False)
    assert_same(stacked, eng.generate_many(SAME_LOOPS), "int8")


def test_a_stack_notices_a_rebuilt_block(stack_calls: list[int]) -> None:
    eng = engine(weights="int8", step=False)
    eng.generate_many(SAME_LOOPS[:1])
    first = stack_calls[0]
    use_cpu_kernels(eng.model, True)  # every FusedBlock rebuilt: the stacks' struct arrays too
    eng.model.fused_step = None
    again = eng.generate_many(SAME_LOOPS[:1])
    assert stack_calls[0] > first
    use_cpu_kernels(eng.model, True, fused=False)
    assert_same(again, eng.generate_many(SAME_LOOPS[:1]), "int8")
