"""Batched prefill (``prefill.py``): the plain sequences prefilling in one step share one forward,
and every output is the one a prefill of its own gives (greedy tokens equal, logits to float32
rounding), in every mode and option the engine has."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.test_engine import make_engine, req
from tinyloop.engine.engine import Engine
from tinyloop.engine.sequence import Sequence
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.vocabulary import ExitRule

GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def prompts(*lengths: int, base: int = 10) -> list[list[int]]:
    return [[(base + 7 * i + j) % 900 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def count_forwards(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every model forward the engine runs from now on."""
    rows: list[int] = []
    run_model = engine.run_model

    def counted(tokens: torch.Tensor, *args: Any, **kw: Any) -> Any:
        rows.append(tokens.shape[0])
        return run_model(tokens, *args, **kw)
    monkeypatch.setattr(engine, "run_model", counted)
    return rows


def first_logits(engine: Engine, reqs: list[GenerationRequest],
                 together: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each request's prompt logits and warm state, the prompts prefilled together
    (``Batch.prefill``) or one at a time (``Engine.prefill``)."""
    seqs = [engine.start(r) for r in reqs]
    got: dict[int, torch.Tensor] = {}
    try:
        if together:
            while any(s.prefilling for s in seqs):
                for s, logits in engine.batch.prefill.run([s for s in seqs if s.prefilling]):
                    assert s.error is None
                    if logits is not None:
                        got[id(s)] = logits.clone()
        else:
            got = {id(s): engine.prefill(s).clone() for s in seqs}
    finally:
        for s in seqs:
            engine.free(s)
    return [(got[id(s)], s.warm_state) for s in seqs]


def expect_same_as_alone(engine: Engine, reqs: list[GenerationRequest], monkeypatch: pytest.MonkeyPatch) -> None:
    alone = first_logits(engine, reqs, together=False)
    rows = count_forwards(engine, monkeypatch)
    together = first_logits(engine, reqs, together=True)
    monkeypatch.undo()
    assert max(rows) > 1  # some prefilled together
    for (a, warm_a), (b, warm_b) in zip(alone, together):
        assert int(a.argmax()) == int(b.argmax())
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert (warm_a is None) == (warm_b is None)
        if warm_a is not None and warm_b is not None:
            torch.testing.assert_close(warm_b, warm_a, rtol=1e-5, atol=1e-5)
    batched = engine.generate_many(reqs)
    assert [r.tokens for r in batched] == [engine.generate(r).tokens for r in reqs]
    assert engine.kv_statistics().blocks_used == 0


def test_sequences_prefilling_together_share_one_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(max_seq_len=256, block_size=4, prefix_caching=False)
    reqs = [req(p, max_tokens=3, loops=3, sampling=GREEDY) for p in prompts(5, 21, 13, 2)]
    seqs = [engine.start(r) for r in reqs]
    rows = count_forwards(engine, monkeypatch)
    events = engine.step(seqs)
    assert rows == [4]  # one forward of four rows (a prefill each would be four forwards)
    assert len(events) == 4 and all(s.error is None for s in seqs)
    assert [s.kv.length for s in seqs] == [5, 21, 13, 2]
    # the blocks reserved for the pads went back: each holds what its own prefill leaves
    assert [s.kv.blocks_per_slot for s in seqs] == [2, 6, 4, 1]
    assert engine.prefilled_tokens == 41
    for s in seqs:
        engine.free(s)


def test_only_plain_sequences_of_the_same_loops_and_window_share(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(max_seq_len=256, prefix_caching=False)
    p = prompts(4, 6, 8, 5, 7)
    reqs = [req(p[0], loops=3), req(p[1], loops=3), req(p[2], loops=2), req(p[3], loops=3, cache_window=1),
            req(p[4], loops=3, mode="beam", num_beams=2, sampling=GREEDY)]
    seqs = [engine.start(r) for r in reqs]
    rows = count_forwards(engine, monkeypatch)
    engine.step(seqs)
    assert sorted(rows) == [1, 1, 1, 2]
    for s in seqs:
        engine.free(s)


CASES: dict[str, tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]] = {
    # name: (engine options, model config changes, per-request options over prompts(...))
    "plain": ({}, {}, [{}]),
    "one_token_prompt": ({}, {}, [{}]),
    "zeros_state_init": ({}, {"state_init": "zeros"}, [{}]),
    "warm_start": ({}, {}, [{"warm_start": True}, {"warm_start": True, "warm_start_from": "normed"}]),
    "cache_window": ({}, {}, [{"loops": 4, "cache_window": 2}]),
    "kv_int4": ({"kv_mode": "int4"}, {}, [{}]),
    "kv_h_mode": ({"kv_mode": "h-mode"}, {}, [{}]),
    "kv_h_mode_int4": ({"kv_mode": "h-mode+int4"}, {}, [{}]),
    "chunked": ({"prefill_chunk": 4}, {}, [{}]),
    "stop_rule": ({}, {}, [{"loops": 6, "exit": ExitRule.of("latent_diff", 0.5, exited_kv="skip")}]),
    "stop_rule_copy": ({"prefill_chunk": 3}, {}, [{"loops": 6, "exit": ExitRule.of("kl", 0.05)}]),
    "gate_select": ({}, {"exit_gate": True}, [{"loops": 4, "exit": ExitRule.of("gate_select", 0.5)}]),
    "gate_expected": ({"prefill_chunk": 5}, {"exit_gate": True, "n_coda": 0},
                      [{"loops": 4, "exit": ExitRule.of("gate_expected")}]),
}
LENGTHS = {"one_token_prompt": (1, 1, 9, 1), "chunked": (3, 11, 4, 7, 9), "stop_rule": (1, 1, 6, 4),
           "stop_rule_copy": (1, 4, 7), "gate_expected": (5, 9, 12, 5)}


@pytest.mark.parametrize("case", list(CASES))
def test_batched_prefill_gives_what_each_prefill_alone_gives(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    options, changes, per_request = CASES[case]
    engine = make_engine(changes, max_seq_len=256, block_size=4, prefix_caching=False, **options)
    lengths = LENGTHS.get(case, (3, 17, 8, 12, 2))
    reqs = [req(p, max_tokens=5, sampling=GREEDY, **({"loops": 3} | per_request[i % len(per_request)]))
            for i, p in enumerate(prompts(*lengths))]
    expect_same_as_alone(engine, reqs, monkeypatch)


def test_prefix_cache_hits_of_different_lengths_prefill_together(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(max_seq_len=256, block_size=4)
    shared = prompts(20)[0]
    engine.generate(req(shared, max_tokens=1, loops=3, sampling=GREEDY))  # its full blocks stay cached
    reqs = [req(shared[:n] + tail, max_tokens=5, loops=3, sampling=GREEDY)
            for n, tail in [(9, [7, 8, 9]), (16, [5]), (4, [1, 2, 3, 4, 5, 6]), (20, [11, 12])]]
    seqs = [engine.start(r) for r in reqs]
    assert [s.cached_tokens for s in seqs] == [8, 16, 4, 20]
    rows = count_forwards(engine, monkeypatch)
    engine.step(seqs)
    assert rows == [4]
    for s in seqs:
        engine.free(s)
    monkeypatch.undo()
    expect_same_as_alone(engine, reqs, monkeypatch)
    cold = make_engine(max_seq_len=256, block_size=4, prefix_caching=False)
    assert [r.tokens for r in engine.generate_many(reqs)] == [r.tokens for r in cold.generate_many(reqs)]


def test_resumed_sequences_prefill_together_and_decode_on(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(max_seq_len=256, block_size=4, prefix_caching=False)
    reqs = [req(p, max_tokens=8, loops=3, sampling=GREEDY) for p in prompts(5, 13, 9)]
    expected = [engine.generate(r).tokens for r in reqs]
    seqs = [engine.start(r) for r in reqs]
    for _ in range(3):
        engine.step(seqs)
    for s in seqs:
        engine.preempt(s)
    rows = count_forwards(engine, monkeypatch)
    engine.step(seqs)
    assert rows[0] == 3  # the three rebuild their KV in one forward
    while not all(s.finished for s in seqs):
        engine.step([s for s in seqs if not s.finished])
    assert [s.output for s in seqs] == expected
    for s in seqs:
        engine.free(s)


def test_a_group_that_does_not_fit_the_free_blocks_prefills_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(max_seq_len=64, block_size=4, prefix_caching=False, kv_cache_mb=0.2)
    reqs = [req(p, max_tokens=2, loops=3, sampling=GREEDY) for p in prompts(2, 30)]
    seqs = [engine.start(r) for r in reqs]
    need_alone = sum(s.kv.blocks_to_reserve(len(s.prompt)) for s in seqs)
    padded = sum(s.kv.blocks_to_reserve(30) for s in seqs)
    hold = engine.pool.allocate(engine.pool.free_blocks - (need_alone + padded) // 2)
    rows = count_forwards(engine, monkeypatch)
    engine.step(seqs)
    assert sorted(rows) == [1, 1] and all(s.error is None for s in seqs)
    engine.pool.release(hold)
    for s in seqs:
        engine.free(s)


def test_a_batched_prefill_that_raises_is_retried_one_sequence_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(max_seq_len=256, block_size=4, prefix_caching=False)
    reqs = [req(p, max_tokens=4, loops=3, sampling=GREEDY) for p in prompts(5, 13, 9)]
    expected = [engine.generate(r).tokens for r in reqs]
    forward = engine.forward

    def failing(seqs: list[Sequence], *args: Any, **kw: Any) -> Any:
        if len(seqs) > 1:
            forward(seqs, *args, **kw)  # the rows stored their KV, then the call fails
            raise RuntimeError("out of memory")
        return forward(seqs, *args, **kw)
    monkeypatch.setattr(engine, "forward", failing)
    seqs = [engine.start(r) for r in reqs]
    engine.step(seqs)
    assert [s.kv.length for s in seqs] == [5, 13, 9] and all(s.error is None for s in seqs)
    assert [s.kv.blocks_per_slot for s in seqs] == [2, 4, 3]
    monkeypatch.undo()
    while not all(s.finished for s in seqs):
        engine.step([s for s in seqs if not s.finished])
    assert [s.output for s in seqs] == expected
    for s in seqs:
        engine.free(s)
