"""Choosing the next token: a pure function of logits, ``SamplingParams``, history and a generator.

Every request owns a CPU ``torch.Generator`` (``make_generator``) and is sampled on its own row,
so its draws are the same whether it runs alone or in a batch of any size or composition: no
random number is ever shared between requests, and greedy rows draw none.

The pipeline of ``sample_token``:

1. ``logit_bias`` added to the raw logits, then, while the output is shorter than
   ``min_tokens``, EOS (unless ``ignore_eos``) and ``stop_token_ids`` set to -inf
   (``bias_and_mask``: OpenAI's and vLLM's order, before any penalty);
2. penalties (``apply_penalties``): repetition (HF style), presence and frequency (OpenAI style);
   steps 1 and 2 together are ``adjust_logits``, which every mode's choice of a token goes through;
3. greedy (``temperature == 0``): argmax, ties to the lowest id; otherwise
4. ``softmax(logits / temperature)`` in float32, then top-k, top-p (on the top-k distribution,
   as HF chains them), min-p, each renormalising, and one inverse-CDF draw (``draw``: one
   uniform from the request's generator) over the tokens left.

Logprobs are reported from ``log_softmax`` of the raw logits, before bias, penalties, temperature
and filters, as vLLM does by default, so they describe the model rather than the sampler; the
prompt's logprobs (``logprob_entries``) likewise.

The EOS ids the ``min_tokens`` rule keeps out are the tokenizer's, which the engine passes as
``eos_ids``; left empty, only ``stop_token_ids`` are kept out.

``StopMatcher`` cuts stop strings out of the streamed text (or keeps them, with
``include_stop_str_in_output``), holding back only what could still become one.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from tinyloop.cpu import kernels
from tinyloop.engine import batch_sampling
from tinyloop.engine.batch_sampling import banned_tokens, bias_table
from tinyloop.requests import SamplingParams, TokenLogprob

__all__ = [
    "SampleResult",
    "StopMatcher",
    "adjust_logits",
    "apply_penalties",
    "banned_tokens",
    "bias_and_mask",
    "bias_table",
    "draw",
    "greedy_token",
    "greedy_token_prob",
    "is_plain_greedy",
    "picks_argmax",
    "logprob_entries",
    "make_generator",
    "sample_batch",
    "sample_token",
    "target_probs",
    "token_logprob",
]

_SEED_MODULUS = 2**64  # torch seeds are uint64; negatives already map by two's complement


@dataclass(frozen=True, slots=True)
class SampleResult:
    """One chosen token, and its logprob when the request asked for logprobs."""

    token_id: int
    logprob: TokenLogprob | None = None


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed``, or from OS entropy when ``seed`` is None.

    Seeds are reduced modulo 2**64 so any Python int is accepted (torch itself rejects seeds
    outside 64 bits); a negative seed gives the same stream as ``torch.manual_seed`` would.
    """
    generator = torch.Generator(device="cpu")
    value = secrets.randbits(64) if seed is None else seed % _SEED_MODULUS
    generator.manual_seed(value)
    return generator


def bias_and_mask(logits: torch.Tensor, params: SamplingParams, produced: int,
                  eos_ids: Collection[int] = ()) -> torch.Tensor:
    """``logits`` [V] (any device and dtype) plus ``logit_bias``, with ``banned_tokens`` at -inf;
    the input itself when neither applies, else a new tensor."""
    out = logits
    if params.logit_bias:
        ids, values = bias_table(params.logit_bias)
        out = out.index_add(0, torch.tensor(ids, dtype=torch.long, device=out.device),
                            torch.tensor(values, dtype=out.dtype, device=out.device))  # [V]
    banned = [t for t in banned_tokens(params, produced, eos_ids) if t < logits.shape[-1]]
    if banned:
        out = out.index_fill(0, torch.tensor(banned, dtype=torch.long, device=out.device), float("-inf"))  # [V]
    return out


