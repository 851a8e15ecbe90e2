"""KV cache modes: fidelity to full precision, exact bytes, sharing and rollback, the engine,
and the settings that select them."""

from __future__ import annotations

from math import gcd
from pathlib import Path

import pytest
import torch

from tinyloop.engine.engine import Engine
from tinyloop.errors import ConfigError
from tinyloop.http.service import ServedModel
from tinyloop.model.config import ModelConfig
from tinyloop.model.context import PagedContext
from tinyloop.model.kvcache import KVPool, SeqKV, slot_count
from tinyloop.model.kvstore import dequantize_int4, quantize_int4
from tinyloop.model.looped import LoopedLM, RowSpec
from tinyloop.model.presets import PRESETS, init_model
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.server import load_engine
from tinyloop.settings import Settings
from tinyloop.tokenizer import default_tokenizer
from tinyloop.vocabulary import KV_MODES, ExitRule, KVMode

COMPRESSED = [m for m in KV_MODES if m != "full"]
CFG = PRESETS["tiny"].replace(max_position=256)  # hidden 64, kv_heads 2, head_dim 16


@pytest.fixture(scope="module")
def model() -> LoopedLM:
    return init_model(CFG, seed=0)


def run(model: LoopedLM, tokens: torch.Tensor, mode: str, *, loops: int = 4, window: int = 4,
        prefill: int = 8, block_size: int = 8) -> torch.Tensor:
    """Prefill ``prefill`` tokens in ``mode``, decode the rest one by one: logits ``[1, T, V]``."""
    pool = KVPool(model.config, 256, block_size, mode=mode)
    kv = SeqKV(pool, slot_count(model.config, loops, window))
    outs = [_step(model, pool, kv, tokens[:, :prefill], loops, window)]
    for t in range(prefill, tokens.shape[1]):
        outs.append(_step(model, pool, kv, tokens[:, t:t + 1], loops, window))
    return torch.cat(outs, dim=1)


def _step(model: LoopedLM, pool: KVPool, kv: SeqKV, tokens: torch.Tensor, loops: int, window: int,
          exit: ExitRule | None = None) -> torch.Tensor:
    start, n = kv.length, tokens.shape[1]
    kv.reserve(start + n)
    ctx = PagedContext(pool, model.rope, [kv], [start], n)
    spec = RowSpec(loops=loops, window=window, start=start, noise_seed=7, exit=exit)
    logits = model(tokens, ctx, [spec], last_only=False).logits
    kv.length = start + n
    return logits


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


# -- fidelity ----------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 2, 4])
@torch.inference_mode()
def test_h_mode_decodes_exactly_like_full_mode_in_fp32(model: LoopedLM, window: int) -> None:
    toks = tokens(24)
    full = run(model, toks, "full", window=window)
    torch.testing.assert_close(run(model, toks, "h-mode", window=window), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", [dict(qk_bias=True, rope_style="interleaved", fused_qkv=False),
                                    dict(n_prelude=0, n_coda=0, block_style="peri_ln", injection="none",
                                         state_init="embed", loop_norm="every_loop"),
                                    dict(block_style="post_ln", qk_norm=True, loop_norm="none", rope_scaling="llama3",
                                         rope_original_max_position=64)],
                         ids=["bias-interleaved-unfused", "ouro", "retrofit-olmo"])
