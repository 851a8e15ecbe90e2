"""bfloat16 weights on CPU: what a converted checkpoint served in bf16 relies on."""

from __future__ import annotations

import torch
from torch.profiler import profile

from tests.model.test_looped import make_model
from tinyloop.model.context import FullContext
from tinyloop.model.looped import RowSpec


@torch.inference_mode()
def test_a_bf16_prefill_never_copies_the_head_weight() -> None:
    """The last position of a prefill reaches the head as a strided ``[B, 1, H]`` view; a 3-D
    strided input sends ``F.linear`` to ``bmm``, which (for bf16, with frozen weights as loaded)
    copies the whole head weight first: 1.5 s per prefill chunk at Ouro-1.4B's vocabulary."""
    model = make_model(vocab_size=4096, tie_embeddings=False).to(torch.bfloat16).requires_grad_(False)
    tokens = torch.randint(0, 4096, (2, 8), generator=torch.Generator().manual_seed(0))
    ctx = FullContext(model.rope, 2, 8)
    specs = [RowSpec(loops=2, window=2)] * 2
    full = model(tokens, ctx, specs, last_only=False).logits  # [2, 8, V]
    with profile(profile_memory=True) as prof:
        last = model(tokens, ctx, specs).logits  # [2, 1, V]
    weight = model.lm_head.weight
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest < weight.numel() * weight.element_size(), f"an allocation of {largest} bytes"
    assert last.shape == (2, 1, 4096) and torch.equal(last, full[:, -1:])
