"""One sequence's failure stays its own: the rest of the batch decodes exactly as it would alone."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import pytest
import torch

from tests.engine.test_engine import make_engine, req
from tinyloop.engine.beam import BeamState
from tinyloop.engine.engine import Engine
from tinyloop.engine.sequence import Sequence
from tinyloop.engine.speculative import counters
from tinyloop.errors import EngineBroken, EngineError
from tinyloop.requests import GenerationRequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GOOD = [req([5 + i, 6, 7], max_tokens=10, loops=1 + i % 3,
            sampling=SamplingParams(temperature=0.8, seed=i, ignore_eos=True)) for i in range(4)]
POISON = req([90, 91, 92], max_tokens=10, loops=2, sampling=SamplingParams(temperature=0.8, seed=7))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(max_seq_len=256, block_size=8)


def run_batch(eng: Engine, reqs: Seq[GenerationRequest]) -> list[Sequence]:
    seqs = [eng.start(r) for r in reqs]
    while not all(s.finished for s in seqs):
        eng.step([s for s in seqs if not s.finished])
    return seqs


def finish(eng: Engine, seqs: list[Sequence]) -> list[list[int]]:
    for s in seqs:
        eng.free(s)
    assert eng.kv_statistics().blocks_used == 0
    return [s.output for s in seqs]


def is_poison(seq: Sequence) -> bool:
    return seq.request.request_id == POISON.request_id


def patched(eng: Engine, name: str, wrap: Callable[[Any], Any]) -> None:
    """Shadow one engine method on the instance (undone by the caller's monkeypatch)."""
    setattr(eng, name, wrap(getattr(eng, name)))


def expect_only_poison_failed(eng: Engine, seqs: list[Sequence], error: type[BaseException]) -> None:
    solo = [eng.generate(r).tokens for r in GOOD]
    poison = seqs[-1]
    assert isinstance(poison.error, error) and poison.finish_reason == "error"
    assert all(s.error is None for s in seqs[:-1])
    assert finish(eng, seqs)[:-1] == solo


def test_a_nan_logits_row_fails_its_sequence_alone(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def nan_rows(decode: Any) -> Any:
        def run(seqs: Seq[Sequence]) -> torch.Tensor:
            logits = decode(seqs).clone()
            for row, s in enumerate(seqs):
                if is_poison(s) and len(s.output) >= 2:
                    logits[row] = float("nan")
            return logits
        return run
    monkeypatch.setattr(engine, "decode", nan_rows(engine.decode))
    seqs = run_batch(engine, [*GOOD, POISON])
    assert len(seqs[-1].output) == 2  # it ran, then its row went bad
    monkeypatch.undo()
    expect_only_poison_failed(engine, seqs, EngineError)


def test_a_penalty_that_overflows_the_sampler_fails_its_sequence_alone(engine: Engine) -> None:
    # the probe's request (repetition_penalty 1e-40 at temperature 1), past the schema's bounds
    poison = req([90, 91, 92], max_tokens=10, sampling=SamplingParams(temperature=1.0, seed=7))
    object.__setattr__(poison.sampling, "repetition_penalty", 1e-40)
    seqs = run_batch(engine, [*GOOD, poison])
    solo = [engine.generate(r).tokens for r in GOOD]
    assert isinstance(seqs[-1].error, EngineError)
    assert finish(engine, seqs)[:-1] == solo


def test_a_failing_stop_check_fails_its_sequence_alone(engine: Engine) -> None:
    seqs = [engine.start(r) for r in [*GOOD, POISON]]

    class BrokenMatcher:
        def feed(self, text: str) -> Any:
            raise UnicodeError("detokenizer state lost")
    seqs[-1].stop_matcher = BrokenMatcher()  # type: ignore[assignment]
    while not all(s.finished for s in seqs):
        engine.step([s for s in seqs if not s.finished])
    expect_only_poison_failed(engine, seqs, EngineError)


def test_a_batched_forward_that_raises_is_retried_one_sequence_at_a_time(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def failing_with_poison(decode: Any) -> Any:
        def run(seqs: Seq[Sequence]) -> torch.Tensor:
            calls.append(len(seqs))
            if any(is_poison(s) for s in seqs) and any(len(s.output) >= 3 for s in seqs if is_poison(s)):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return decode(seqs)
        return run
    monkeypatch.setattr(engine, "decode", failing_with_poison(engine.decode))
    seqs = run_batch(engine, [*GOOD, POISON])
    monkeypatch.undo()
    assert 1 in calls  # the survivors were retried alone
    assert "illegal memory access" in str(seqs[-1].error)
    expect_only_poison_failed(engine, seqs, EngineError)


def test_a_broken_engine_still_fails_the_whole_step(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(decode: Any) -> Any:
        def run(seqs: Seq[Sequence]) -> torch.Tensor:
            raise EngineBroken("device lost")
        return run
    monkeypatch.setattr(engine, "decode", broken(engine.decode))
    seqs = [engine.start(r) for r in GOOD]
    engine.step(seqs)  # prefill: no decode yet
    with pytest.raises(EngineBroken):
        engine.step(seqs)
    monkeypatch.undo()
    for s in seqs:
        engine.free(s)


def test_speculation_bookkeeping_that_raises_fails_its_sequence_alone(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = [req([5 + i, 6, 7], max_tokens=12, loops=4, mode="speculative", draft_loops=1, draft_ahead=3,
                sampling=SamplingParams(temperature=0, ignore_eos=True)) for i in range(3)]
    poison = req([90, 91, 92], max_tokens=12, loops=4, mode="speculative", draft_loops=1, draft_ahead=3,
                 sampling=SamplingParams(temperature=0, ignore_eos=True))
    commit = engine.batch.speculative.speculator._commit

    def failing_commit(job: Any, logits: torch.Tensor) -> Any:
        if job.seq.request.request_id == poison.request_id:
            raise IndexError("draft tree out of step with the KV")
        return commit(job, logits)
    monkeypatch.setattr(engine.batch.speculative.speculator, "_commit", failing_commit)
    seqs = run_batch(engine, [*spec, poison])
    monkeypatch.undo()
    solo = [engine.generate(r).tokens for r in spec]
    assert isinstance(seqs[-1].error, EngineError) and "draft tree" in str(seqs[-1].error)
    assert finish(engine, seqs)[:-1] == solo
    assert all(counters(s).drafted > 0 for s in seqs[:-1])


def test_a_step_drafts_at_most_max_draft_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine(max_seq_len=256, block_size=8, max_draft_nodes=12)
    wide = req([5, 6, 7], max_tokens=30, loops=4, mode="tree", draft_loops=1, draft_ahead=64, k_branches=16,
               sampling=SamplingParams(temperature=0, ignore_eos=True))
    chain = req([8, 9], max_tokens=30, loops=4, mode="speculative", draft_loops=1, draft_ahead=64,
                sampling=SamplingParams(temperature=0, ignore_eos=True))
    verified: list[int] = []
    verify = eng.batch.speculative.speculator._verify

    def counting(jobs: Any) -> torch.Tensor:
        verified.append(sum(len(j.tree) - 1 for j in jobs))
        return verify(jobs)
    monkeypatch.setattr(eng.batch.speculative.speculator, "_verify", counting)
    seqs = run_batch(eng, [wide, chain])
    monkeypatch.undo()
    assert verified and max(verified) <= 12  # not 64 * 16 + 64
    assert finish(eng, seqs) == [eng.generate(r).tokens for r in (wide, chain)]
    plain = [eng.generate(GenerationRequest(prompt_tokens=r.prompt_tokens, max_tokens=30, loops=4,
                                            sampling=r.sampling)).tokens for r in (wide, chain)]
    assert [s.output for s in seqs] == plain


def test_beam_bookkeeping_that_raises_fails_its_search_alone(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    searches = [req([5 + i, 6, 7], max_tokens=8, mode="beam", num_beams=3, sampling=greedy) for i in range(2)]
    poison = req([90, 91, 92], max_tokens=8, mode="beam", num_beams=3, sampling=greedy)
    extend = engine.batch.beam.search._extend

    def failing_extend(seq: Sequence, logits: torch.Tensor) -> Any:
        if seq.request.request_id == poison.request_id and isinstance(seq.mode_state, BeamState) \
                and seq.mode_state.live and len(seq.mode_state.live[0].tokens) >= 2:
            raise KeyError("beam lost its parent")
        return extend(seq, logits)
    monkeypatch.setattr(engine.batch.beam.search, "_extend", failing_extend)
    seqs = run_batch(engine, [*GOOD[:2], *searches, poison])
    monkeypatch.undo()
    solo = [engine.generate(r).tokens for r in [*GOOD[:2], *searches]]
    assert isinstance(seqs[-1].error, EngineError) and "parent" in str(seqs[-1].error)
    assert all(s.error is None for s in seqs[:-1])
    assert finish(engine, seqs)[:-1] == solo


def poison_kv(eng: Engine, seq: Sequence) -> None:
    """Every position of every block ``seq`` holds turned to NaN (a request whose K and V diverged)."""
    blocks = torch.tensor(sorted({b for table in seq.kv.tables for b in table}), dtype=torch.long)
    for field in eng.pool.store.fields.values():
        for t in field.tensors:
            t.view(-1, eng.pool.block_size * t[0].numel())[blocks] = float("nan")


LONG = req(list(range(30, 62)), max_tokens=6, loops=2, sampling=SamplingParams(temperature=0.8, seed=3))


def test_a_shorter_row_never_reads_another_sequences_kv() -> None:
    """A batch pads the block tables of its shorter rows; the padding is masked, and it must not
    point at a block another sequence holds: a NaN there would turn the masked row into NaN too."""
    eng = make_engine(max_seq_len=256, block_size=8)
    long = eng.start(LONG)  # the first blocks of the pool (a fresh pool hands out block 0 first)
    short = eng.start(GOOD[0])
    eng.step([long, short])  # both prefilled: the short one holds fewer blocks per slot
    assert short.kv.blocks_per_slot < long.kv.blocks_per_slot
    poison_kv(eng, long)
    seqs = [long, short]
    while not short.finished:
        eng.step([s for s in seqs if not s.finished])
    assert short.error is None and isinstance(long.error, EngineError)  # the poisoned one failed alone
    assert finish(eng, seqs)[1] == eng.generate(GOOD[0]).tokens


def test_a_freed_blocks_old_values_never_reach_its_next_owner() -> None:
    """A block is handed out again with zeros: what its last owner left past the new owner's
    length is read (masked) when a longer row shares the batch, and a NaN there would spread."""
    eng = make_engine(max_seq_len=256, block_size=8, prefix_caching=False)  # freed blocks go straight back
    long = eng.start(LONG)
    gone = eng.start(req(list(range(5, 15)), max_tokens=2, loops=2, sampling=SamplingParams(temperature=0)))
    eng.step([long, gone])
    poison_kv(eng, gone)
    held = {b for t in gone.kv.tables for b in t}
    eng.free(gone)  # its blocks go back to the free list, NaN and all
    short = eng.start(GOOD[1])
    seqs = [long, short]
    eng.step(seqs)
    assert {b for t in short.kv.tables for b in t} & held  # it took some (the most recently freed first)
    assert short.kv.length % eng.pool.block_size  # and its last blocks hold positions past its length
    while not all(s.finished for s in seqs):
        eng.step([s for s in seqs if not s.finished])
    assert all(s.error is None for s in seqs)
    assert finish(eng, seqs)[1] == eng.generate(GOOD[1]).tokens