@torch.inference_mode()
def test_h_mode_recomputes_bias_and_rope_of_every_layout(layout: dict[str, object]) -> None:
    m = init_model(CFG.replace(**layout), seed=2)  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("k_bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
            elif name.endswith("k_norm.weight"):  # h-mode must recompute K through the QK-norm
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    toks = tokens(20, seed=4)
    torch.testing.assert_close(run(m, toks, "h-mode", loops=3, window=3),
                               run(m, toks, "full", loops=3, window=3), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def full_48(model: LoopedLM) -> torch.Tensor:
    with torch.inference_mode():
        return run(model, tokens(48), "full")


@pytest.mark.parametrize("mode", COMPRESSED)
@torch.inference_mode()
def test_every_mode_stays_close_to_full_precision(model: LoopedLM, full_48: torch.Tensor,
                                                  mode: str) -> None:
    full = full_48
    out = run(model, tokens(48), mode)
    tol = 0.05 if KVMode.parse(mode).int4 else 5e-3  # 4-bit codes; 16-bit h and projection
    assert (out - full).abs().max() < tol
    agree = (out.argmax(-1) == full.argmax(-1)).float().mean()
    assert agree >= 0.9  # this random model's logits are flat (std ~0.16): near-ties flip


@torch.inference_mode()
def test_tree_positions_are_recomputed_at_the_given_rope_positions(model: LoopedLM) -> None:
    """A verification call whose tokens share a depth: h-mode uses the call's positions."""
    outs = {}
    for mode in ("full", "h-mode"):
        pool = KVPool(CFG, 64, 8, mode=mode)
        kv = SeqKV(pool, slot_count(CFG, 4, 4))
        _step(model, pool, kv, tokens(10), 4, 4)
        kv.reserve(13)
        tree = torch.tensor([[[True, False, False], [True, True, False], [True, False, True]]])
        ctx = PagedContext(pool, model.rope, [kv], [10], 3, extra_mask=tree,
                           positions=torch.tensor([[10, 11, 11]]))
        spec = RowSpec(loops=4, window=4, start=10, noise_seed=7)
        outs[mode] = model(torch.tensor([[5, 6, 7]]), ctx, [spec], last_only=False).logits
    torch.testing.assert_close(outs["h-mode"], outs["full"], rtol=1e-4, atol=1e-5)


def test_int4_round_trip_error_is_within_half_a_step() -> None:
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    codes, meta = quantize_int4(x, 32)
    assert codes.dtype == torch.uint8 and codes.shape == (5, 3, 32)
    assert meta.dtype == torch.float16 and meta.shape == (5, 3, 2, 2)
    back = dequantize_int4(codes, meta, torch.float32)
    step = meta[..., 0].float().repeat_interleave(32, dim=-1)
    assert ((back - x).abs() <= step * 0.5 + 1e-2).all()
    const = torch.full((2, 32), 0.25)  # a constant group: scale 0, exact
    assert torch.equal(dequantize_int4(*quantize_int4(const, 32), torch.float32), const)


# -- bytes -------------------------------------------------------------------------------------

def expected_slot_bytes(c: ModelConfig, mode: KVMode, elem: int) -> int:
    """The documented formula, written out per mode."""
    e_kv = 2 * c.kv_heads * c.head_dim
    if mode.int4 and mode.h_mode:
        return c.hidden // 2 + 4 * c.hidden // gcd(mode.group_size, c.hidden)
    if mode.int4:
        return e_kv // 2 + 4 * e_kv // gcd(mode.group_size, c.head_dim)
    if mode.h_mode:
        return c.hidden * (2 if mode.fp16_qkv else elem)
    return e_kv * elem


@pytest.mark.parametrize("name", KV_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
def test_bytes_per_token_are_exact(name: str, dtype: torch.dtype, group: int) -> None:
    cfg = PRESETS["base100m"]  # head_dim 64, hidden 768: full-size groups
    mode = KVMode(**_flags(name), group_size=group)
    pool = KVPool(cfg, 3, block_size=16, dtype=dtype, mode=mode)
    elem = torch.empty((), dtype=dtype).element_size()
    per_slot = expected_slot_bytes(cfg, mode, elem)
    assert pool.bytes_per_token_slot == per_slot == mode.slot_bytes(cfg, elem)
    assert pool.store.nbytes == (3 + 1) * 16 * per_slot  # what was allocated (and the null block), scales included
    for loops, window in [(4, 1), (4, 2), (4, 4), (8, 3)]:
        slots = cfg.n_prelude + cfg.n_coda + cfg.n_core * min(window, loops)
        assert pool.bytes_per_token(loops, window) == per_slot * slots
        assert mode.bytes_per_token(cfg, loops, window, elem) == per_slot * slots


def _flags(name: str) -> dict[str, bool]:
    m = KVMode.parse(name)
    return {"int4": m.int4, "h_mode": m.h_mode, "fp16_qkv": m.fp16_qkv}


def test_h_mode_plus_int4_cut_at_the_100m_preset() -> None:
    """The seeds' figure: h-mode + int4 cuts >= 78% against full fp16 (base100m is MHA, like
    Huginn; with GQA the cut shrinks because K+V is then smaller than h)."""
    cfg = PRESETS["base100m"]
    full = KVMode().slot_bytes(cfg, 2)
    assert full == 3072  # 2 x 12 heads x 64 x 2 bytes
    assert KVMode(int4=True).slot_bytes(cfg, 2) == 960  # 68.75% cut
    assert KVMode(h_mode=True).slot_bytes(cfg, 2) == 1536  # 50% cut: one vector instead of two
    h_int4 = KVMode(int4=True, h_mode=True).slot_bytes(cfg, 2)
    assert h_int4 == 480 and 1 - h_int4 / full >= 0.78  # 84.4% cut
    gqa = cfg.replace(kv_heads=4)
    assert 1 - KVMode(int4=True, h_mode=True).slot_bytes(gqa, 2) / KVMode().slot_bytes(gqa, 2) < 0.78


def test_mode_names_round_trip_and_bad_ones_are_refused() -> None:
    for name in KV_MODES:
        assert KVMode.parse(name).name == name
    with pytest.raises(ConfigError, match="unknown KV cache mode"):
        KVMode.parse("int8")
    with pytest.raises(ConfigError, match="needs h-mode"):
        KVMode(fp16_qkv=True)


# -- sharing, rollback, exit fill ----------------------------------------------------------------

@pytest.mark.parametrize("mode", KV_MODES)
@torch.inference_mode()
def test_fork_copy_on_write_and_truncate_match_fresh_runs(model: LoopedLM, mode: str) -> None:
    prefix, a, b = tokens(11, seed=5), tokens(3, seed=6), tokens(4, seed=7)
    pool = KVPool(CFG, 128, 4, mode=mode)  # 11 tokens: the third block of each slot is shared
    parent = SeqKV(pool, slot_count(CFG, 4, 2))
    _step(model, pool, parent, prefix, 4, 2)
    child = parent.fork()
    got_child = [_step(model, pool, child, a[:, i:i + 1], 4, 2) for i in range(3)]
    got_parent = _step(model, pool, parent, b, 4, 2)  # the parent's blocks were not overwritten
    parent.truncate(12)  # roll back 3 of b's tokens, then decode others
    got_rolled = _step(model, pool, parent, a[:, :2], 4, 2)

    def fresh(*chunks: torch.Tensor) -> torch.Tensor:
        """The same calls on a sequence of its own (chunking matters when window < loops)."""
        kv = SeqKV(pool, slot_count(CFG, 4, 2))
        outs = [_step(model, pool, kv, c, 4, 2) for c in chunks]
        kv.free()
        return torch.cat(outs[1:], 1)

    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(got_child, 1),
                               fresh(prefix, *[a[:, i:i + 1] for i in range(3)]), **close)
    torch.testing.assert_close(got_parent, fresh(prefix, b), **close)
    torch.testing.assert_close(got_rolled, fresh(prefix, b[:, :1], a[:, :2])[:, 1:], **close)
    parent.free()
    child.free()
    assert pool.statistics().blocks_used == 0


@pytest.mark.parametrize("mode", KV_MODES)
@torch.inference_mode()
def test_exit_fills_skipped_slots_with_the_last_written_ones(model: LoopedLM, mode: str) -> None:
    pool = KVPool(CFG, 64, 4, mode=mode)
    loops = 5
    kv = SeqKV(pool, slot_count(CFG, loops, loops))
    _step(model, pool, kv, tokens(3), loops, loops)
    rule = ExitRule(kind="latent_diff", threshold=1e9, min_loops=2)  # fires after loop 2
    _step(model, pool, kv, torch.tensor([[9]]), loops, loops, exit=rule)
    for i in range(CFG.n_core):  # the token sits at position 3: block 0, offset 3 of each slot
        src = kv.tables[CFG.n_prelude + 1 * CFG.n_core + i][0] * 4 + 3
        for r in range(2, loops):
            dst = kv.tables[CFG.n_prelude + r * CFG.n_core + i][0] * 4 + 3
            for field in pool.store.fields.values():
                for t in field.tensors:
                    assert torch.equal(t[dst], t[src])


# -- engine and settings -------------------------------------------------------------------------

def make_engine(mode: str, **options: object) -> Engine:
    return Engine(init_model(CFG, seed=0), default_tokenizer(), max_seq_len=256, block_size=8,
                  kv_mode=mode, **options)  # type: ignore[arg-type]


REQS = [
    GenerationRequest(prompt_tokens=(5, 6, 7), max_tokens=6, loops=1,
                      sampling=SamplingParams(temperature=0, ignore_eos=True)),
    GenerationRequest(prompt_tokens=tuple(range(10, 31)), max_tokens=5, loops=4, cache_window=2,
                      sampling=SamplingParams(temperature=0, ignore_eos=True)),
    GenerationRequest(prompt_tokens=(50,) * 12, max_tokens=5, loops=2, warm_start=True,
                      sampling=SamplingParams(temperature=1.0, seed=3, ignore_eos=True)),
]


@pytest.mark.parametrize("mode", COMPRESSED)
def test_engine_generates_in_every_mode_and_frees_every_block(mode: str) -> None:
    engine = make_engine(mode, kv_cache_mb=1)
    results = engine.generate_many(REQS)
    assert [len(r.tokens) for r in results] == [6, 5, 5]
    assert engine.kv_statistics().blocks_used == 0
    assert engine.kv_mode.name == mode and f"mode={mode}" in repr(engine)
    elem = torch.empty((), dtype=engine.dtype).element_size()
    assert engine.kv_bytes_per_token() == KVMode.parse(mode).bytes_per_token(CFG, 4, 4, elem)
    assert engine.kv_bytes_per_token(4, 2) == KVMode.parse(mode).bytes_per_token(CFG, 4, 2, elem)


def test_the_budget_is_in_bytes_so_smaller_modes_hold_more_tokens() -> None:
    blocks = {m: make_engine(m, kv_cache_mb=1).kv_statistics() for m in ("full", "int4", "h-mode+int4")}
    for stats in blocks.values():  # every mode fills the same budget
        assert 2**20 - stats.bytes_per_block < stats.blocks_total * stats.bytes_per_block <= 2**20
    assert blocks["full"].blocks_total < blocks["int4"].blocks_total


@pytest.mark.parametrize("env", [{"TINYLOOP_KV_INT4": "1"},
                                 {"TINYLOOP_KV_H_MODE": "1", "TINYLOOP_H_MODE_FP16_ATTN_QKV": "1"},
                                 {"TINYLOOP_KV_H_MODE": "1", "TINYLOOP_KV_INT4": "1"}])
def test_settings_select_the_mode_load_engine_uses_and_model_info_reports(
        tiny_artifact: Path, env: dict[str, str]) -> None:
    settings = Settings.from_env({"TINYLOOP_MODEL_PATH": str(tiny_artifact), "TINYLOOP_KV_CACHE_MB": "1",
                                  "TINYLOOP_MAX_SEQ_LEN": "256", **env})
    engine = load_engine(settings)
    assert engine.kv_mode == settings.kv_mode
    assert engine.pool.mode.name == settings.kv_cache_mode != "full"
    assert ServedModel.from_engine(engine, settings).kv_cache_mode == settings.kv_cache_mode
    result = engine.generate(REQS[0])
    assert len(result.tokens) == 6 and engine.kv_statistics().blocks_used == 0


def test_fp16_qkv_without_h_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="needs h-mode"):
        Settings.from_env({"TINYLOOP_H_MODE_FP16_ATTN_QKV": "1"})
