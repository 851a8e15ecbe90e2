"""Self-speculative decoding (chain and tree) against plain decoding at the verifier's loops.

Greedy: the same tokens, token for token, whatever the draft. Sampled: the same distribution,
checked with a chi-square test on the joint distribution of three sampled tokens, against the
exact distribution of plain sampling computed from the model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tinyloop.engine.speculative as speculative
from tests.engine.test_engine import make_engine, req
from tinyloop.engine.acceptance import DraftTree
from tinyloop.engine.engine import Engine
from tinyloop.engine.sampling import make_generator, target_probs
from tinyloop.engine.speculative import counters
from tinyloop.errors import ConfigError, RequestError
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationChunk, GenerationRequest, SamplingParams
from tinyloop.settings import Settings
from tinyloop.tokenizer import default_tokenizer

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
PROMPT = list(range(30, 40))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = make_engine(max_seq_len=256, block_size=8)
    yield eng
    assert eng.kv_statistics().blocks_used == 0


_plain_cache: dict[tuple[Any, ...], list[int]] = {}


def plain(engine: Engine, prompt: list[int], loops: int, max_tokens: int = 24) -> list[int]:
    key = (tuple(prompt), loops, max_tokens)
    if key not in _plain_cache:
        _plain_cache[key] = engine.generate(req(prompt, max_tokens=max_tokens, loops=loops,
                                                sampling=GREEDY)).tokens
    return _plain_cache[key]


@pytest.fixture
def verified(monkeypatch: pytest.MonkeyPatch) -> list[DraftTree]:
    """Records every tree the verifier scores."""
    trees: list[DraftTree] = []
    original = speculative.Speculator._verify

    def recording(self: speculative.Speculator, jobs: list[Any]) -> torch.Tensor:
        trees.extend(job.tree for job in jobs)
        return original(self, jobs)

    monkeypatch.setattr(speculative.Speculator, "_verify", recording)
    return trees


def deep_siblings(tree: DraftTree) -> bool:
    """Two nodes at depth >= 2 with the same parent."""
    parents = [p for p, d in zip(tree.parents, tree.depths) if d >= 2]
    return len(parents) > len(set(parents))


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts KV moves: a tree whose accepted branch is not stored right after the root."""
    calls: list[int] = []
    original = speculative._move_positions

    def counting(*args: Any) -> None:
        calls.append(len(args[1]))
        original(*args)

    monkeypatch.setattr(speculative, "_move_positions", counting)
    return calls


SETTINGS = [
    ("speculative", dict(draft_loops=1, draft_ahead=4)),
    ("speculative", dict(draft_loops=3, draft_ahead=8)),
    ("speculative", dict(draft_loops=4, draft_ahead=5)),  # the draft is the verifier: all accepted
    ("tree", dict(draft_loops=1, draft_ahead=3, k_branches=3)),
    ("tree", dict(draft_loops=2, draft_ahead=4, k_branches=4)),
    ("tree", dict(draft_loops=3, draft_ahead=2, k_branches=2)),
]


@pytest.mark.parametrize(("mode", "extra"), SETTINGS)
def test_greedy_speculation_equals_plain_greedy(engine: Engine, mode: str, extra: dict[str, int]) -> None:
    out = engine.generate(req(PROMPT, max_tokens=24, loops=4, mode=mode, sampling=GREEDY, **extra))
    assert out.tokens == plain(engine, PROMPT, 4)
    assert out.mean_loops == 4 and out.completion_tokens == 24
    assert out.draft_tokens is not None and out.accepted_draft_tokens is not None
    assert out.draft_tokens == out.accepted_draft_tokens + out.rejected_draft_tokens
    assert out.accepted_draft_tokens <= out.completion_tokens - 1  # the first comes from prefill
    if extra["draft_loops"] == 4:  # a perfect draft: every drafted token accepted
        assert out.rejected_draft_tokens == 0 and out.accepted_draft_tokens == out.draft_tokens > 0
    assert engine.kv_statistics().blocks_used == 0


