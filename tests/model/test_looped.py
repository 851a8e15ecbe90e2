"""The looped model: cache vs recompute, loops as a compute dial, batching, exits."""

from __future__ import annotations

import math

import pytest
import torch

from tinyloop.model.config import ModelConfig
from tinyloop.model.context import FullContext, PagedContext
from tinyloop.model.kvcache import KVPool, SeqKV, slot_count
from tinyloop.model.looped import LoopedLM, RowSpec
from tinyloop.vocabulary import ExitRule

VOCAB = 97


def make_model(seed: int = 0, **changes: object) -> LoopedLM:
    base = dict(vocab_size=VOCAB, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                n_prelude=1, n_core=2, n_coda=1, default_loops=3, max_loops=8, max_position=128)
    base.update(changes)
    torch.manual_seed(seed)
    model = LoopedLM(ModelConfig(**base)).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.25)
    return model


def incremental(model: LoopedLM, tokens: torch.Tensor, spec: RowSpec, prefill: int,
                block_size: int = 4) -> torch.Tensor:
    """Prefill ``prefill`` tokens, then decode the rest one at a time; logits at every position."""
    cfg = model.config
    pool = KVPool(cfg, 256, block_size)
    kv = SeqKV(pool, slot_count(cfg, spec.loops, spec.window))
    outs = []
    pos = 0
    for n in [prefill] + [1] * (tokens.shape[1] - prefill):
        kv.reserve(pos + n)
        ctx = PagedContext(pool, model.rope, [kv], [pos], n)
        row = RowSpec(loops=spec.loops, window=spec.window, start=pos, noise_seed=spec.noise_seed)
        outs.append(model(tokens[:, pos:pos + n], ctx, [row], last_only=False).logits)
        kv.length = pos = pos + n
    return torch.cat(outs, dim=1)


