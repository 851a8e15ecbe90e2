"""The CPU C kernels (tinyloop/cpu): decode attention, RMSNorm and panel products against the torch reference,
attention reading only the keys it is given, and the engine running without them where they
cannot be built."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.engine.test_engine import make_engine, req
from tinyloop.cpu import kernels
from tinyloop.cpu.backend import CPU
from tinyloop.engine.engine import Engine
from tinyloop.model.backend import TORCH
from tinyloop.model.kvstore import KVStore
from tinyloop.model.presets import PRESETS
from tinyloop.requests import SamplingParams
from tinyloop.vocabulary import KVMode

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler to build the CPU kernels")
BS = 8


def pool(kv_heads: int, head_dim: int, mode: str | None = None, blocks: int = 128) -> KVStore:
    heads = kv_heads * 4
    cfg = PRESETS["tiny"].replace(heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden=heads * head_dim)
    store = KVStore(KVMode.parse(mode), cfg, blocks * BS, BS, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(1)
    for field in store.fields.values():
        for t in field.tensors:
            if t.dtype == torch.float32:
                t.copy_(torch.randn(t.shape, generator=gen))
    if mode is not None:  # a quantized store: write real values through it
        rows = torch.arange(blocks * BS)
        values = {name: torch.randn(blocks * BS, *((cfg.hidden,) if name == "h" else (kv_heads, head_dim)),
                                    generator=gen) for name in store.fields}
        store.write(rows, **values)
    return store


def key_rows(n_rows: int, length: int, blocks: int, seed: int = 0) -> torch.Tensor:
    """Each row's keys in blocks scattered over the pool, as ``PagedContext`` lays them out."""
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-length // BS)
    tables = torch.randperm(blocks, generator=gen)[:n_rows * per_row].view(n_rows, per_row)
    pos = torch.arange(length)
    return tables[:, pos // BS] * BS + pos % BS  # [R, L]


def mask_of(n_keys: torch.Tensor, length: int) -> torch.Tensor:
    return (torch.arange(length)[None, :] < n_keys[:, None])[:, None, None, :]  # [R, 1, 1, L]


@needs_kernel
@pytest.mark.parametrize(("rows", "q_heads", "kv_heads", "head_dim", "length"),
                         [(1, 4, 4, 64, 1), (3, 4, 2, 64, 19), (16, 4, 2, 64, 40), (5, 8, 2, 96, 33),
                          (2, 12, 4, 128, 70), (4, 6, 1, 32, 9)])
@pytest.mark.parametrize("masked", [False, True])
def test_the_kernel_matches_the_torch_reference(rows: int, q_heads: int, kv_heads: int, head_dim: int,
                                                length: int, masked: bool) -> None:
    store = pool(kv_heads, head_dim)
    keys = key_rows(rows, length, 128)
    gen = torch.Generator().manual_seed(2)
    n_keys = torch.randint(1, length + 1, (rows,), generator=gen) if masked else torch.full((rows,), length)
    mask = mask_of(n_keys, length) if masked else None
    q = torch.randn(rows, q_heads, 1, head_dim, generator=gen) * 2
    got = CPU.decode_attention(store, q, keys, n_keys, mask)
    want = TORCH.decode_attention(store, q, keys, n_keys, mask)
    assert got.shape == want.shape == (rows, q_heads, 1, head_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_query_transposed_in_memory_is_read_as_its_values() -> None:
    store = pool(2, 64)
    keys = key_rows(3, 12, 64)
    q = torch.randn(3, 1, 4, 64).transpose(1, 2)  # [R, HQ, 1, D] over [R, 1, HQ, D] memory, as a projection gives it
    n_keys = torch.tensor([12, 5, 1])
    torch.testing.assert_close(CPU.decode_attention(store, q, keys, n_keys, mask_of(n_keys, 12)),
                               TORCH.decode_attention(store, q, keys, n_keys, mask_of(n_keys, 12)))


@needs_kernel
def test_keys_past_a_rows_count_are_never_read() -> None:
    """The rows a shorter row's padding names may hold anything (NaN included): never read."""
    store = pool(2, 64)
    keys = key_rows(2, 16, 64)
    n_keys = torch.tensor([16, 6])
    q = torch.randn(2, 4, 1, 64)
    want = CPU.decode_attention(store, q, keys, n_keys, None)
    for field in store.fields.values():
        field.tensors[0][keys[1, 6:]] = float("nan")
    got = CPU.decode_attention(store, q, keys, n_keys, None)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "group"),
                         [(4, 2, 64, 32), (8, 2, 64, 64), (12, 4, 96, 32)])