def test_tree_branches_other_than_the_first_are_accepted_and_moved(engine: Engine, moves: list[int]) -> None:
    for mode_extra in [dict(draft_loops=1, draft_ahead=3, k_branches=3),
                       dict(draft_loops=2, draft_ahead=4, k_branches=4)]:
        out = engine.generate(req(PROMPT, max_tokens=24, loops=4, mode="tree", sampling=GREEDY, **mode_extra))
        assert out.tokens == plain(engine, PROMPT, 4)
    assert moves  # the tokens after a moved path read the moved KV: equality covers them


def test_tree_branches_at_every_depth_and_keeps_greedy_output(engine: Engine, verified: list[DraftTree]) -> None:
    extra = dict(draft_loops=1, draft_ahead=4, k_branches=3)
    out = engine.generate(req(PROMPT, max_tokens=24, loops=4, mode="tree", sampling=GREEDY, **extra))
    assert out.tokens == plain(engine, PROMPT, 4)
    assert any(deep_siblings(t) for t in verified)
    for tree in verified:  # the node budget: K per level, draft_ahead levels
        assert max(tree.depths) <= 4 and len(tree) <= 1 + 3 * 4
        assert all(tree.depths.count(d) <= 3 for d in range(1, 5))
        siblings = [tuple(tree.tokens[c] for c in tree.children(n)) for n in range(len(tree))]
        assert all(len(set(s)) == len(s) for s in siblings)  # distinct tokens under a parent
    assert engine.kv_statistics().blocks_used == 0


@pytest.mark.parametrize("min_prob", [0.0, 1.0])
def test_draft_min_prob_ends_a_chain_at_an_unsure_draft(min_prob: float, verified: list[DraftTree]) -> None:
    """0: every chain drafts to its length, which doubles while the (perfect) draft is accepted
    whole; 1: the draft is never that sure, so every chain ends after one token. The output is
    plain greedy's."""
    eng = make_engine(max_seq_len=256, block_size=8, draft_min_prob=min_prob)
    out = eng.generate(req(PROMPT, max_tokens=24, loops=4, mode="speculative", sampling=GREEDY,
                           draft_loops=4, draft_ahead=5))
    assert out.tokens == plain(eng, PROMPT, 4)
    lengths = [len(t) - 1 for t in verified]  # drafted tokens per chain
    if min_prob == 0:
        # 5, then 10; then the 5 tokens left (1 from the prompt, 6 and 11 from the two chains)
        assert lengths == [5, 10, 5] and out.accepted_draft_tokens == 20
    else:
        assert lengths == [1] * len(lengths) and out.accepted_draft_tokens == len(lengths) >= 11
    assert out.rejected_draft_tokens == 0 and eng.kv_statistics().blocks_used == 0


def test_draft_min_prob_drafts_fewer_rejected_tokens_on_the_demo_model() -> None:
    """On the trained demo model a chain that stops where the draft is unsure drafts far fewer
    tokens that verification rejects, keeps most accepted ones, and gives the same tokens."""
    path = Path(__file__).resolve().parents[2] / "tinyloop" / "data" / "demo.tinyloop"
    runs = {}
    for min_prob in (0.0, 0.2):
        eng = Engine.load(path, max_seq_len=256, draft_min_prob=min_prob)
        prompt = tuple(eng.tokenizer.encode("Once upon a time, in a small town by the sea, there lived"))
        runs[min_prob] = eng.generate(GenerationRequest(
            prompt_tokens=prompt, max_tokens=48, sampling=GREEDY, mode="speculative", draft_loops=1,
            draft_ahead=8))
        assert eng.kv_statistics().blocks_used == 0
    full, adaptive = runs[0.0], runs[0.2]
    assert adaptive.tokens == full.tokens
    assert full.rejected_draft_tokens is not None and adaptive.rejected_draft_tokens is not None
    assert full.accepted_draft_tokens is not None and adaptive.accepted_draft_tokens is not None
    assert adaptive.rejected_draft_tokens * 3 <= full.rejected_draft_tokens
    assert adaptive.accepted_draft_tokens >= 0.8 * full.accepted_draft_tokens


