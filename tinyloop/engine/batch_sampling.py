"""A batch's rows sampled together on the logits' device: ``sampling.sample_token``'s pipeline as
batched tensor ops, so that on a GPU the logits never cross to the host, only the chosen ids.

Per row, as ``sample_token`` does it: ``logit_bias`` and ``min_tokens``' mask (scattered into the
rows that have them, the others untouched), penalties (repetition over prompt and output,
presence and frequency over the output), then the argmax of a greedy row, or temperature,
top-k, top-p (on the top-k distribution), min-p, each renormalising and keeping ties, and one
inverse-CDF draw.
The uniforms come from each row's own generator, drawn on the host in row order, one per sampled
row: the generators advance exactly as ``sample_token`` advances them, so a request draws the
same whether it is sampled here or alone, up to the rounding of another device's reductions.
``sample_on_device`` runs it for a whole batch with the rows' logprobs and a check of their
logits, and brings it all to the host in one transfer. ``bias_table`` and ``banned_tokens``, which
both paths use, live here because ``sampling`` imports this module (never the other way).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

import torch

from tinyloop.requests import SamplingParams, TokenLogprob

__all__ = ["banned_tokens", "bias_table", "sample_on_device", "sample_rows"]


@functools.lru_cache(maxsize=256)
def bias_table(logit_bias: tuple[tuple[int, float], ...]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``logit_bias`` as (token ids, biases), one entry per token (a repeated id: its last bias,
    as a dict built from the pairs keeps it). Cached: a request's pairs are the same every step."""
    table = dict(logit_bias)
    return tuple(table), tuple(table.values())


def banned_tokens(params: SamplingParams, produced: int, eos_ids: Collection[int] = ()) -> list[int]:
    """The tokens ``min_tokens`` keeps out after ``produced`` output tokens, ascending: EOS
    (unless ``ignore_eos``) and ``stop_token_ids`` while ``produced < min_tokens``, else none."""
    if produced >= params.min_tokens:
        return []
    return sorted({*params.stop_token_ids, *(() if params.ignore_eos else eos_ids)})


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                prompt_tokens: Sequence[Sequence[int]], output_tokens: Sequence[Sequence[int]],
                eos_ids: Collection[int] = ()) -> torch.Tensor:
    """The chosen token of every row of ``logits`` ``[B, V]``, ``[B]`` int64 on its device
    (``eos_ids``: what ``min_tokens`` keeps out besides ``stop_token_ids``)."""
    x = _biased(logits.detach().float(), params, output_tokens, eos_ids)  # [B, V]
    x = _penalised(x, params, prompt_tokens, output_tokens)  # [B, V]
    tokens = x.argmax(dim=-1)  # [B] greedy rows: the first maximum, as sample_token
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    dev = x.device
    at = torch.tensor(sampled, dtype=torch.long, device=dev)
    probs = _filtered(x if len(sampled) == len(params) else x[at], [params[i] for i in sampled])  # [S, V]
    cdf = probs.cumsum(dim=-1)  # [S, V]
    uniform = torch.stack([torch.rand((), generator=generators[i], device="cpu") for i in sampled])  # [S] on the host
    target = uniform.to(dev, non_blocking=True) * cdf[:, -1]  # [S] float32, as sampling.draw
    return tokens.index_copy(0, at, _pick(cdf, probs, target))


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                     prompt_tokens: Sequence[Sequence[int]], output_tokens: Sequence[Sequence[int]],
                     eos_ids: Collection[int] = ()) -> list[tuple[int, TokenLogprob | None] | None]:
    """Every row of ``logits`` ``[B, V]`` sampled where the logits are (``sample_rows``), with
    its logprobs when the row asks (the chosen token's under the raw logits and the
    ``top_logprobs`` best alternatives, best first, ties to the lower id: ``sampling._logprob``),
    and whether its logits are usable, all in one transfer to the host: the step's only wait
    for the device. None for a row whose logits hold a NaN or +inf or no finite value (its
    draw, if any, is spent: the caller fails that row's request)."""
    x = logits.detach()
    usable = torch.isfinite(x.amax(dim=-1))  # [B] one pass: NaN or +inf max, or -inf (nothing finite)
    tokens = sample_rows(x, params, generators, prompt_tokens, output_tokens, eos_ids)  # [B]
    parts = [tokens.double(), usable.double()]
    want = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs]
    n = min(max((params[i].top_logprobs for i in want), default=0), x.shape[-1])
    if want:
        at = torch.tensor(want, dtype=torch.long, device=x.device)
        lp = torch.log_softmax(x[at].float(), dim=-1)  # [W, V]
        columns = [lp.gather(1, tokens[at][:, None])]  # [W, 1] the chosen token's
        if n:
            values, ids = lp.sort(dim=-1, descending=True, stable=True)  # equal values keep id order
            columns += [values[:, :n], ids[:, :n].to(lp.dtype)]  # ids < 2**24: exact in float32
        parts.append(torch.cat(columns, dim=1).double().flatten())  # [W * (1 + 2n)]
    host = torch.cat(parts).tolist()
    b, width = len(params), 1 + 2 * n
    out: list[tuple[int, TokenLogprob | None] | None] = [
        (int(t), None) if ok else None for t, ok in zip(host[:b], host[b:2 * b])]
    for j, i in enumerate(want):
        chosen = out[i]
        if chosen is not None:
            row = host[2 * b + j * width:2 * b + (j + 1) * width]
            k = min(params[i].top_logprobs, n)
            top = tuple(zip((int(v) for v in row[1 + n:1 + n + k]), row[1:1 + k]))
            out[i] = (chosen[0], TokenLogprob(chosen[0], row[0], top))
    return out