def test_a_4bit_pool_is_dequantized_as_torch_dequantizes_it(q_heads: int, kv_heads: int, head_dim: int,
                                                            group: int) -> None:
    cfg = PRESETS["tiny"].replace(heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, hidden=q_heads * head_dim)
    store = KVStore(KVMode(int4=True, group_size=group), cfg, 128 * BS, BS, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(5)
    every = torch.arange(128 * BS)
    store.write(every, k=torch.randn(128 * BS, kv_heads, head_dim, generator=gen) * 3,
                v=torch.randn(128 * BS, kv_heads, head_dim, generator=gen))
    keys, n_keys = key_rows(3, 37, 128), torch.tensor([37, 20, 1])
    q = torch.randn(3, q_heads, 1, head_dim, generator=gen)
    got = CPU.decode_attention(store, q, keys, n_keys, mask_of(n_keys, 37))
    torch.testing.assert_close(got, TORCH.decode_attention(store, q, keys, n_keys, mask_of(n_keys, 37)),
                               rtol=1e-5, atol=1e-5)


def test_an_h_mode_pool_has_no_k_and_v_to_read() -> None:
    """The contexts never call it for h-mode (they recompute K and V from h); the backend says so."""
    store = pool(2, 64, "h-mode")
    with pytest.raises(KeyError):
        CPU.decode_attention(store, torch.randn(1, 4, 1, 64), key_rows(1, 4, 128), torch.tensor([4]), None)


REQS = [req(list(range(3 + 2 * i, 9 + 5 * i)), max_tokens=9, loops=1 + i % 3,
            sampling=SamplingParams(temperature=0, ignore_eos=True)) for i in range(5)]


@needs_kernel
@pytest.mark.parametrize("kv_mode", ["full", "int4"])
def test_the_engine_decodes_the_same_tokens_on_the_kernel_as_on_torch(kv_mode: str) -> None:
    on = make_engine(max_seq_len=128, block_size=8, kv_mode=kv_mode)
    off = make_engine(max_seq_len=128, block_size=8, kv_mode=kv_mode, cpu_kernels=False)
    assert on.model.backend.name == "cpu" and off.model.backend.name == "torch"
    with_kernel, without = on.generate_many(REQS), off.generate_many(REQS)
    shared = Engine(on.model, on.tokenizer, max_seq_len=128, block_size=8, kv_mode=kv_mode, cpu_kernels=False)
    assert shared.model.backend.name == "torch"  # the flag holds for a model another engine set up
    assert [r.tokens for r in with_kernel] == [r.tokens for r in without]
    assert on.kv_statistics().blocks_used == 0


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The kernels as if never loaded, building into an empty cache; as before afterwards."""
    saved = dict(kernels._state)
    kernels._state.clear()
    monkeypatch.setenv("TINYLOOP_CPU_CACHE", str(tmp_path))
    yield tmp_path
    kernels._state.clear()
    kernels._state.update(saved)


def test_without_a_compiler_the_engine_runs_on_torch(fresh_build: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    with pytest.raises(kernels.KernelUnavailable, match="no C compiler"):
        kernels.load()
    eng = make_engine(max_seq_len=64)
    assert eng.model.backend.name == "torch"
    assert eng.generate(REQS[0]).tokens
    assert "CPU kernels unavailable" in caplog.text and "no C compiler" in caplog.text
    assert not list(fresh_build.iterdir())


def test_a_named_compiler_that_is_missing_is_not_replaced_by_another(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYLOOP_CC", "/nonexistent/cc")
    assert kernels.compiler() is None  # (gcc is on this PATH: it is not taken in its place)
    monkeypatch.setenv("TINYLOOP_CC", "")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert kernels.compiler() in (None, "cc", "gcc", "clang")  # $CC is a hint: the usual names follow


def test_a_failed_build_says_why_and_is_not_retried(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "compiler", lambda: "false")  # a "compiler" that always fails
    with pytest.raises(kernels.KernelUnavailable, match="could not build"):
        kernels.load()
    calls: list[object] = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    assert not kernels.available() and not calls  # the reason is kept
    assert not list(fresh_build.iterdir())  # no half-built file left behind


@needs_kernel
def test_the_build_is_cached_by_source_and_compiler(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernels.load()
    built = list(fresh_build.glob("*.so"))
    assert len(built) == 1
    kernels._state.clear()
    real_run = subprocess.run
    compiles: list[list[str]] = []

    def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        if "--version" not in cmd:
            compiles.append(cmd)
        return real_run(cmd, **kw)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(subprocess, "run", run)
    kernels.load()  # the cached object: nothing compiles
    assert not compiles and list(fresh_build.glob("*.so")) == built


@needs_kernel
def test_the_benchmark_runs_and_prints_its_table() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "bench" / "decode_attention.py"), "--rows", "2", "--keys", "16",
                          "--repeat", "2", "--pool-mb", "4"], capture_output=True, text=True, timeout=120, check=True)
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:2] == ["2", "16"]]
    assert [r[2] for r in rows] == ["equal", "mixed"] and all(float(r[-1]) < 1e-5 for r in rows)


@needs_kernel
def test_a_cache_that_cannot_be_written_builds_for_this_process(fresh_build: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = fresh_build / "file"
    blocked.write_text("")
    monkeypatch.setenv("TINYLOOP_CPU_CACHE", str(blocked / "cpu"))  # under a file: mkdir fails
    assert kernels.available()
    eng = make_engine(max_seq_len=64)
    assert eng.model.backend.name == "cpu" and eng.generate(REQS[0]).tokens


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 256), (16, 1, 256), (3, 7, 100), (5, 768), (2, 3, 4, 33)])
def test_rms_norm_matches_torch(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x, weight = torch.randn(shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
    want = TORCH.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(CPU.rms_norm(x, weight, 1e-6), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(CPU.rms_norm_cast_first(x, weight, 1e-6), TORCH.rms_norm_cast_first(x, weight, 1e-6),
                               rtol=1e-5, atol=1e-6)


def test_rms_norm_off_its_cases_runs_torch() -> None:
    x = torch.randn(4, 64).t()  # not contiguous
    weight = torch.randn(4)
    assert torch.equal(CPU.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6))
    xb = torch.randn(3, 64).bfloat16()
    assert torch.equal(CPU.rms_norm(xb, torch.ones(64).bfloat16(), 1e-6),
                       TORCH.rms_norm(xb, torch.ones(64).bfloat16(), 1e-6))


@needs_kernel
@pytest.mark.parametrize("group", [32, 64])
def test_int4_writes_match_torchs_quantization_bit_for_bit(group: int) -> None:
    """Codes and fp16 (scale, minimum) as ``quantize_int4`` computes them: ordinary values, huge
    ones (past fp16's range), tiny ones (subnormal scales), constant groups, exact halves."""
    gen = torch.Generator().manual_seed(group)
    n, width = 12, 2 * 128
    x = torch.randn(n, width, generator=gen)
    x[1] *= 1e5
    x[2] *= 1e-6
    x[3, :group] = 0.75  # a constant group: scale 0
    x[4] = torch.randint(-8, 8, (width,), generator=gen).float() / 2  # ties to round
    x[5, :group] = torch.linspace(-1, 1, group)
    x[6] *= 7e4
    x[7, :group] = torch.arange(group) % 15 + 0.5  # codes half-way between two: to even
    x[7, 0], x[7, 1] = 0.0, 15.0  # (minimum 0, scale 1)
    x[8, :group] = 2.0
    x[8, 0] = 1 + 2**-11  # a minimum half-way between two fp16 values, to the even one below
    x[8, group:2 * group] = 2.0
    x[8, group] = 1 + 3 * 2**-11  # and to the even one above
    store = KVStore(KVMode(int4=True, group_size=group), PRESETS["tiny"].replace(
        heads=8, kv_heads=2, head_dim=128, hidden=1024), 32, 8, torch.float32, "cpu")
    rows = torch.randperm(32, generator=gen)[:n]
    values = x.view(n, 2, 128)
    CPU.kv_write(store, rows, k=values, v=values * -1)
    want = KVStore(KVMode(int4=True, group_size=group), PRESETS["tiny"].replace(
        heads=8, kv_heads=2, head_dim=128, hidden=1024), 32, 8, torch.float32, "cpu")
    TORCH.kv_write(want, rows, k=values, v=values * -1)
    for name in ("k", "v"):
        got_buf, want_buf = store.fields[name], want.fields[name]
        for got_t, want_t in zip(got_buf.tensors, want_buf.tensors, strict=True):
            assert torch.equal(got_t[rows].view(torch.uint8), want_t[rows].view(torch.uint8)), name


@needs_kernel
@pytest.mark.parametrize("mode", [None, "int4"])
def test_a_few_new_tokens_a_row_attend_causally(mode: str | None) -> None:
    """A chain's verify: row r's token t sees its first n_keys[r] + t keys."""
    store = pool(2, 64, mode)
    t, length = 5, 30
    keys = key_rows(3, length, 128)
    n_keys = torch.tensor([26, 10, 1])  # the first new token's count: the others see one more each
    q = torch.randn(3, 4, t, 64, generator=torch.Generator().manual_seed(4))
    visible = torch.arange(length)[None, None, :] < (n_keys[:, None, None] + torch.arange(t)[None, :, None])
    got = CPU.decode_attention(store, q, keys, n_keys, visible[:, None])
    torch.testing.assert_close(got, TORCH.decode_attention(store, q, keys, n_keys, visible[:, None]),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 17, 40])
@pytest.mark.parametrize(("n", "k"), [(16, 7), (24, 20), (100, 256), (4096, 64)])  # (24: two panels, the second short)
def test_panel_products_match_f_linear(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + n)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    panels = kernels.pack_panels(weight.t().contiguous().t())  # a column-major weight is read by its values
    assert panels.numel() == -(-n // kernels.PANEL) * kernels.PANEL * k
    tol = {"rtol": 1e-5, "atol": 1e-5 * k ** 0.5}
    torch.testing.assert_close(kernels.panel_matmul(x, panels, n, bias), torch.nn.functional.linear(x, weight, bias),
                               **tol)
    torch.testing.assert_close(kernels.panel_matmul(x, panels, n, None), x @ weight.t(), **tol)


@needs_kernel
def test_weights_packed_together_equal_each_packed_alone() -> None:
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(40, 24, generator=gen), torch.randn(33, 16, generator=gen),
               torch.randn(16, 8, generator=gen).t()]  # float32, a short last panel, a transposed view
    together = kernels.pack_panels_all(weights)
    assert [t.dtype for t in together] == [w.dtype for w in weights]
    for t, w in zip(together, weights, strict=True):
        assert torch.equal(t, kernels.pack_panels(w))
        assert t.data_ptr() % 64 == 0  # each on a cache line of its own
    assert kernels.pack_panels_all([]) == []


@needs_kernel
def test_float32_kv_writes_copy_rows_as_indexing_does() -> None:
    gen = torch.Generator().manual_seed(4)
    dst, x = torch.randn(50, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    rows = torch.tensor([7, 0, 49])
    want = dst.clone()
    want[rows] = x
    kernels.write_rows(x, rows, dst)
    assert torch.equal(dst, want)
    before = dst.clone()
    with pytest.raises(IndexError, match="outside the pool"):
        kernels.write_rows(x, torch.tensor([1, 50, 2]), dst)
    assert torch.equal(dst, before)  # nothing written
    store = pool(2, 16)
    rows = torch.tensor([3, 9])
    k, v = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    CPU.kv_write(store, rows, k=k, v=v)
    assert torch.equal(store.read("k", rows, torch.float32), k) and torch.equal(store.read("v", rows, torch.float32), v)
    strided = torch.tensor([[5, 0], [11, 0]])[:, 0]  # a batch's rows: a column of its context's table
    assert not strided.is_contiguous()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        CPU.kv_write(store, strided, k=k, v=v)
    assert not any("index_put" in e.name for e in prof.events())  # copied in C too
    assert torch.equal(store.read("k", strided, torch.float32), k)


@needs_kernel
def test_rows_slices_of_a_batch_are_read_in_place() -> None:
    """A layer's q, k and v are slices of its fused projections ([R, Hq + 2 Hkv, T, D]): the
    kernels read each row where it lies (``rows_of``) instead of copying them together."""
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(5, 4 + 2 + 2, 1, 16, generator=gen)
    q, k = qkv[:, :4], qkv[:, 4:6]
    assert kernels.rows_of(q) == (q, 8 * 16) and kernels.rows_of(k)[1] == 8 * 16
    assert kernels.rows_of(qkv[:1, :4])[1] == 4 * 16  # one row: no stride to speak of
    across = torch.randn(3, 16, 4)[:, :, 0]  # a row's values not adjacent: copied
    copied, stride = kernels.rows_of(across)
    assert copied.is_contiguous() and stride == 16 and torch.equal(copied, across)
    store = pool(2, 16)
    keys, n_keys = key_rows(5, 12, 128), torch.full((5,), 12)
    got = kernels.decode_attention(q, store.fields["k"].data, store.fields["v"].data, keys, n_keys)
    want = kernels.decode_attention(q.contiguous(), store.fields["k"].data, store.fields["v"].data, keys, n_keys)
    assert torch.equal(got, want)
    dst = torch.zeros(40, 2, 16)
    kernels.write_rows(k, torch.tensor([3, 9, 0, 31, 7]), dst)
    assert torch.equal(dst[torch.tensor([3, 9, 0, 31, 7])], k[:, :, 0])


@needs_kernel
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize(("rows", "heads", "tokens", "dim", "table_rows"),
                         [(1, 4, 1, 64, 1), (16, 6, 1, 64, 16), (3, 2, 5, 16, 3), (2, 3, 4, 8, 1),
                          (1, 5, 300, 64, 1), (2, 3, 200, 64, 2)])  # (the last two: a prefill's, threaded)
def test_rope_in_c_is_torchs_to_the_bit(style: str, rows: int, heads: int, tokens: int, dim: int,
                                        table_rows: int) -> None:
    gen = torch.Generator().manual_seed(rows * heads + tokens)
    x = torch.randn(rows, heads + 3, tokens, dim, generator=gen)[:, :heads] * 50  # a slice of q, k and v
    cos, sin = torch.randn(table_rows, tokens, dim, generator=gen), torch.randn(table_rows, tokens, dim, generator=gen)
    for c, s in ((cos[:, None], sin[:, None]), (cos, sin)):  # [R, 1, T, D] as the contexts give it, and [R, T, D]
        assert torch.equal(CPU.rope(x, c, s, style), TORCH.rope(x, c, s, style))
    half = x.to(torch.bfloat16)  # not float32: torch's ops
    assert torch.equal(CPU.rope(half, cos, sin, style), TORCH.rope(half, cos, sin, style))


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 100, 4099])
def test_max_rows_gives_argmax_and_the_samplers_check(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1] = 0.0  # all equal: the first
    x[2, vocab // 2:] = x[2].max() + 1  # ties: the first of them, in any lane
    x[3, -1] = float("nan")
    x[4, 0] = float("inf")
    x[5] = float("-inf")  # nothing finite
    x[6, :] = float("-inf")
    x[6, -1] = -1e30  # one finite value, the last
    x[7, vocab // 3] = float("-inf")
    x[8] = -0.0
    x[8, -1] = 0.0  # -0.0 and 0.0 are equal: the first
    where, usable = kernels.max_rows(x)
    want = x.argmax(dim=-1).tolist()
    top = x.amax(dim=-1)
    assert usable == torch.isfinite(top).tolist()
    assert [w for w, ok in zip(where, usable) if ok] == [w for w, ok in zip(want, usable) if ok]


@needs_kernel
def test_the_sampler_picks_the_same_with_and_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinyloop.engine.sampling import sample_batch
    from tinyloop.requests import SamplingParams

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3000, generator=gen)
    logits[1, 7] = float("nan")
    logits[3, 2999] = logits[3].max() + 2
    params = [SamplingParams(temperature=0)] * 4 + [SamplingParams(temperature=0.8, seed=1)]

    def picks() -> list[object]:
        gens = [torch.Generator().manual_seed(i) for i in range(5)]
        got = sample_batch(logits, params, gens, [[1]] * 5, [[]] * 5)
        return [None if r is None else r.token_id for r in got]

    kernels.load()
    with_kernel = picks()
    monkeypatch.setattr(kernels, "loaded", lambda: False)
    assert with_kernel == picks()
    assert with_kernel[1] is None and with_kernel[3] == 2999


@needs_kernel
@pytest.mark.parametrize("style", ["pre_ln", "sandwich", "peri_ln", "post_ln"])
@pytest.mark.parametrize("rows", [8, 37])
def test_a_prefills_residual_joins_run_threaded_in_c_as_op_by_op(style: str, rows: int) -> None:
    from tinyloop.cpu.backend import CPU
    from tinyloop.model.backend import TORCH, TorchBackend

    gen = torch.Generator().manual_seed(rows)
    x, a = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    w_in, w_out = torch.rand(96, generator=gen) + 0.5, torch.rand(96, generator=gen) + 0.5
    kernels.set_threads(2)
    try:
        for out_w in (w_out, None):
            got = CPU.residual_norm(x, a, None if style == "pre_ln" else w_in, out_w, style, 1e-6, False)
            # the same adds and C norms one op at a time (the path a decode step's few rows take)
            same = TorchBackend.residual_norm(CPU, x, a, None if style == "pre_ln" else w_in, out_w, style, 1e-6, False)
            torch_ops = TORCH.residual_norm(x, a, None if style == "pre_ln" else w_in, out_w, style, 1e-6, False)
            for g, s, t in zip(got, same, torch_ops):
                if s is None:
                    assert g is None and t is None
                    continue
                assert torch.equal(g, s)
                torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-5)
    finally:
        kernels.set_threads(1)