def test_other_loops_and_prompts(engine: Engine) -> None:
    prompt = [5, 6, 7, 8]
    for mode, extra in [("speculative", dict(draft_loops=5, draft_ahead=3)),
                        ("tree", dict(draft_loops=2, draft_ahead=3, k_branches=2))]:
        out = engine.generate(req(prompt, max_tokens=20, loops=6, mode=mode, sampling=GREEDY, **extra))
        assert out.tokens == plain(engine, prompt, 6, 20)


def test_batched_mixed_modes_equal_each_alone(engine: Engine) -> None:
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    reqs = [
        req(PROMPT, max_tokens=12, loops=4, sampling=GREEDY),
        req(PROMPT, max_tokens=12, loops=4, mode="speculative", draft_loops=3, draft_ahead=4, sampling=GREEDY),
        req(PROMPT, max_tokens=12, loops=4, mode="tree", draft_loops=1, draft_ahead=4, k_branches=2,
            sampling=GREEDY),
        req([50, 51, 52], max_tokens=9, loops=3, mode="speculative", draft_loops=1, draft_ahead=2,
            sampling=sampled),
        req([50, 51, 52], max_tokens=9, loops=3, mode="tree", draft_loops=2, draft_ahead=3,
            k_branches=3, sampling=sampled),
        req([60, 61], max_tokens=7, loops=2, mode="speculative", draft_loops=2, draft_ahead=3,
            sampling=SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=True,
                                    top_logprobs=2, ignore_eos=True)),
    ]
    together = engine.generate_many(reqs)
    alone = [engine.generate(r) for r in reqs]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert together[0].tokens == together[1].tokens == together[2].tokens
    # penalties and logprobs: the same as plain greedy decoding reports
    base = engine.generate(GenerationRequest(prompt_tokens=(60, 61), max_tokens=7, loops=2,
                                             sampling=reqs[5].sampling))
    assert together[5].tokens == base.tokens
    assert together[5].logprobs is not None and base.logprobs is not None
    for got, want in zip(together[5].logprobs, base.logprobs):
        assert got.token_id == want.token_id and [t for t, _ in got.top] == [t for t, _ in want.top]
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    assert engine.kv_statistics().blocks_used == 0


@pytest.mark.parametrize("mode", ["speculative", "tree"])
def test_max_tokens_and_stops_cut_inside_an_accepted_run(engine: Engine, mode: str) -> None:
    extra: dict[str, int] = dict(draft_loops=4, draft_ahead=8)  # perfect drafts: long runs
    if mode == "tree":
        extra["k_branches"] = 2
    full = plain(engine, PROMPT, 4)
    for n in (1, 2, 5, 11):
        out = engine.generate(req(PROMPT, max_tokens=n, loops=4, mode=mode, sampling=GREEDY, **extra))
        assert out.tokens == full[:n] and out.finish_reason == "length"
    # a stop token in the middle of a run: nothing after it
    target = full[6]
    params = SamplingParams(temperature=0, ignore_eos=True, stop_token_ids=(target,))
    out = engine.generate(req(PROMPT, max_tokens=24, loops=4, mode=mode, sampling=params, **extra))
    assert out.tokens == full[: full.index(target) + 1] and out.stop_reason == "stop_token"
    # a stop string: the text is cut where plain decoding cuts it, streamed chunks agree
    text = engine.generate(req(PROMPT, max_tokens=24, loops=4, sampling=GREEDY)).text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(temperature=0, ignore_eos=True, stop=(stop,))
    want = engine.generate(req(PROMPT, max_tokens=24, loops=4, sampling=params))
    chunks: list[GenerationChunk] = []
    got = engine.generate_stream(req(PROMPT, max_tokens=24, loops=4, mode=mode, sampling=params, **extra),
                                 chunks.append)
    assert (got.tokens, got.text, got.stop_reason) == (want.tokens, want.text, "stop_string")
    assert [c.token_id for c in chunks] == got.tokens
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text for c in chunks) == got.text
    assert engine.kv_statistics().blocks_used == 0


