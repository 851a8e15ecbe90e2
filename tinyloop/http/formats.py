"""Response shapes: OpenAI's objects, and LM Studio's extras (stats, model_info, runtime)."""

from __future__ import annotations

from typing import Any

import tinyloop
from tinyloop.http.service import ServedModel, describe
from tinyloop.requests import GenerationResult, TokenLogprob
from tinyloop.tokenizer import Tokenizer

__all__ = ["usage", "chat_logprobs", "completion_logprobs", "lmstudio_extras", "draft_stats", "STOP_REASONS"]

STOP_REASONS = {"eos": "eosFound", "stop_token": "eosFound", "stop_string": "stopStringFound",
                "length": "maxPredictedTokensReached", "cancelled": "userStopped"}


def usage(results: list[GenerationResult]) -> dict[str, int]:
    prompt = results[0].prompt_tokens if results else 0
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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
    if lps is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text, _ = _token(tok, lp.token_id)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({_token(tok, tid)[0]: v for tid, v in lp.top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


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