def _pick(cdf: torch.Tensor, probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of ``cdf`` ``[..., V]`` (of ``probs``) the first token whose cumulative mass
    exceeds ``target`` ``[...]``; a target rounded up to the total takes the last non-zero token."""
    index = torch.searchsorted(cdf, target[..., None], right=True)[..., 0]  # [...]
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)  # [...] the last non-zero token
    return torch.minimum(index, last)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # [R, 1]


def _biased(x: torch.Tensor, params: Sequence[SamplingParams], output_tokens: Sequence[Sequence[int]],
            eos_ids: Collection[int]) -> torch.Tensor:
    """``x`` [B, V] with each row's ``logit_bias`` added and its ``banned_tokens`` at -inf
    (``sampling.bias_and_mask``), batched: one scatter each over the rows that have any."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    banned_rows: list[int] = []
    banned_cols: list[int] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            ids, biases = bias_table(p.logit_bias)  # one entry per token: no duplicate index
            rows += [i] * len(ids)
            cols += ids
            values += biases
        banned = [t for t in banned_tokens(p, len(output_tokens[i]), eos_ids) if t < x.shape[-1]]
        banned_rows += [i] * len(banned)
        banned_cols += banned
    dev = x.device
    if rows:
        at = (torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(cols, dtype=torch.long, device=dev))
        x = x.index_put(at, torch.tensor(values, dtype=x.dtype, device=dev), accumulate=True)  # [B, V]
    if banned_rows:
        at = (torch.tensor(banned_rows, dtype=torch.long, device=dev),
              torch.tensor(banned_cols, dtype=torch.long, device=dev))
        x = x.index_put(at, torch.tensor(float("-inf"), dtype=x.dtype, device=dev))  # [B, V]
    return x


def _penalised(x: torch.Tensor, params: Sequence[SamplingParams], prompt_tokens: Sequence[Sequence[int]],
               output_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
    """``x`` [B, V] with each row's penalties (``sampling.apply_penalties``), batched."""
    dev = x.device
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and (prompt_tokens[i] or output_tokens[i])]
    if rep:
        seen = [sorted({*prompt_tokens[i], *output_tokens[i]}) for i in rep]
        width = max(map(len, seen))  # padded with a row's own first id: scattered again, the same value
        ids = torch.tensor([s + [s[0]] * (width - len(s)) for s in seen], dtype=torch.long, device=dev)  # [R, U]
        rows = torch.tensor(rep, dtype=torch.long, device=dev)
        penalty = _column([params[i].repetition_penalty for i in rep], x)
        picked = x[rows].gather(1, ids)  # [R, U]
        x = x.index_copy(0, rows, x[rows].scatter(1, ids, torch.where(picked > 0, picked / penalty, picked * penalty)))
    out = [i for i, p in enumerate(params) if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
           and output_tokens[i]]
    if out:
        width = max(len(output_tokens[i]) for i in out)
        ids = torch.tensor([[*output_tokens[i], *[0] * (width - len(output_tokens[i]))] for i in out],
                           dtype=torch.long, device=dev)  # [R, N]
        ones = torch.tensor([[1.0] * len(output_tokens[i]) + [0.0] * (width - len(output_tokens[i])) for i in out],
                            dtype=x.dtype, device=dev)  # [R, N] the padding counts nothing
        rows = torch.tensor(out, dtype=torch.long, device=dev)
        counts = torch.zeros((len(out), x.shape[-1]), dtype=x.dtype, device=dev).scatter_add_(1, ids, ones)  # [R, V]
        presence = _column([params[i].presence_penalty for i in out], x)
        frequency = _column([params[i].frequency_penalty for i in out], x)
        x = x.index_copy(0, rows, x[rows] - presence * (counts > 0).to(x.dtype) - frequency * counts)
    return x


def _filtered(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Renormalised probabilities ``[R, V]`` after each row's temperature, top-k, top-p and
    min-p (``sampling._filtered_probs``); a row without a filter is left as that filter found it."""
    vocab = x.shape[-1]
    tiny = torch.finfo(torch.float32).tiny
    scaled = (x - x.max(dim=-1, keepdim=True).values) / _column([max(p.temperature, tiny) for p in params], x)
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        ranked = probs.sort(dim=-1, descending=True).values  # [R, V]
        k = torch.tensor([k or vocab for k in top_k], dtype=torch.long, device=x.device)[:, None]
        probs = _where(top_k, _keep_at_least(probs, ranked.gather(1, k - 1)), probs)
    if any(p.top_p < 1.0 for p in params):
        ranked = probs.sort(dim=-1, descending=True).values  # [R, V]
        mass_before = ranked.cumsum(dim=-1) - ranked
        inside = (mass_before < _column([p.top_p for p in params], x)).sum(dim=-1, keepdim=True)  # [R, 1]
        inside = inside.clamp_(min=1)  # >= 1 but in a row of NaN (its request fails; no index -1 on a GPU)
        probs = _where([p.top_p < 1.0 for p in params], _keep_at_least(probs, ranked.gather(1, inside - 1)), probs)
    if any(p.min_p > 0.0 for p in params):
        floor = _column([p.min_p for p in params], x) * probs.max(dim=-1, keepdim=True).values
        probs = _where([p.min_p > 0.0 for p in params], _keep_at_least(probs, floor), probs)
    return probs


def _keep_at_least(probs: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """``probs`` [R, V] with every probability below its row's ``floor`` [R, 1] zeroed, renormalised."""
    kept = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def _where(rows: Sequence[object], yes: torch.Tensor, no: torch.Tensor) -> torch.Tensor:
    """``yes`` in the rows whose entry of ``rows`` is truthy, ``no`` in the others."""
    mask = torch.tensor([bool(r) for r in rows], dtype=torch.bool, device=yes.device)[:, None]
    return torch.where(mask, yes, no)