def test_a_short_pool_falls_back_to_plain_steps() -> None:
    eng = make_engine(max_seq_len=256, block_size=8, kv_cache_mb=60 * 2048 / 2**20)  # 60 blocks
    assert eng.kv_statistics().blocks_total == 60
    want = plain(eng, PROMPT, 4, 20)  # 10 slots x 4 blocks: fits
    out = eng.generate(req(PROMPT, max_tokens=20, loops=4, mode="tree", draft_loops=2,
                           draft_ahead=8, k_branches=6, sampling=GREEDY))
    assert out.tokens == want
    assert eng.kv_statistics().blocks_used == 0


def test_a_pool_short_below_the_first_level_cuts_the_tree_there(verified: list[DraftTree]) -> None:
    eng = make_engine(max_seq_len=256, block_size=8, kv_cache_mb=65 * 2048 / 2**20)  # 65 blocks
    want = plain(eng, PROMPT, 4, 20)
    out = eng.generate(req(PROMPT, max_tokens=20, loops=4, mode="tree", draft_loops=2,
                           draft_ahead=8, k_branches=3, sampling=GREEDY))
    assert out.tokens == want
    assert any(1 < max(t.depths) < 8 for t in verified)  # forks ran out after the second level
    assert eng.kv_statistics().blocks_used == 0


def test_validation() -> None:
    eng = make_engine(max_seq_len=256)
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(draft_loops=2), "draft_loops"),  # mode generate
        (dict(mode="speculative", k_branches=2), "k_branches"),
        (dict(mode="speculative", draft_ahead=0), "draft_ahead"),
        (dict(mode="tree", k_branches=17), "k_branches"),
        (dict(mode="tree", warm_start=True), "warm_start"),
    ]
    for fields, param in cases:
        with pytest.raises(RequestError) as info:
            GenerationRequest(prompt_tokens=(1, 2), **fields)
        assert info.value.param == param
    for fields, param in [(dict(loops=2, draft_loops=3), "draft_loops"),
                          (dict(loops=4, cache_window=2), "cache_window")]:
        with pytest.raises(RequestError) as info:
            eng.start(GenerationRequest(prompt_tokens=(1, 2), mode="speculative", **fields))
        assert info.value.param == param
    for bad in (-0.1, 1.5):
        with pytest.raises(RequestError) as info:
            make_engine(draft_min_prob=bad)
        assert info.value.param == "draft_min_prob"
        with pytest.raises(ConfigError, match="draft_min_prob"):
            Settings(draft_min_prob=bad)


def test_a_model_with_an_exit_rule_is_refused() -> None:
    model = init_model(PRESETS["tiny-ouro"].replace(max_position=64), seed=0)
    eng = Engine(model, default_tokenizer())
    with pytest.raises(RequestError, match="adaptive exit rule") as info:
        eng.start(GenerationRequest(prompt_tokens=(1, 2), mode="tree"))
    assert info.value.param == "mode"


@pytest.mark.parametrize("kv_mode", ["int4", "h-mode"])
def test_kv_modes_and_a_tree_at_the_end_of_the_positions(kv_mode: str) -> None:
    """The KV of an accepted branch moves whatever the pool stores; a wide tree near
    ``max_position`` is cut to fit (h-mode takes RoPE tables at storage positions)."""
    eng = make_engine(max_seq_len=256, block_size=8, kv_mode=kv_mode)
    prompt = list(range(5, 225))
    want = eng.generate(req(prompt, max_tokens=30, sampling=GREEDY)).tokens
    for extra in [dict(draft_loops=2, draft_ahead=3, k_branches=3),
                  dict(draft_loops=4, draft_ahead=8, k_branches=16)]:
        got = eng.generate(req(prompt, max_tokens=30, mode="tree", sampling=GREEDY, **extra))
        assert got.tokens == want
    assert eng.kv_statistics().blocks_used == 0