@needs_kernel
@pytest.mark.parametrize("shape", [(8, 2 * 50), (3, 7, 2 * 3072)])
def test_a_prefills_swiglu_runs_threaded_in_c(shape: tuple[int, ...]) -> None:
    from tinyloop.cpu.backend import CPU
    from tinyloop.model.backend import TORCH

    gen = torch.Generator().manual_seed(len(shape))
    fc = torch.randn(*shape, generator=gen) * 4
    fc.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    kernels.set_threads(2)
    try:
        got = CPU.swiglu(fc)
    finally:
        kernels.set_threads(1)
    want = TORCH.swiglu(fc)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def _fused_qkv(rows: int, tokens: int, q_heads: int, kv_heads: int, dim: int, seed: int):  # type: ignore[no-untyped-def]
    """q, k, v as a fused projection's slices give them: ``[R, H, T, D]`` views of one
    ``[R, T, HQ + 2 KVH, D]`` tensor (token stride past D, no copy)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, tokens, q_heads + 2 * kv_heads, dim, generator=gen) * 2
    q = qkv[:, :, :q_heads].transpose(1, 2)
    k = qkv[:, :, q_heads:q_heads + kv_heads].transpose(1, 2)
    v = qkv[:, :, q_heads + kv_heads:].transpose(1, 2)
    return q, k, v


@needs_kernel
@pytest.mark.parametrize(("rows", "q_heads", "kv_heads", "tokens", "dim"),
                         [(1, 4, 4, 2, 16), (1, 12, 12, 129, 64), (2, 4, 2, 37, 32), (3, 6, 1, 17, 128),
                          (1, 2, 2, 8, 80), (2, 3, 3, 300, 256)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_first_prefill_chunks_causal_attention_matches_sdpa(rows: int, q_heads: int, kv_heads: int, tokens: int,
                                                              dim: int, threads: int) -> None:
    q, k, v = _fused_qkv(rows, tokens, q_heads, kv_heads, dim, tokens)
    assert kernels.causal_covered(q, k, v)
    kernels.set_threads(threads)
    try:
        got = CPU.attention(q, k, v, None)
    finally:
        kernels.set_threads(1)
    want = TORCH.attention(q, k, v, None)
    assert got.shape == want.shape == (rows, q_heads, tokens, dim)
    group = q_heads // kv_heads
    exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(group, 1),
                                           v.double().repeat_interleave(group, 1), is_causal=True)
    # as close to the float64 result as torch's own float32 SDPA (the sums in another order)
    assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + 1e-6
    # the output projection's input is a view of it, not a copy
    assert got.transpose(1, 2).flatten(-2).data_ptr() == got.data_ptr()


@needs_kernel
def test_causal_attention_off_its_cases_runs_torch() -> None:
    q, k, v = _fused_qkv(1, 9, 2, 2, 24, 0)  # D not a multiple of 16
    assert not kernels.causal_covered(q, k, v)
    torch.testing.assert_close(CPU.attention(q, k, v, None), TORCH.attention(q, k, v, None))
    q, k, v = _fused_qkv(1, 9, 2, 2, 32, 0)
    assert not kernels.causal_covered(q.double(), k.double(), v.double())
    assert not kernels.causal_covered(q.requires_grad_(), k, v)
    assert not kernels.causal_covered(q[:, :, :5], k, v)  # fewer queries than keys: a later chunk, masked
