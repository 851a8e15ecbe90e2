"""The kernel seam: a second backend plugged into the model runs every norm, RoPE, KV write and
read and attention of a forward, and (delegating to the torch reference) changes nothing."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.engine.test_engine import make_engine, req
from tinyloop.engine.engine import Engine
from tinyloop.model.backend import TORCH, Backend
from tinyloop.model.kvstore import KVStore
from tinyloop.requests import GenerationRequest, SamplingParams
from tinyloop.vocabulary import ExitRule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recording:
    """A backend that counts its calls and hands each to the torch reference."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls["rms_norm"] += 1
        return TORCH.rms_norm(x, weight, eps)

    def rms_norm_cast_first(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls["rms_norm"] += 1
        return TORCH.rms_norm_cast_first(x, weight, eps)

    def residual_norm(self, x: torch.Tensor, a: torch.Tensor, w_in: torch.Tensor | None,
                      w_out: torch.Tensor | None, style: str, eps: float,
                      cast_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls["residual_norm"] += 1
        return TORCH.residual_norm(x, a, w_in, w_out, style, eps, cast_first)

    def swiglu(self, fc: torch.Tensor) -> torch.Tensor:
        self.calls["swiglu"] += 1
        return TORCH.swiglu(fc)

    def rope_qk(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
                q_bias: torch.Tensor | None, k_bias: torch.Tensor | None,
                compute_float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls["rope_qk"] += 1
        return TORCH.rope_qk(q, k, cos, sin, style, q_bias, k_bias, compute_float32)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
        self.calls["rope"] += 1
        return TORCH.rope(x, cos, sin, style)

    def kv_write(self, store: KVStore, rows: torch.Tensor, **values: torch.Tensor) -> None:
        self.calls["kv_write"] += 1
        TORCH.kv_write(store, rows, **values)

    def kv_read(self, store: KVStore, name: str, rows: torch.Tensor,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        self.calls["kv_read"] += 1
        return TORCH.kv_read(store, name, rows, dtype)

    def kv_copy(self, store: KVStore, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.calls["kv_copy"] += 1
        TORCH.kv_copy(store, src, dst)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        self.calls["attention"] += 1
        return TORCH.attention(q, k, v, mask)

    def decode_attention(self, store: KVStore, q: torch.Tensor, rows: torch.Tensor, n_keys: torch.Tensor,
                         mask: torch.Tensor | None, tree: torch.Tensor | None = None) -> torch.Tensor:
        self.calls["decode_attention"] += 1
        return TORCH.decode_attention(store, q, rows, n_keys, mask, tree)

    def paged_attention(self, store: KVStore, q: torch.Tensor, tables: torch.Tensor, n_keys: torch.Tensor,
                        max_keys: int) -> torch.Tensor:
        self.calls["paged_attention"] += 1  # (the decode graphs' static step: not run here)
        return TORCH.paged_attention(store, q, tables, n_keys, max_keys)


GREEDY = SamplingParams(temperature=0, ignore_eos=True)
REQUESTS = [
    req([5, 6, 7, 8, 9], max_tokens=8, loops=3, sampling=SamplingParams(temperature=0.8, seed=3, ignore_eos=True)),
    req([10, 11, 12], max_tokens=8, loops=4, mode="tree", draft_loops=1, draft_ahead=3, k_branches=2,
        sampling=GREEDY),
    req([20, 21], max_tokens=6, loops=4, exit=ExitRule("latent_diff", 10.0, min_loops=2), sampling=GREEDY),
    req([30, 31, 32], max_tokens=5, mode="beam", num_beams=2, sampling=GREEDY),
    req(list(range(40, 60)), max_tokens=3, loops=2, sampling=GREEDY),  # a 20-token prefill: K and V gathered
]


def run(engine: Engine, requests: list[GenerationRequest]) -> tuple[torch.Tensor, list[list[int]]]:
    seq = engine.start(requests[0])
    logits = engine.prefill(seq)
    engine.free(seq)
    return logits, [r.tokens for r in engine.generate_many(requests)]


@pytest.mark.parametrize("kv_mode", ["full", "int4", "h-mode"])
def test_a_second_backend_plugs_in_and_gives_identical_logits(kv_mode: str) -> None:
    reference = run(make_engine(max_seq_len=128, block_size=8, kv_mode=kv_mode, cpu_kernels=False), REQUESTS)
    # (no C kernels: their panel products would change the logits beside the backend's seam)
    engine = make_engine(max_seq_len=128, block_size=8, kv_mode=kv_mode, cpu_kernels=False)
    recording = Recording()
    backend: Backend = recording  # the protocol is all the model asks of it
    engine.model.use_backend(backend)
    logits, tokens = run(engine, REQUESTS)
    assert torch.equal(logits, reference[0])
    assert tokens == reference[1]
    decode = set() if kv_mode == "h-mode" else {"decode_attention"}  # K and V stored: decode reads them by row
    # a first prefill chunk over a full-precision pool attends its own k and v: nothing read back
    reads = set() if kv_mode == "full" else {"kv_read"}
    assert set(recording.calls) == {"rms_norm", "residual_norm", "swiglu", "rope", "kv_write", "kv_copy",
                                    "attention", *decode, *reads}
    # every paged attention stores first
    assert recording.calls["kv_write"] == recording.calls["attention"] + recording.calls["decode_attention"]
    engine.model.use_backend(TORCH)
    before = sum(recording.calls.values())
    assert run(engine, REQUESTS[:1])[1] == reference[1][:1]
    assert sum(recording.calls.values()) == before  # switched back: nothing reaches it any more


@pytest.mark.parametrize("style", ["sandwich", "peri_ln", "pre_ln", "post_ln"])
def test_a_stack_of_blocks_norms_each_input_in_the_block_before(style: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a stack (prelude, each loop's core, coda) a block's input norm comes out of the block
    before's last residual call (``Block.run``): only the first block of a stack runs it alone,
    and the logits are bitwise those of every block norming its own input."""
    from tinyloop.model.context import FullContext
    from tinyloop.model.looped import LoopedLM, RowSpec
    from tinyloop.model.presets import PRESETS, init_model

    model = init_model(PRESETS["tiny"].replace(n_prelude=2, n_core=3, n_coda=2, block_style=style), seed=3)
    recording = Recording()
    model.use_backend(recording)  # type: ignore[arg-type]
    tokens = torch.arange(5, 12)[None]

    def forward() -> tuple[torch.Tensor, int]:
        recording.calls.clear()
        with torch.inference_mode():
            out = model(tokens, FullContext(model.rope, 1, tokens.shape[1], recording), [RowSpec(loops=4, window=4)])
        return out.logits, recording.calls["rms_norm"]

    stacked, chained = forward()

    def one_by_one(self: LoopedLM, blocks: torch.nn.ModuleList, x: torch.Tensor, ctx: object, rows: object,
                   base: object, ids: object = None) -> torch.Tensor:
        for i, block in enumerate(blocks):
            x = block(x, ctx, self.rope, rows, base + i, ids)  # type: ignore[operator]
        return x
    monkeypatch.setattr(LoopedLM, "stack", one_by_one)
    alone, apart = forward()
    assert torch.equal(stacked, alone)
    applications, firsts = 2 + 4 * 3 + 2, 1 + 4 + 1  # the prelude's, each loop's core's and the coda's first
    assert apart - chained == (0 if style == "post_ln" else applications - firsts)
