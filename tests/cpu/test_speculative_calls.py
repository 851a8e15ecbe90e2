"""A speculative step's two C calls on the CPU: a lone greedy chain drafts in one burst
(``Drafter._burst``, ``tl_decode_burst`` with the draft's stop below ``draft_min_prob``) and a
chain is verified as one-token rows of its sequence (``Speculator._verify_rows``), the plain
decode step's whole-step call. The drafts are those drafted step by step, the verifier's logits
those of the T-token forward, and the output that of plain decoding, in the layouts, weights
and KV pools the whole step covers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.cpu.test_fused_step import LAYOUTS
from tests.engine.test_engine import make_engine, req
from tinyloop.cpu import kernels
from tinyloop.engine.drafting import Drafter
from tinyloop.engine.engine import Engine
from tinyloop.engine.speculative import Speculator
from tinyloop.requests import GenerationRequest, GenerationResult, SamplingParams

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels"),
              pytest.mark.usefixtures("one_torch_thread")]

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
CHAINS = [req([5, 6, 7], max_tokens=20, loops=4, mode="speculative", sampling=GREEDY, draft_loops=1, draft_ahead=4),
          req(list(range(10, 31)), max_tokens=14, loops=3, mode="speculative", sampling=GREEDY, draft_loops=2,
              draft_ahead=8)]


def build(layout: str = "default", weights: str = "float", **options: Any) -> Engine:
    return make_engine(LAYOUTS[layout], max_seq_len=128, block_size=8, weights=weights, **options)


def plain(eng: Engine, request: GenerationRequest) -> list[int]:
    return eng.generate(req(list(request.prompt_tokens), max_tokens=request.max_tokens, loops=request.loops,
                            sampling=GREEDY)).tokens


@pytest.fixture
def trees(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """Every verified chain's tokens (the pending token, then the drafts)."""
    seen: list[tuple[int, ...]] = []
    verify = Speculator._verify

    def recording(self: Speculator, jobs: list[Any]) -> torch.Tensor:
        seen.extend(tuple(job.tree.tokens) for job in jobs)
        return verify(self, jobs)
    monkeypatch.setattr(Speculator, "_verify", recording)
    yield seen


def drafted(eng: Engine, requests: list[GenerationRequest], seen: list[tuple[int, ...]],
            monkeypatch: pytest.MonkeyPatch, burst: bool) -> tuple[list[tuple[int, ...]], list[GenerationResult]]:
    """Each request alone; the chains verified, and the results. ``burst=False``: drafted step by step."""
    seen.clear()
    with monkeypatch.context() as patch:
        if not burst:
            patch.setattr(Drafter, "_burst", lambda self, job: False)
        out = [eng.generate(r) for r in requests]
    return list(seen), out


@pytest.mark.parametrize(("layout", "weights", "options"), [
    ("default", "float", {}), ("zeros", "float", {}), ("embed", "float", {}), ("no_coda", "int8", {}),
    ("default", "int4", {"kv_mode": "int4"}), ("default", "float", {"draft_weights": "int8"}),
    ("prelude_norm", "bf16", {}),
])
@pytest.mark.parametrize("min_prob", [0.0, 0.2, 0.9])
def test_a_lone_chain_drafts_in_one_call_what_it_drafts_step_by_step(
        layout: str, weights: str, options: dict[str, Any], min_prob: float, trees: list[tuple[int, ...]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng, twin = (build(layout, weights, draft_min_prob=min_prob, **options) for _ in range(2))
    before = eng.draft_model.counters["bursts"]
    burst_trees, burst_out = drafted(eng, CHAINS, trees, monkeypatch, burst=True)
    assert eng.draft_model.counters["bursts"] - before == len(burst_trees)  # every chain in one call
    step_trees, step_out = drafted(twin, CHAINS, trees, monkeypatch, burst=False)
    assert burst_trees == step_trees
    for request, a, b in zip(CHAINS, burst_out, step_out, strict=True):
        assert a.tokens == b.tokens == plain(eng, request)
    if min_prob == 0.9:  # the unsure stop ended chains early (and min_prob 0 never does)
        assert any(len(t) - 1 < 4 for t in burst_trees)


@pytest.mark.parametrize(("layout", "weights", "kv_mode", "step"), [
    ("default", "float", None, True), ("zeros", "float", "int4", True), ("no_prelude", "int8", None, True),
    ("default", "int4", None, True), ("default", "float", None, False), ("zeros", "int8", "int4", False),
])
def test_chains_verified_as_rows_score_as_the_chunk_forward(layout: str, weights: str, kv_mode: str | None,
                                                            step: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each verify runs both ways on the same KV (each writes the positions before reading
    them); the rows' logits are the chunk's to float rounding (quantised products: their
    activations' rounding), through the whole-step call, or (``step`` False) the blocks' modules."""
    eng = build(layout, weights, kv_mode=kv_mode)
    if not step:
        eng.model.fused_step = None
    compared: list[int] = []

    def both(self: Speculator, jobs: list[Any]) -> torch.Tensor:
        trees = [job.tree for job in jobs]
        steps = eng.model.counters["fused_steps"]
        rows = self._verify_rows(jobs, trees)
        assert eng.model.counters["fused_steps"] == steps + step
        chunk = eng.verify([j.seq for j in jobs], [list(t.tokens) for t in trees])
        tolerance = 1e-4 if weights == "float" and kv_mode is None else 3e-2
        torch.testing.assert_close(rows, chunk, rtol=tolerance, atol=tolerance)
        compared.append(rows.shape[0] * rows.shape[1])
        return rows
    monkeypatch.setattr(Speculator, "_verify", both)
    out = eng.generate_many(CHAINS)  # the two chains in one verify call (when their lengths match)
    for request, result in zip(CHAINS, out, strict=True):
        assert result.tokens == plain(eng, request)
    assert compared


def test_two_speculative_sequences_draft_together_and_verify_as_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chains in a step draft in the batched forwards (a burst is one sequence's), and their
    rows share the verify call; each output is plain decoding's."""
    eng = build()
    same = [req(list(range(10 + i, 20 + i)), max_tokens=12, loops=3, mode="speculative", sampling=GREEDY,
                draft_loops=1, draft_ahead=4) for i in range(2)]
    drafting, verifying = [], []
    forward, verify = Drafter._forward, Speculator._verify_rows

    def draft_rows(self: Drafter, rows: list[Any]) -> torch.Tensor:
        drafting.append(len({id(r.job) for r in rows}))
        return forward(self, rows)

    def verify_rows(self: Speculator, jobs: list[Any], trees: list[Any]) -> torch.Tensor:
        verifying.append(len(jobs))
        return verify(self, jobs, trees)
    monkeypatch.setattr(Drafter, "_forward", draft_rows)
    monkeypatch.setattr(Speculator, "_verify_rows", verify_rows)
    out = eng.generate_many(same)
    assert 2 in drafting and 2 in verifying
    for request, result in zip(same, out, strict=True):
        assert result.tokens == plain(eng, request)
