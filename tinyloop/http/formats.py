"""Response shapes: OpenAI's objects, and LM Studio's extras (stats, model_info, runtime)."""

from __future__ import annotations

from typing import Any

import tinyloop
from tinyloop.http.service import ServedModel, describe
from tinyloop.requests import GenerationResult, TokenLogprob
from tinyloop.tokenizer import Tokenizer

__all__ = ["usage", "chat_logprobs", "completion_logprobs", "echo_logprobs", "prompt_logprobs", "lmstudio_extras",
           "draft_stats", "STOP_REASONS"]

STOP_REASONS = {"eos": "eosFound", "stop_token": "eosFound", "stop_string": "stopStringFound",
                "length": "maxPredictedTokensReached", "cancelled": "userStopped"}


def usage(results: list[GenerationResult], n: int = 1) -> dict[str, Any]:
    """OpenAI's usage of ``results`` (``n`` choices a prompt, prompt-major): each prompt counted
    once, with the prompt tokens whose KV came from the prefix cache (``cached_tokens``)."""
    firsts = results[::max(n, 1)]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


def _token(tok: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tok.token_bytes(token_id, skip_special=False)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tok: Tokenizer, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        text, raw = _token(tok, lp.token_id)
        top = []
        for tid, value in lp.top:
            t_text, t_raw = _token(tok, tid)
            top.append({"token": t_text, "logprob": value, "bytes": t_raw})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(tok: Tokenizer, lps: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """Legacy completions' logprobs: each token's ``top_logprobs`` holds the N best and the
    sampled token too when it is not among them (as OpenAI and vLLM; ``logprobs: 0`` gives the
    sampled token alone)."""
    if lps is None:
        return None
    return _legacy(tok, [(lp.token_id, lp) for lp in lps], offset)


def _legacy(tok: Tokenizer, entries: list[tuple[int, TokenLogprob | None]], offset: int) -> dict[str, Any]:
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, lp in entries:
        text, _ = _token(tok, token_id)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        values.append(None if lp is None else lp.logprob)
        if lp is None:
            tops.append(None)
            continue
        top = {_token(tok, tid)[0]: v for tid, v in lp.top}
        top.setdefault(text, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(tok: Tokenizer, prompt: list[int], prompt_lps: list[TokenLogprob | None] | None,
                  lps: list[TokenLogprob] | None) -> dict[str, Any]:
    """An echo's logprobs: the prompt's tokens first (the first one's ``null``: nothing
    predicts it), then the completion's, one list, offsets running across both."""
    scored = prompt_lps if prompt_lps is not None else [None] * len(prompt)
    entries = [(t, lp) for t, lp in zip(prompt, scored)] + [(lp.token_id, lp) for lp in lps or ()]
    return _legacy(tok, entries, 0)


def prompt_logprobs(tok: Tokenizer, lps: list[TokenLogprob | None] | None, n: int) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {"logprob",
    "rank", "decoded_token"}}`` for the token itself and the ``n`` best (``rank``: 1 for the
    best, None for the token itself when it is not among them)."""
    if lps is None:
        return None
    out: list[Any] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(tid): {"logprob": v, "rank": r + 1, "decoded_token": _token(tok, tid)[0]}
                 for r, (tid, v) in enumerate(lp.top[:n])}
        if str(lp.token_id) not in entry:
            ranks = [tid for tid, _ in lp.top]
            entry[str(lp.token_id)] = {"logprob": lp.logprob,
                                       "rank": ranks.index(lp.token_id) + 1 if lp.token_id in ranks else None,
                                       "decoded_token": _token(tok, lp.token_id)[0]}
        out.append(entry)
    return out


def draft_stats(result: GenerationResult) -> dict[str, Any]:
    """A speculative result's draft counts under LM Studio's stats names ({} otherwise)."""
    if result.draft_tokens is None:
        return {}
    return {"total_draft_tokens_count": result.draft_tokens,
            "accepted_draft_tokens_count": result.accepted_draft_tokens,
            "rejected_draft_tokens_count": result.rejected_draft_tokens}


def lmstudio_stats(result: GenerationResult, context_limited: bool) -> dict[str, Any]:
    wall = result.wall_ms / 1000
    ttft = (result.time_to_first_token_ms or 0.0) / 1000
    gen = max(wall - ttft, 1e-9)
    stop = STOP_REASONS.get(result.stop_reason, "eosFound")
    if result.stop_reason == "length" and context_limited:
        stop = "contextLengthReached"
    tps = (result.completion_tokens - 1) / gen if result.completion_tokens > 1 else 0.0
    return {"tokens_per_second": round(tps, 3), "time_to_first_token": round(ttft, 6),
            "generation_time": round(gen, 6), "stop_reason": stop,
            "loops": result.loops_used, "mean_loops": result.mean_loops, **draft_stats(result)}


def lmstudio_extras(model: ServedModel, result: GenerationResult, commit: str | None,
                    context_limited: bool) -> dict[str, Any]:
    return {
        "stats": lmstudio_stats(result, context_limited),
        "model_info": {"arch": model.arch, "quant": model.quant, "format": "tinyloop",
                       "context_length": model.max_seq_len, "kv_cache_mode": model.kv_cache_mode,
                       "loops": result.loops_used, **describe(model)},
        "runtime": {"name": "tinyloop", "version": tinyloop.__version__,
                    "supported_formats": ["tinyloop"], "commit": commit},
    }


def model_card(model: ServedModel, lmstudio: bool) -> dict[str, Any]:
    card: dict[str, Any] = {"id": model.id, "object": "model", "created": model.created,
                            "owned_by": "tinyloop", "max_model_len": model.max_seq_len, **describe(model)}
    if lmstudio:
        card.update({"type": "llm", "publisher": "tinyloop", "arch": model.arch,
                     "compatibility_type": "tinyloop", "quantization": model.quant,
                     "state": "loaded", "max_context_length": model.max_seq_len,
                     "default_loops": model.default_loops, "max_loops": model.max_loops})
    return card