LAYOUTS = [
    dict(block_style="pre_ln"),
    dict(block_style="peri_ln", injection="none", state_init="embed", loop_norm="every_loop",
         n_prelude=0, n_coda=0, tie_embeddings=False),
    dict(block_style="sandwich", rope_style="interleaved", qk_bias=True, embed_scale=5.6),
    dict(block_style="pre_ln", state_init="zeros", fused_qkv=False, kv_heads=4),
    dict(block_style="sandwich", state_init="embed", kv_heads=1),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{v}" for v in d.values()))
@torch.inference_mode()
def test_incremental_decode_equals_full_recompute(layout: dict[str, object]) -> None:
    model = make_model(**layout)
    tokens = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(1))
    loops = 3
    full = model(tokens, FullContext(model.rope, 1, 13),
                 [RowSpec(loops=loops, window=loops, noise_seed=7)], last_only=False).logits
    inc = incremental(model, tokens, RowSpec(loops=loops, window=loops, noise_seed=7), prefill=5)
    torch.testing.assert_close(inc, full, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_loops_change_logits_and_compute_grows_linearly() -> None:
    model = make_model()
    tokens = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    logits, calls = {}, {}
    for loops in (1, 2, 4, 8):
        model.counters.clear()
        ctx = FullContext(model.rope, 1, 6)
        logits[loops] = model(tokens, ctx, [RowSpec(loops=loops, window=loops)]).logits
        calls[loops] = (model.counters["core_block_calls"], model.counters["core_row_loops"])
    assert calls == {1: (1, 6), 2: (2, 12), 4: (4, 24), 8: (8, 48)}
    for a, b in [(1, 2), (2, 4), (4, 8)]:
        assert not torch.allclose(logits[a], logits[b], atol=1e-3)


@torch.inference_mode()
def test_batched_rows_match_single_rows_with_mixed_loops_and_lengths() -> None:
    model = make_model(seed=3)
    cfg = model.config
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in (3, 7, 5)]
    specs = [RowSpec(loops=1, window=1, noise_seed=1), RowSpec(loops=4, window=2, noise_seed=2),
             RowSpec(loops=3, window=3, noise_seed=3)]
    pool = KVPool(cfg, 512, 4)
    kvs = [SeqKV(pool, slot_count(cfg, s.loops, s.window)) for s in specs]
    for kv, p, s in zip(kvs, prompts, specs):  # prefill each alone
        kv.reserve(p.shape[1])
        model(p, PagedContext(pool, model.rope, [kv], [0], p.shape[1]), [s])
        kv.length = p.shape[1]
    nxt = torch.tensor([[11], [12], [13]])
    model.counters.clear()
    for kv in kvs:
        kv.reserve(kv.length + 1)
    starts = [kv.length for kv in kvs]
    batch_specs = [RowSpec(loops=s.loops, window=s.window, start=st, noise_seed=s.noise_seed)
                   for s, st in zip(specs, starts)]
    batched = model(nxt, PagedContext(pool, model.rope, kvs, starts, 1), batch_specs).logits
    # One core call per loop of the deepest row; rows only pay for their own loops.
    assert model.counters["core_block_calls"] == 4
    assert model.counters["core_row_loops"] == 1 + 4 + 3
    for b, (p, s) in enumerate(zip(prompts, specs)):
        alone = incremental(model, torch.cat([p, nxt[b:b + 1]], 1), s, prefill=p.shape[1])
        torch.testing.assert_close(batched[b, -1], alone[0, -1], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_latent_diff_exit_skips_loops_and_fills_skipped_slots() -> None:
    model = make_model(seed=4)
    cfg = model.config
    pool = KVPool(cfg, 256, 4)
    loops, window = 6, 6
    kv = SeqKV(pool, slot_count(cfg, loops, window))
    kv.reserve(1)
    ctx = PagedContext(pool, model.rope, [kv], [0], 1)
    model.counters.clear()
    rule = ExitRule(kind="latent_diff", threshold=1e9, min_loops=2)  # always fires at min_loops
    out = model(torch.tensor([[5]]), ctx, [RowSpec(loops=loops, window=window, exit=rule)])
    assert out.loops_used == [2]
    assert model.counters["core_row_loops"] == 2
    # Slots of loops 2..5 hold the K of loop 1 (the last one written).
    blk = kv.tables
    for i in range(cfg.n_core):
        src = pool.k[blk[cfg.n_prelude + 1 * cfg.n_core + i][0], 0]
        for r in range(2, loops):
            torch.testing.assert_close(pool.k[blk[cfg.n_prelude + r * cfg.n_core + i][0], 0], src)


@torch.inference_mode()
def test_gate_and_kl_exit_rules_respect_min_loops() -> None:
    model = make_model(seed=5, exit=ExitRule(kind="gate", threshold=0.5, min_loops=3))
    with torch.no_grad():
        model.exit_gate.bias.fill_(10.0)  # sigmoid ~ 1: the gate wants to exit at once
    ctx = FullContext(model.rope, 1, 1)
    out = model(torch.tensor([[3]]), ctx, [RowSpec(loops=8, window=8)])
    assert out.loops_used == [3]
    kl = ExitRule(kind="kl", threshold=1e9, min_loops=1)  # the first check is against uniform
    out = model(torch.tensor([[3]]), FullContext(model.rope, 1, 1), [RowSpec(loops=8, window=8, exit=kl)])
    assert out.loops_used == [1]
    late = ExitRule(kind="kl", threshold=1e9, min_loops=2, check_every=3)  # checked after loop 2, 5, 8
    out = model(torch.tensor([[3]]), FullContext(model.rope, 1, 1), [RowSpec(loops=8, window=8, exit=late)])
    assert out.loops_used == [2]
    out = model(torch.tensor([[3, 4]]), FullContext(model.rope, 1, 2), [RowSpec(loops=8, window=8, exit=kl)])
    assert out.loops_used == [8], "exits apply to single-token rows (decode) only"


def test_randn_initial_state_is_the_references_truncated_normal_seeded_per_position() -> None:
    """Huginn's reference draws the initial state from a normal truncated at 3 std (no mass piled
    on the bounds, unlike clamping); TinyLoop draws from the same law, seeded by (seed, position)."""
    model = make_model(state_init="randn", state_init_std=0.5, hidden=32)
    e = torch.zeros(1, 256, 32)
    s = model.initial_state(e, [RowSpec(loops=1, window=1, noise_seed=3)])
    assert s.abs().max() <= 1.5
    assert (s.abs() > 1.499).sum() == 0, "clamping would pile ~0.27% of the draws on the bounds"
    truncated_std = 0.5 * (1 - 6 * math.exp(-4.5) / math.sqrt(2 * math.pi) / (math.erf(3 / math.sqrt(2)))) ** 0.5
    assert abs(float(s.std()) - truncated_std) < 0.02
    later = model.initial_state(e[:, 100:101], [RowSpec(loops=1, window=1, noise_seed=3, start=100)])
    assert torch.equal(later[0, 0], s[0, 100]), "a position's draw depends on (seed, position) only"


def test_randn_initial_states_are_drawn_once_per_seed_and_position() -> None:
    """A decode step needs each row's draw again for the next token's position only: a draw is a
    generator and five ops per row, so each (seed, position) is drawn once and kept."""
    model = make_model(state_init="randn", state_init_std=0.5, hidden=32)
    e = torch.zeros(1, 8, 32)
    first = model.initial_state(e, [RowSpec(loops=1, window=1, noise_seed=3)])
    assert model.counters["noise_draws"] == 8
    again = model.initial_state(e[:, :1].expand(4, 1, 32), [RowSpec(loops=1, window=1, noise_seed=3, start=p)
                                                            for p in (7, 0, 3, 3)])
    assert model.counters["noise_draws"] == 8, "every position was drawn already"
    assert torch.equal(again[:, 0], first[0, [7, 0, 3, 3]])
    model.initial_state(e[:, :1], [RowSpec(loops=1, window=1, noise_seed=4, start=0)])
    assert model.counters["noise_draws"] == 9, "another seed draws its own"