def test_draft_tree_layout() -> None:
    tree = DraftTree.from_branches(9, [[1, 2, 3], [4, 5, 6]])
    assert tree.tokens == (9, 1, 2, 3, 4, 5, 6) and tree.depths == (0, 1, 2, 3, 1, 2, 3)
    assert tree.children(0) == [1, 4] and tree.children(4) == [5]
    assert tree.positions(10) == [10, 11, 12, 13, 11, 12, 13]
    mask = tree.mask()
    assert mask[6].tolist() == [True, False, False, False, True, True, True]
    assert torch.equal(DraftTree.from_branches(9, [[1, 2]]).mask(), torch.ones(3, 3, dtype=torch.bool).tril())


# -- sampling: the distribution of plain sampling ------------------------------------------------

SAMPLED = SamplingParams(temperature=0.06, top_k=2, presence_penalty=0.4, ignore_eos=True)
CHI2_DF7_P001 = 24.32  # the 0.999 quantile of chi-square with 7 degrees of freedom


def exact_joint(eng: Engine, prompt: list[int], first: int) -> dict[tuple[int, ...], float]:
    """P(tokens 2..4 | the first) under plain sampling, from the model's own distributions."""
    def after(tokens: list[int]) -> torch.Tensor:
        seq = eng.start(req(prompt + tokens, max_tokens=1))
        logits = eng.prefill(seq)
        eng.free(seq)
        return target_probs(logits, SAMPLED, prompt, tokens)

    out: dict[tuple[int, ...], float] = {}
    paths: list[tuple[list[int], float]] = [([first], 1.0)]
    for _ in range(3):
        nxt = []
        for tokens, p in paths:
            probs = after(tokens)
            nxt.extend((tokens + [t], p * float(probs[t])) for t in probs.nonzero().flatten().tolist())
        paths = nxt
    for tokens, p in paths:
        out[tuple(tokens[1:])] = p
    return out


def sample_many(eng: Engine, request: GenerationRequest,
                n: int) -> tuple[int, Counter[tuple[int, ...]], int, int, int]:
    """Prefill once, take the greedy first token, then fork ``n`` copies with seeds 0..n-1 and
    run them as one batch: (first token, counts of tokens 2..4, drafted, rejected, chains cut
    short by ``draft_min_prob``)."""
    seq = eng.start(request)
    eng.accept(seq, int(eng.prefill(seq).argmax()), None)
    kids = []
    for i in range(n):
        kid = eng.fork(seq)
        kid.generator = make_generator(i)
        kids.append(kid)
    eng.free(seq)
    while not all(k.finished for k in kids):
        eng.step([k for k in kids if not k.finished])
    counts = Counter(tuple(k.output[1:]) for k in kids)
    drafted = sum(counters(k).drafted for k in kids)
    rejected = sum(counters(k).rejected for k in kids)
    stopped = sum(counters(k).stopped_unsure for k in kids)
    for k in kids:
        eng.free(k)
    return seq.output[0], counts, drafted, rejected, stopped


@pytest.mark.parametrize(("mode", "extra", "min_prob"), [
    ("speculative", dict(draft_loops=2, draft_ahead=2), 0.0),
    # chains that end where the drawn draft token was unlikely, the others run to their end
    ("speculative", dict(draft_loops=2, draft_ahead=2), 0.5),
    ("tree", dict(draft_loops=2, draft_ahead=2, k_branches=2), 0.2),
    ("tree", dict(draft_loops=1, draft_ahead=2, k_branches=3), 0.2),
])
def test_sampled_speculation_has_the_distribution_of_plain_sampling(mode: str, extra: dict[str, int], min_prob: float,
                                                                     verified: list[DraftTree]) -> None:
    n = 1000  # one batch of n sequences: a draft budget for every tree in full
    eng = make_engine(max_seq_len=64, block_size=4, kv_cache_mb=64, max_draft_nodes=6 * n, draft_min_prob=min_prob)
    prompt = [30, 31, 32, 33, 34]
    request = req(prompt, max_tokens=4, loops=4, mode=mode, sampling=SAMPLED, **extra)
    first, counts, drafted, rejected, stopped = sample_many(eng, request, n)
    exact = exact_joint(eng, prompt, first)
    assert len(exact) == 8 and set(counts) <= set(exact)
    chi2 = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert chi2 < CHI2_DF7_P001, (chi2, counts, exact)
    # both sides of the rule ran: some drafts were accepted, some rejected
    assert 0.05 * drafted < rejected < 0.95 * drafted
    if min_prob == 0.5:  # some chains were cut short, some not
        assert 0.1 * n < stopped < 0.9 * n
    else:
        assert stopped == 0
    if extra.get("k_branches") == 3:  # here the rule held over trees with siblings at depth 2
        assert sum(map(deep_siblings, verified)) > 0.1 * len(verified)
    assert eng.kv_statistics().blocks_used == 0


