"""Request bodies, validated by pydantic: a bad or unknown field is a 400 naming it.

``extra="forbid"`` everywhere: a parameter this server does not implement (``tools``,
``logit_bias``, ``best_of``, ...) is refused by name, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tinyloop.requests import MAX_REPETITION_PENALTY, MAX_STOP_CHARS, MIN_REPETITION_PENALTY
from tinyloop.vocabulary import EXIT_KINDS

__all__ = [
    "FieldError", "Knobs", "ChatMessage", "ChatCompletionRequest", "CompletionRequest", "StreamOptions",
    "GenerateBase", "GenerateRequest", "SpeculativeRequest", "TreeSpeculativeRequest", "TokenizeRequest",
    "DetokenizeRequest",
]

Float = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class FieldError(ValueError):
    """A cross-field check that failed, naming the field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ExitSpec(Strict):
    """A per-request exit rule (``ExitRule`` in ``tinyloop/vocabulary.py``): stop a token's loops
    once it has converged (``kl``, ``minp_kl``, ``entropy_diff``, ``latent_diff``, ``cosine``,
    ``argmax_stability``: Huginn's criteria; ``gate``: Ouro's gate), or run every loop and choose
    what feeds the head (``gate_select``, ``gate_expected``: Ouro's reference semantics). The
    reference's hyphenated names (``minp-kl``) are accepted. ``threshold`` defaults to the
    reference's default for the kind; ``min_steps`` is the reference's name for ``min_loops - 1``."""

    kind: str
    threshold: Float | None = Field(None, gt=0)
    min_loops: int | None = Field(None, ge=1)
    min_steps: int | None = Field(None, ge=0)
    check_every: int = Field(1, ge=1, description="check the rule every n loops")
    exited_kv: Literal["copy_latest", "skip"] = Field(
        "copy_latest", description="what later tokens read in an exited token's unwritten loop slots")

    @model_validator(mode="after")
    def _checks(self) -> ExitSpec:
        kind = self.kind.replace("-", "_")
        if kind not in EXIT_KINDS:
            raise FieldError("exit", f"exit.kind must be one of {', '.join(EXIT_KINDS)}; got {self.kind!r}")
        if self.min_loops is not None and self.min_steps is not None:
            raise FieldError("exit", "give exit.min_loops or exit.min_steps (= min_loops - 1), not both")
        self.kind = kind
        return self

    def first_loop(self) -> int:
        """``min_loops`` (1 when neither it nor ``min_steps`` is given)."""
        if self.min_steps is not None:
            return self.min_steps + 1
        return self.min_loops or 1


class Knobs(Strict):
    """TinyLoop's knobs, accepted by every generation endpoint."""

    loops: int | None = Field(None, ge=1, description="loops per token (default: the model's)")
    cache_window: int | None = Field(None, ge=1, description="KV slots kept per core layer")
    warm_start: bool | Literal["raw", "normed"] = Field(
        False, description="start each token from the previous token's final state (true = raw)")
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first")
    slo_ms: Float | None = Field(None, gt=0, description="reject with 503 if the queue wait would exceed it")
    top_k: int = Field(0, ge=0)
    min_p: Float = Field(0.0, ge=0, le=1)
    repetition_penalty: Float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    exit: ExitSpec | None = Field(None, description="adaptive exit rule (default: the model's)")


class Speculation(Strict):
    """Self-speculative decoding on the OpenAI and LM Studio routes: draft with the same weights
    at ``draft_loops``, verify at the request's loops; the output is what plain decoding gives."""

    draft_loops: int = Field(1, ge=1, description="loops of the draft (at most the request's loops)")
    draft_ahead: int = Field(4, ge=1, le=64, description="tokens drafted per branch and step")
    branches: int = Field(1, ge=1, le=16, description="1: a chain; more: a tree with this many first tokens")


class Sampling(Knobs):
    """OpenAI's sampling fields plus the knobs."""

    temperature: Float = Field(1.0, ge=0, le=2)
    top_p: Float = Field(1.0, gt=0, le=1)
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    user: str | None = Field(None, max_length=256)
    speculation: Speculation | None = Field(None, description="self-speculative decoding (default: off)")

    @model_validator(mode="after")
    def _stop_strings(self) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 16 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise FieldError("stop", f"at most 16 non-empty strings of at most {MAX_STOP_CHARS} characters")
        return self

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class RouterDefaults(Strict):
    """Fields that vLLM's and SGLang's routers (vllm-router) add to every body they forward, each at
    its default. Accepted at that value only, the one that matches what TinyLoop does; any other
    value is a 400 naming the field, as for a parameter this server does not implement."""

    no_stop_trim: Literal[False] = False
    skip_special_tokens: Literal[True] = True
    return_hidden_states: Literal[False] = False
    continue_final_message: Literal[False] = False
    separate_reasoning: Literal[True] = True
    stream_reasoning: Literal[True] = True
    include_reasoning: Literal[True] = True


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(Sampling, RouterDefaults):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=-1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.max_tokens == 0:
            raise FieldError("max_tokens", "max_tokens must be >= 1 (or -1 for no limit)")
        return self


class CompletionRequest(Sampling, RouterDefaults):
    model: str | None = None
    prompt: str | list[TokenId] = Field(description="text, or token ids")
    max_tokens: int | None = Field(16, ge=-1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.max_tokens == 0:
            raise FieldError("max_tokens", "max_tokens must be >= 1 (or -1 for no limit)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "prompt must not be empty")
        return self


class GenerateBase(Knobs):
    """What every native generation body has: text or raw token ids, and every knob."""

    prompt: str | None = None
    prompt_tokens: list[TokenId] | None = None
    max_tokens: int = Field(64, ge=1)
    temperature: Float = Field(0.0, ge=0, le=2)
    top_p: Float = Field(1.0, gt=0, le=1)
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    sample_seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: list[StopString] | None = Field(None, max_length=16)
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBase:
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise FieldError("prompt", "give exactly one of prompt (text) or prompt_tokens (ids)")
        if self.prompt_tokens is not None and not self.prompt_tokens:
            raise FieldError("prompt_tokens", "prompt_tokens must not be empty")
        return self


class GenerateRequest(GenerateBase):
    """The native ``/generate`` body. ``num_beams > 1`` runs a beam search (greedy, so
    ``temperature`` must be 0); a streamed beam search sends all its tokens at once, when the
    search ends."""

    num_beams: int = Field(1, ge=1, le=16, description="beam search width (1: no beam search)")
    length_penalty: Float | None = Field(None, ge=-10, le=10,
                                         description="beam score = sum_logprob / len ** length_penalty")

    @model_validator(mode="after")
    def _beam(self) -> GenerateRequest:
        if self.length_penalty is not None and self.num_beams == 1:
            raise FieldError("length_penalty", "length_penalty needs num_beams > 1")
        if self.num_beams > 1 and self.temperature > 0:
            raise FieldError("temperature", "beam search is deterministic: temperature must be 0")
        return self


class SpeculativeRequest(GenerateBase):
    draft_loops: int = Field(1, ge=1)
    verify_loops: int | None = Field(None, ge=1)
    draft_ahead: int = Field(4, ge=1, le=64)


class TreeSpeculativeRequest(SpeculativeRequest):
    K_branches: int = Field(2, ge=1, le=16)


class TokenizeRequest(Strict):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(Strict):
    tokens: list[TokenId]
    model: str | None = None


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(ref_template="#/components/schemas/{model}")
