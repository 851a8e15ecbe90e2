"""Work per decode step, counted (never timed): the ops a layer dispatches and how the KV is read."""

from __future__ import annotations

from collections import Counter

from torch.profiler import ProfilerActivity, profile

from tinyloop.engine.engine import Engine
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.tokenizer import default_tokenizer

LOOPS = 3


def decode_ops(batch: int) -> tuple[Counter[str], int]:
    """Top-level aten ops of one decode step of ``batch`` rows, and the layer calls it made."""
    engine = Engine(init_model(PRESETS["tiny"].replace(max_position=128), seed=0), default_tokenizer(),
                    max_seq_len=128)
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
        # about 120 per layer before the CPU pass (rms_norm as 9 ops, block tables re-indexed per layer)
        assert sum(ops.values()) <= 90 * layers, (batch, sum(ops.values()) / layers, ops.most_common(12))


def test_the_kv_is_read_by_row_copies_once_per_field_and_layer() -> None:
    ops, layers = decode_ops(4)
    assert ops["aten::index_select"] == 2 * layers  # K and V: a row copy, not advanced indexing
    assert ops["aten::index"] <= 2 * layers + 6  # the per-slot write and key rows, sampling