def adjust_logits(logits: torch.Tensor, params: SamplingParams, prompt_tokens: Sequence[int],
                  output_tokens: Sequence[int], eos_ids: Collection[int] = ()) -> torch.Tensor:
    """``logits`` [V] as every mode chooses from them: ``bias_and_mask``, then the penalties."""
    masked = bias_and_mask(logits, params, len(output_tokens), eos_ids)
    return apply_penalties(masked, params, prompt_tokens, output_tokens)


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
) -> torch.Tensor:
    """``logits`` [V] with repetition, presence and frequency penalties applied.

    The repetition penalty covers every token seen in prompt or output: positive logits are
    divided by it, negative ones multiplied, so a penalty > 1 always makes a seen token less
    likely. Presence and frequency cover the output only: ``logit -= presence * (count > 0) +
    frequency * count``. The input is never modified; it is returned as is when no penalty
    applies.
    """
    penalised = logits
    if params.repetition_penalty != 1.0 and (prompt_tokens or output_tokens):
        penalised = _repetition_penalty(penalised, params.repetition_penalty,
                                        [*prompt_tokens, *output_tokens])
    if (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0) and output_tokens:
        penalised = _output_penalties(penalised, params.presence_penalty,
                                      params.frequency_penalty, output_tokens)
    return penalised


def _repetition_penalty(logits: torch.Tensor, penalty: float, seen: Sequence[int]) -> torch.Tensor:
    """A copy of ``logits`` [V] with each seen token penalised once, however often it was seen."""
    ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)  # [U]
    picked = logits.index_select(0, ids)  # [U]
    penalised = torch.where(picked > 0, picked / penalty, picked * penalty)  # [U]
    return logits.index_copy(0, ids, penalised)  # [V]


def _output_penalties(
    logits: torch.Tensor, presence: float, frequency: float, output_tokens: Sequence[int]
) -> torch.Tensor:
    """``logits`` [V] minus presence and frequency penalties counted over the output tokens."""
    ids = torch.tensor(output_tokens, dtype=torch.long, device=logits.device)  # [N]
    counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)  # [V]
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts  # [V]


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    *,
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    eos_ids: Collection[int] = (),
) -> SampleResult:
    """The next token for one request from its ``logits`` [V], and its logprob if asked for.

    Greedy requests never touch ``generator``; sampled ones draw exactly once from it.
    """
    raw = logits.detach().to(device="cpu", dtype=torch.float32)  # [V]
    penalised = adjust_logits(raw, params, prompt_tokens, output_tokens, eos_ids)  # [V]
    if params.greedy:
        token_id = int(torch.argmax(penalised))  # argmax returns the first maximum: lowest id
    else:
        token_id = draw(_filtered_probs(penalised, params), generator)
    return SampleResult(token_id, _logprob(raw, token_id, params))


def greedy_token(logits: torch.Tensor, params: SamplingParams, prompt_tokens: Sequence[int],
                 output_tokens: Sequence[int], eos_ids: Collection[int] = ()) -> int:
    """The token a greedy ``sample_token`` picks from ``logits`` [V] after this history."""
    raw = logits.detach().to(device="cpu", dtype=torch.float32)  # [V]
    return int(torch.argmax(adjust_logits(raw, params, prompt_tokens, output_tokens, eos_ids)))


def greedy_token_prob(logits: torch.Tensor, params: SamplingParams, prompt_tokens: Sequence[int],
                      output_tokens: Sequence[int], eos_ids: Collection[int] = ()) -> tuple[int, float]:
    """``greedy_token``, and its probability under the adjusted logits at temperature 1 (how
    sure the model is of it)."""
    raw = logits.detach().to(device="cpu", dtype=torch.float32)  # [V]
    penalised = adjust_logits(raw, params, prompt_tokens, output_tokens, eos_ids)  # [V]
    top = torch.argmax(penalised)
    # softmax: one op (logsumexp is several, each a parallel region: 5 against 17-25 us at 4096 tokens)
    return int(top), float(torch.softmax(penalised, dim=-1)[top])


