"""Work per decode step, counted (never timed): the ops a layer dispatches and how the KV is read."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from torch import nn
from torch.profiler import ProfilerActivity, profile

from tinyloop.cpu import kernels
from tinyloop.engine.engine import Engine
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer

LOOPS = 3


def decode_ops(batch: int, cpu_kernels: bool = True) -> tuple[Counter[str], int]:
    """Top-level aten ops of one decode step of ``batch`` rows, and the layer calls it made."""
    engine = Engine(init_model(PRESETS["tiny"].replace(max_position=128), seed=0), default_tokenizer(),
                    max_seq_len=128, cpu_kernels=cpu_kernels)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    seqs = [engine.start(GenerationRequest(prompt_tokens=tuple(range(5, 25 + b)), max_tokens=8, loops=LOOPS,
                                           sampling=greedy)) for b in range(batch)]
    engine.step(seqs)  # prefill and first token
    engine.step(seqs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step(seqs)
    nested = ("aten::", "mkldnn::")
    top = Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                  and (e.cpu_parent is None or not e.cpu_parent.name.startswith(nested)))
    c = engine.config
    return top, c.n_prelude + LOOPS * c.n_core + c.n_coda


def test_a_decode_step_dispatches_few_ops_per_layer() -> None:
    for batch in (1, 4):
        ops, layers = decode_ops(batch)
        # about 120 per layer before the CPU pass (rms_norm as 9 ops, block tables re-indexed per
        # layer), 76-79 after it; 50-56 once q and k share one RoPE call, slots are ints, the
        # random initial states are kept and attention at equal lengths takes no mask
        assert sum(ops.values()) <= 60 * layers, (batch, sum(ops.values()) / layers, ops.most_common(12))


def test_the_kv_is_read_by_row_copies_once_per_field_and_layer() -> None:
    ops, layers = decode_ops(4, cpu_kernels=False)
    # K and V: a row copy, not advanced indexing; and once a step RoPE's cos and sin at the new positions
    assert ops["aten::index_select"] == 2 * layers + 2
    # rows sharing a window find each layer's write and key rows by an int slot: no index op per
    # layer (2 per layer before), a few per step (sampling, the context's tables)
    assert ops["aten::index"] <= 6, ops["aten::index"]


def test_a_decode_step_calls_no_module_hook_machinery_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nn.Module.__call__`` costs about a small op; blocks, norms, attention, MLP and the
    packed linears are called straight to ``forward`` (``layers.HookFree``)."""
    engine = Engine(init_model(PRESETS["tiny"].replace(max_position=128), seed=0), default_tokenizer(),
                    max_seq_len=128)
    seqs = [engine.start(GenerationRequest(prompt_tokens=(5, 6, 7), max_tokens=8, loops=LOOPS,
                                           sampling=SamplingParams(temperature=0, ignore_eos=True)))]
    engine.step(seqs)
    calls: Counter[str] = Counter()
    wrapped = nn.Module._call_impl

    def counting(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls[type(self).__name__] += 1
        return wrapped(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "_call_impl", counting)
    monkeypatch.setattr(nn.Module, "__call__", counting)
    engine.step(seqs)
    assert sum(calls.values()) <= 2, calls  # the embedding, the model itself


@pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels")
def test_on_the_cpu_kernel_decode_copies_no_kv() -> None:
    ops, _ = decode_ops(4)
    # the kernel reads the pool's rows in place: only RoPE's cos and sin rows are taken, once a step
    assert ops["aten::index_select"] == 2
    assert ops["aten::scaled_dot_product_attention"] == 0
