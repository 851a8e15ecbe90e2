"""Evaluation through the serving model's own forward: text loss and addition accuracy per loop count.

Both go through ``LoopedLM.forward`` on a ``FullContext`` in float32, so the numbers describe
the model as ``tinyloop`` will run it, not the training composition.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tinyloop.model.context import FullContext
from tinyloop.model.looped import LoopedLM, RowSpec
from tinyloop.tokenizer import Tokenizer

__all__ = ["val_loss", "addition_accuracy", "addition_prefix"]


@torch.no_grad()
def _logits(model: LoopedLM, tokens: torch.Tensor, loops: int, last_only: bool) -> torch.Tensor:
    bsz, n_tok = tokens.shape
    ctx = FullContext(model.rope, bsz, n_tok)
    specs = [RowSpec(loops=loops, window=loops) for _ in range(bsz)]
    logits: torch.Tensor = model(tokens, ctx, specs, last_only=last_only).logits
    return logits


@torch.no_grad()
def val_loss(model: LoopedLM, windows: torch.Tensor, loops: int, batch: int = 16) -> float:
    """Mean next-token cross-entropy over ``windows`` (``[N, T + 1]``) at ``loops`` loops."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        logits = _logits(model, chunk[:, :-1], loops, last_only=False)
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += chunk[:, 1:].numel()
    return total / count


def addition_prefix(arith_stream: np.ndarray, tokenizer: Tokenizer, n_problems: int = 0) -> str:
    """A newline after the first ``n_problems`` lines of the training addition stream.

    The default is a bare newline: without a KV cache every generated token re-runs the whole
    prompt, and a few-shot context made the evaluation several times slower than the problems.
    """
    text = tokenizer.decode(arith_stream[:400].tolist())
    return "\n" + "".join(line + "\n" for line in text.split("\n")[:n_problems])


@torch.no_grad()
def addition_accuracy(model: LoopedLM, tokenizer: Tokenizer, pairs: np.ndarray, loops: int,
                      prefix: str = "\n", max_new: int | None = None) -> float:
    """Greedy exact match on ``prefix + "a+b="``: the text before the first newline must be a+b.

    ``max_new`` (default: the longest sum's digits plus the newline, digits being one token
    each) bounds the tokens generated. Prompts of equal token length form one batch, so no
    padding is needed.
    """
    if max_new is None:
        max_new = max((len(str(a + b)) for a, b in pairs.tolist()), default=0) + 1
    groups: dict[int, list[tuple[list[int], int]]] = defaultdict(list)
    for a, b in pairs.tolist():
        ids = tokenizer.encode(f"{prefix}{a}+{b}=")
        groups[len(ids)].append((ids, a + b))
    correct = 0
    for items in groups.values():
        tokens = torch.tensor([ids for ids, _ in items], dtype=torch.long)  # [B, T]
        for _ in range(max_new):
            logits = _logits(model, tokens, loops, last_only=True)  # [B, 1, V]
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        plen = len(items[0][0])
        for row, (_, answer) in zip(tokens[:, plen:].tolist(), items):
            text = tokenizer.decode(row)
            correct += text.split("\n", 1)[0] == str(answer)
    return correct / max(len(pairs), 1)


def evaluate(model: LoopedLM, tokenizer: Tokenizer, windows: torch.Tensor, pairs: np.ndarray,
             loop_counts: Sequence[int], prefix: str) -> dict[str, dict[int, float]]:
    """``{"val_loss": {loops: loss}, "add_acc": {loops: accuracy}}``."""
    was_training = model.training
    model.eval()
    try:
        return {
            "val_loss": {r: val_loss(model, windows, r) for r in loop_counts},
            "add_acc": {r: addition_accuracy(model, tokenizer, pairs, r, prefix) for r in loop_counts},
        }
    finally:
        model.train(was_training)