def target_probs(logits: torch.Tensor, params: SamplingParams, prompt_tokens: Sequence[int],
                 output_tokens: Sequence[int], eos_ids: Collection[int] = ()) -> torch.Tensor:
    """The distribution [V] a sampled ``sample_token`` draws from after this history: bias,
    ``min_tokens``' mask, penalties, temperature, top-k, top-p, min-p. Speculative decoding
    accepts and resamples against it, so its output has exactly the distribution of plain
    sampling."""
    raw = logits.detach().to(device="cpu", dtype=torch.float32)  # [V]
    return _filtered_probs(adjust_logits(raw, params, prompt_tokens, output_tokens, eos_ids), params)


def token_logprob(logits: torch.Tensor, token_id: int, params: SamplingParams) -> TokenLogprob | None:
    """What ``sample_token`` reports for ``token_id`` chosen from ``logits`` [V] (None unless the
    request asked for logprobs)."""
    return _logprob(logits.detach().to(device="cpu", dtype=torch.float32), token_id, params)


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Renormalised probabilities [V] after temperature, top-k, top-p and min-p.

    Each filter keeps every token tied with its cut-off probability (as HF and vLLM do), so the
    result never depends on how a sort orders ties, and the most likely token always survives.
    """
    # Shifting by the max first keeps a tiny temperature from overflowing to inf (and then NaN):
    # the shift cancels in the softmax, and the limit is one-hot on the maximum. A temperature
    # below float32's smallest normal would round to 0 in the division (0/0 = NaN at the max),
    # so it is raised to that floor, which already gives the limit.
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    scaled = (logits - logits.max()) / temperature  # [V]
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if 0 < params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = _keep_at_least(probs, kth)  # [V]
    if params.top_p < 1.0:
        probs = _keep_at_least(probs, _nucleus_floor(probs, params.top_p))  # [V]
    if params.min_p > 0.0:
        probs = _keep_at_least(probs, params.min_p * probs.max())  # [V]
    return probs


def _keep_at_least(probs: torch.Tensor, floor: torch.Tensor | float) -> torch.Tensor:
    """``probs`` [V] with every probability below ``floor`` zeroed, renormalised to sum to 1."""
    kept = torch.where(probs >= floor, probs, torch.zeros_like(probs))  # [V]
    return kept / kept.sum()  # [V]


def _nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest probability in the nucleus: the fewest most-likely tokens with mass >= top_p.

    Sorting the whole vocabulary dominates sampling time at V ~ 32k on a CPU, so only the
    tokens within 1e-4 of the max are sorted when they alone hold enough mass (they usually
    number a few hundred); the nucleus is a prefix of the sorted order, so it lies among them.
    """
    head = probs.masked_select(probs >= probs.max() * 1e-4)  # [H]
    if float(head.sum()) < top_p + 1e-3:  # the margin absorbs rounding in the cumsum below
        head = probs  # [V]
    values = torch.sort(head, descending=True).values  # [H]
    mass_before = torch.cumsum(values, dim=-1) - values  # [H]
    return values[int((mass_before < top_p).sum()) - 1]


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from ``probs`` [V] (need not be normalised) with ``generator``, among the
    tokens left non-zero: the first whose cumulative mass exceeds a uniform draw times the total.

    Inverse-CDF sampling takes one random number a draw (``torch.multinomial`` takes one per
    entry), so ``batch_sampling.sample_rows`` draws a batch on any device exactly as each row
    here: the same uniform from the same generator, the same float32 arithmetic. The sums run
    over the tokens left only: adding a zero changes no running sum, so the pick is the one the
    whole vocabulary's sums give.
    """
    support = probs.nonzero().squeeze(-1)  # [S]
    kept = probs if support.shape[0] == probs.shape[0] else probs.index_select(0, support)
    cdf = torch.cumsum(kept if kept.dtype == torch.float32 else kept.float(), dim=-1)  # [S]
    total = cdf[-1]
    if not 0.0 < float(total) < math.inf:
        raise ValueError("sampling probabilities must have a positive, finite sum")
    target = torch.rand((), generator=generator, device="cpu") * total  # float32, as the batched draw computes it
    index = min(int(torch.searchsorted(cdf, target.reshape(1), right=True)), kept.shape[0] - 1)
    return index if kept is probs else int(support[index])


def _logprob(raw: torch.Tensor, token_id: int, params: SamplingParams) -> TokenLogprob | None:
    """``token_id``'s logprob under the raw ``raw`` [V] logits and the best alternatives."""
    if not params.logprobs and params.top_logprobs == 0:
        return None
    logprobs = torch.log_softmax(raw, dim=-1)  # [V]
    top = _top_logprobs(logprobs, params.top_logprobs) if params.top_logprobs > 0 else ()
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