def test_chain_length_grows_while_accepted_whole_and_shrinks_after_a_rejection() -> None:
    state = speculative.SpeculationState()
    lengths = []
    for full, all_accepted in [(True, True), (True, True), (True, True), (True, True), (False, False),
                               (True, False), (False, True)]:
        lengths.append(state.chain_length(4))
        state.adapt(full, all_accepted)
    lengths.append(state.chain_length(4))
    # doubles up to CHAIN_GROWTH * 4, halves after each rejection, never below draft_ahead;
    # a chain the draft stopped early (unsure) and accepted whole keeps its length
    assert lengths == [4, 8, 16, 16, 16, 8, 4, 4]


def test_a_chain_is_verified_without_a_tree_mask(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    masks: list[Any] = []
    context = engine.context

    def recording(kvs: Any, starts: Any, n_new: int, extra_mask: Any = None, positions: Any = None) -> Any:
        masks.append((extra_mask, positions))
        return context(kvs, starts, n_new, extra_mask=extra_mask, positions=positions)
    monkeypatch.setattr(engine, "context", recording)
    out = engine.generate(req(PROMPT, max_tokens=24, loops=4, mode="speculative", sampling=GREEDY,
                              draft_loops=2, draft_ahead=4))
    assert out.tokens == plain(engine, PROMPT, 4)
    assert masks and all(m == (None, None) for m in masks)  # causal at consecutive positions: the default


def test_an_int8_draft_keeps_greedy_output_and_runs_the_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = make_engine(max_seq_len=256, block_size=8, draft_weights="int8")
    assert eng.draft_model is not eng.model
    drafts: list[int] = []
    forward = eng.draft_model.forward
    monkeypatch.setattr(eng.draft_model, "forward", lambda *a, **k: (drafts.append(1), forward(*a, **k))[1])
    accepted = 0
    for mode, extra in SETTINGS[:4]:
        out = eng.generate(req(PROMPT, max_tokens=24, loops=4, mode=mode, sampling=GREEDY, **extra))
        assert out.tokens == plain(eng, PROMPT, 4)
        accepted += out.accepted_draft_tokens or 0
    assert accepted > 10  # the int8 draft at the verifier's loops agrees with it most of the time
    assert len(drafts) > 10  # the drafts ran on the int8 twin, the plain and verify steps did not
    plain_only = len(drafts)
    eng.generate(req(PROMPT, max_tokens=8, loops=4, sampling=GREEDY))
    assert len(drafts) == plain_only
    assert eng.kv_statistics().blocks_used == 0


def test_sampled_speculation_with_an_int8_draft_has_the_distribution_of_plain_sampling(
        verified: list[DraftTree]) -> None:
    n = 1000
    eng = make_engine(max_seq_len=64, block_size=4, kv_cache_mb=64, max_draft_nodes=6 * n, draft_weights="int8")
    prompt = [30, 31, 32, 33, 34]
    request = req(prompt, max_tokens=4, loops=4, mode="speculative", sampling=SAMPLED, draft_loops=2, draft_ahead=2)
    first, counts, drafted, rejected, _ = sample_many(eng, request, n)
    exact = exact_joint(eng, prompt, first)
    chi2 = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert set(counts) <= set(exact) and chi2 < CHI2_DF7_P001, (chi2, counts, exact)
    assert 0.05 * drafted < rejected < 0.95 * drafted
    assert eng.kv_statistics().blocks_used == 0
