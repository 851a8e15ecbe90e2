"""CPU weight layouts (cpu_linear.py): same values, same outputs, the fast kernels on each call."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from tinyloop.cpu import kernels
from tinyloop.cpu.backend import use_cpu_kernels
from tinyloop.engine.engine import Engine
from tinyloop.model.cpu_linear import PackedLinear, onednn_available, pack_linears, packed_bytes, packed_weights
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer


def model() -> nn.Module:
    m = init_model(PRESETS["tiny"].replace(max_position=128), seed=0)
    with torch.no_grad():  # peaked logits: no argmax ties between the layouts
        gen = torch.Generator().manual_seed(0)
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return m


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Pack and run on 1 thread (one-row products whole) and on 2 (split over the threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def test_packing_keeps_parameters_state_dict_and_outputs(threads: int) -> None:
    plain, packed = model(), model()
    before = {k: v.clone() for k, v in packed.state_dict().items()}
    params = [id(p) for p in packed.parameters()]
    n = pack_linears(packed)
    assert n == sum(isinstance(m, PackedLinear) for m in packed.modules()) + 1  # + the tied head (the embedding)
    assert packed.packed_head is not None  # type: ignore[union-attr]
    assert [id(p) for p in packed.parameters()] == params
    after = packed.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    # wide weights (q/k/v, gate/up) column-major; narrow ones (down projection) row-major on one
    # thread, column-major too where one-row products split over threads
    block = packed.core[0]  # type: ignore[index]
    assert block.attn.qkv.weight.t().is_contiguous() and block.mlp.fc.weight.t().is_contiguous()
    assert block.mlp.proj.weight.t().is_contiguous() if threads > 1 else block.mlp.proj.weight.is_contiguous()
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 1, block.mlp.fc.in_features, generator=gen)
        with torch.inference_mode():
            torch.testing.assert_close(block.mlp.fc(x), plain.core[0].mlp.fc(x),  # type: ignore[index]
                                       rtol=1e-5, atol=1e-5)
            h = torch.randn(rows, 1, packed.config.hidden, generator=gen)  # type: ignore[union-attr]
            torch.testing.assert_close(packed.head(h), plain.head(h), rtol=1e-5, atol=1e-5)  # type: ignore[operator]


def test_a_new_dtype_drops_the_packed_copies() -> None:
    m = model()
    pack_linears(m)
    m.to(torch.bfloat16)
    assert not any(isinstance(mod, PackedLinear) for mod in m.modules())
    assert m.packed_head is None  # type: ignore[union-attr]
    assert packed_bytes(m) == 0


def run(engine: Engine, batch: int) -> list[list[int]]:
    reqs = [GenerationRequest(prompt_tokens=tuple(range(3 + b, 12 + 2 * b)), max_tokens=12, loops=2 + b % 3,
                              sampling=SamplingParams(temperature=0, ignore_eos=True)) for b in range(batch)]
    return [list(r.tokens) for r in engine.generate_many(reqs)]


def test_packed_engine_decodes_the_same_greedy_tokens() -> None:
    plain = Engine(model(), default_tokenizer(), max_seq_len=128, pack_weights=False)
    packed = Engine(model(), default_tokenizer(), max_seq_len=128)
    assert packed_bytes(packed.model) > 0 and packed_bytes(plain.model) == 0
    for batch in (1, 4):
        assert run(packed, batch) == run(plain, batch)


def ops_per_decode(engine: Engine, batch: int) -> Counter[str]:
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    seqs = [engine.start(GenerationRequest(prompt_tokens=(5, 6, 7), max_tokens=8, loops=2, sampling=greedy))
            for _ in range(batch)]
    engine.step(seqs)  # prefill and first token
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step(seqs)
    for s in seqs:
        engine.free(s)
    return Counter(e.name for e in prof.events())


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch build")
def test_decode_runs_every_matrix_product_on_the_packed_kernels(threads: int) -> None:
    engine = Engine(model(), default_tokenizer(), max_seq_len=128, cpu_kernels=False)  # torch's kernels
    config = engine.config
    # per token: each layer's qkv, o, fc, proj; the adapter per loop; the head
    layers = config.n_prelude + 2 * config.n_core + config.n_coda
    linears = 4 * layers + 2 * (config.injection == "concat_linear") + 1
    one = ops_per_decode(engine, 1)
    assert one["mkldnn::_linear_pointwise"] == 0  # one row: the re-laid weights, MKL's product
    # on 2 threads a weight of 32k elements or more splits along K: one batched product (in the
    # tiny preset only the LM head, 4096 x 64, is that large)
    split = 0 if threads == 1 else 1
    assert one["aten::linear"] == linears - split and one["aten::bmm"] == split
    four = ops_per_decode(engine, 4)
    assert four["mkldnn::_linear_pointwise"] == linears  # several rows: every product blocked
    assert four["aten::linear"] == 0


@pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels")
@pytest.mark.usefixtures("one_torch_thread")  # (restores the count the test changes)
def test_with_the_c_kernels_a_few_rows_run_on_the_panels() -> None:
    engine = Engine(model(), default_tokenizer(), max_seq_len=128)  # cpu_kernels on: panels on every weight
    weights = packed_weights(engine.model)
    assert weights and all(w.panels is not None for w in weights)
    assert packed_bytes(engine.model) >= sum(w.panels.numel() * 4 for w in weights if w.panels is not None)
    products = ("aten::linear", "aten::mm", "aten::bmm", "mkldnn::_linear_pointwise")
    for batch in (1, 4):  # no torch product left in a decode step: the panel kernel ran them all
        ops = ops_per_decode(engine, batch)
        assert not any(ops[name] for name in products), ops
    # one thread: the panels replace the blocked copies, and run a prefill's many rows too
    assert all(w.blocked is None for w in weights)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(GenerationRequest(prompt_tokens=tuple(range(3, 43)), max_tokens=1))  # a 40-token prefill
    assert not any(e.name in products for e in prof.events())
    use_cpu_kernels(engine.model, False)  # kernels off: the panels go with them, the blocked copies come back
    assert all(w.panels is None for w in weights)
    assert all(w.blocked is not None for w in weights) == onednn_available()


@pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels")
@pytest.mark.usefixtures("one_torch_thread")  # (restores the count the test changes)
def test_on_more_threads_only_small_products_stay_on_the_panels() -> None:
    from tinyloop.model.cpu_linear import PackedWeight

    torch.set_num_threads(2)  # an engine built on two threads keeps its blocked copies
    engine = Engine(model(), default_tokenizer(), max_seq_len=128)
    assert all(w.blocked is not None for w in packed_weights(engine.model)) == onednn_available()
    torch.set_num_threads(1)
    big, small = PackedWeight(torch.randn(2048, 2048)), PackedWeight(torch.randn(64, 64))
    big.set_panels(True)
    small.set_panels(True)

    def torch_products(weight: PackedWeight, rows: int) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            weight.linear(torch.randn(rows, weight.weight.shape[1]))
        return sum(e.name in ("aten::linear", "aten::mm", "aten::bmm", "mkldnn::_linear_pointwise")
                   for e in prof.events())

    assert torch_products(big, 8) == 0 and torch_products(small, 8) == 0  # one thread: every few-row product
    assert torch_products(big, 17) > 0  # more rows than a panel call serves
    torch.set_num_threads(kernels.PANEL_MAX_THREADS + 1)
    assert torch_products(big, 8) > 0  # 32M multiply-adds: torch's threads
    assert torch_products(small, 8) == 0  # 32k: still the one-thread kernel
    assert not kernels.serves_rows(8, 2048, 2048)
    kernels.set_threads(torch.get_num_threads())  # the kernels on as many threads as torch: every product
    try:
        assert torch_products(big, 8) == 0
        assert kernels.serves_rows(8, 2048, 2048)
        engine = Engine(model(), default_tokenizer(), max_seq_len=128)  # and no blocked copies
        assert all(w.blocked is None for w in packed_weights(engine.model))
    finally:
        kernels.set_threads(1)


@pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels")
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
def test_a_panel_product_equals_f_linear(rows: int) -> None:
    from tinyloop.model.cpu_linear import PackedWeight

    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)  # 40: a short last panel
    packed = PackedWeight(weight.clone(), blocked=False)
    packed.set_panels(True)
    x = torch.randn(rows, 1, 24, generator=gen)
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.linear(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch build")
def test_the_server_setting_turns_packing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinyloop.server import load_engine
    from tinyloop.settings import Settings

    monkeypatch.setenv("TINYLOOP_PACK_WEIGHTS", "0")
    off = load_engine(Settings.from_env())
    assert packed_bytes(off.model) == 0
    assert not any(isinstance(m, PackedLinear) for m in off.model.modules())
    assert packed_bytes(load_engine(Settings()).model) > 0


@pytest.mark.parametrize("k", [64, 63])
def test_a_split_one_row_product_equals_f_linear_with_bias(threads: int, k: int) -> None:
    from tinyloop.model.cpu_linear import PackedWeight, split_parts

    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(1024, k, generator=gen)  # more outputs than inputs: column-major on any threads
    bias, x = torch.randn(1024, generator=gen), torch.randn(1, 1, k, generator=gen)
    packed = PackedWeight(weight.clone(), blocked=False)
    assert split_parts(k) == (threads if k % threads == 0 else 1)
    assert packed.splittable  # 64k elements: worth splitting where there are threads
    assert not PackedWeight(torch.randn(64, 64), blocked=False).splittable  # too small to pay
    empty = torch.empty(0, 1, k)  # no rows: what F.linear gives
    assert packed.linear(empty, bias).shape == (0, 1, 1024)
    for b in (bias, None):
        torch.testing.assert_close(packed.linear(x, b), torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