def _top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` best (id, logprob) pairs of ``logprobs`` [V], best first, ties to the lower id.

    ``topk`` finds the cut-off cheaply but orders ties arbitrarily, so every token at or above
    it is gathered in id order and stably sorted.
    """
    n = min(n, logprobs.shape[-1])
    floor = torch.topk(logprobs, n).values[-1]
    ids = (logprobs >= floor).nonzero().squeeze(-1)  # [C] ascending ids, C >= n
    values, order = torch.sort(logprobs[ids], descending=True, stable=True)  # [C], [C]
    return tuple(zip(ids[order[:n]].tolist(), values[:n].tolist()))


def logprob_entries(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """For each row ``i`` of ``logits`` ``[M, V]`` (raw, any device), ``tokens[i]``'s logprob
    under it and the ``top`` best alternatives (best first, ties to the lower id): what
    ``sample_token`` reports for a token chosen from each row, computed for all rows at once
    (the prompt's logprobs)."""
    logprobs = torch.log_softmax(logits.detach().float(), dim=-1)  # [M, V]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device)  # [M]
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()  # [M]
    if top == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    # on the CPU a cut-off per row (``topk``) is cheaper than sorting every row
    tops = [_top_logprobs(row, top) for row in logprobs] if logprobs.is_cpu else _sorted_tops(logprobs, top)
    return [TokenLogprob(t, lp, best) for t, lp, best in zip(tokens, chosen, tops)]


def _sorted_tops(logprobs: torch.Tensor, n: int) -> list[tuple[tuple[int, float], ...]]:
    """``_top_logprobs`` of every row of ``logprobs`` ``[M, V]`` at once, where they are: a stable
    sort keeps equal values in id order, and only the ``n`` best of each row come to the host."""
    values, order = logprobs.sort(dim=-1, descending=True, stable=True)  # [M, V]
    return [tuple(zip(i, v)) for i, v in zip(order[:, :n].tolist(), values[:, :n].tolist())]


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    prompt_tokens: Sequence[Sequence[int]],
    output_tokens: Sequence[Sequence[int]],
    eos_ids: Collection[int] = (),
) -> list[SampleResult | None]:
    """One ``SampleResult`` per row of ``logits`` [B, V], each as ``sample_token`` gives alone;
    None for a row whose logits hold a NaN or +inf or no finite value (nothing to sample from).

    On the CPU, rows that are greedy with no bias, ``min_tokens``, penalties or logprobs share
    one vectorised argmax (the same first-maximum rule as ``sample_token``) and every other row is sampled on
    its own. On a GPU every row is sampled there with its logprobs
    (``batch_sampling.sample_on_device``: the same picks) and one transfer brings the ids,
    the logprobs and the check of the logits to the host: never the logits themselves.
    """
    batch = logits.shape[0]
    if not len(params) == len(generators) == len(prompt_tokens) == len(output_tokens) == batch:
        raise ValueError(
            f"sample_batch needs one params, generator and history per row: {batch} rows, "
            f"{len(params)} params, {len(generators)} generators, {len(prompt_tokens)} prompts, "
            f"{len(output_tokens)} outputs"
        )
    rows = logits.detach()  # [B, V]
    if _on_device(rows):
        picked = batch_sampling.sample_on_device(rows, params, generators, prompt_tokens, output_tokens, eos_ids)
        return [None if r is None else SampleResult(*r) for r in picked]
    rows = rows.float()
    # one pass: the row maximum is NaN when any logit is, +inf when one is, -inf when none is
    # finite; where it is finite its index is the argmax (the first maximum, as argmax picks)
    if kernels.loaded() and rows.is_contiguous():  # (the CPU kernels the engine runs on: one C pass)
        where, usable = kernels.max_rows(rows)
    else:
        top, first = rows.max(dim=-1)  # [B]
        where, usable = first.tolist(), torch.isfinite(top).tolist()
    fast = [i for i, p in enumerate(params) if usable[i] and is_plain_greedy(p)]
    argmax = [where[i] for i in fast]  # [F]
    results: dict[int, SampleResult | None] = dict(zip(fast, (SampleResult(int(t)) for t in argmax)))
    for i in range(batch):
        if i not in results:
            results[i] = None if not usable[i] else sample_token(
                rows[i], params[i], generators[i], prompt_tokens=prompt_tokens[i], output_tokens=output_tokens[i],
                eos_ids=eos_ids)
    return [results[i] for i in range(batch)]


def _on_device(logits: torch.Tensor) -> bool:
    """Whether ``sample_batch`` samples where the logits are (a GPU) rather than row by row."""
    return not logits.is_cpu


def picks_argmax(params: SamplingParams) -> bool:
    """True when a row's token is just the argmax of its raw logits (greedy, nothing adjusting them)."""
    return (params.greedy and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and not params.logit_bias and params.min_tokens == 0)


def is_plain_greedy(params: SamplingParams) -> bool:
    """True when a row's token is just the argmax of its logits, with nothing to report."""
    return picks_argmax(params) and not params.logprobs and params.top_logprobs == 0


class StopMatcher:
    """Cuts stop strings out of streamed text.

    ``feed`` returns the text that is safe to emit: everything except a trailing piece that could
    still grow into a stop string, which is held back until the next feed settles it. When a stop
    string completes, the text before its earliest occurrence is returned with ``stopped=True``
    and the stop string itself is never emitted; with ``include`` (vLLM's
    ``include_stop_str_in_output``) the text runs to the end of that stop string instead (of the
    shortest, when several begin there: it completed first). A feed that is not ``armed`` (the
    output is still shorter than ``min_tokens``) matches nothing: a stop string completed then
    is emitted as text, as vLLM checks none before ``min_tokens``. ``flush`` hands back the held
    text when generation ends for another reason.
    """

    __slots__ = ("_stops", "_held", "_stopped", "_include")

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string")
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = tuple(stop)
        self._held = ""
        self._stopped = False
        self._include = include

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen."""
        return self._stopped

    def __repr__(self) -> str:
        return f"StopMatcher(stops={self._stops!r}, held={self._held!r}, stopped={self._stopped})"

    def feed(self, text: str, armed: bool = True) -> tuple[str, bool]:
        """Newly detokenised ``text`` in; (text safe to emit now, whether a stop string ended it)."""
        if self._stopped:
            raise RuntimeError("StopMatcher.feed called after a stop string was matched")
        if not self._stops:
            return text, False
        buffer = self._held + text
        found = _earliest_stop(buffer, self._stops) if armed else None
        if found is not None:
            self._held, self._stopped = "", True
            return buffer[:found[1] if self._include else found[0]], True
        keep = _partial_stop_suffix(buffer, self._stops)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back text, emitted when generation ends without a stop string."""
        held, self._held = self._held, ""
        return held


def _earliest_stop(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """(start, end) of the earliest stop string in ``text`` (the shortest of those that begin
    there), or None when none occurs."""
    found = [(i, i + len(s)) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    return min(found) if found else None


def _partial_stop_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

    Held text is bounded by the longest stop string, so a stop can never begin in text that
    was already emitted.
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
