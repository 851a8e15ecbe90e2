"""Request bodies, validated by pydantic: a bad or unknown field is a 400 naming it.

``extra="forbid"`` everywhere: a parameter this server does not implement (``tools``,
``logit_bias``, ``best_of``, ...) is refused by name, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "FieldError", "Knobs", "ChatMessage", "ChatCompletionRequest", "CompletionRequest", "StreamOptions",
    "GenerateRequest", "SpeculativeRequest", "TreeSpeculativeRequest", "TokenizeRequest",
    "DetokenizeRequest",
]

Float = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0)]


class FieldError(ValueError):
    """A cross-field check that failed, naming the field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Knobs(Strict):
    """TinyLoop's knobs, accepted by every generation endpoint."""

    loops: int | None = Field(None, ge=1, description="loops per token (default: the model's)")
    cache_window: int | None = Field(None, ge=1, description="KV slots kept per core layer")
    warm_start: bool = False
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first")
    slo_ms: Float | None = Field(None, gt=0, description="reject with 503 if the queue wait would exceed it")
    top_k: int = Field(0, ge=0)
    min_p: Float = Field(0.0, ge=0, le=1)
    repetition_penalty: Float = Field(1.0, gt=0, le=10)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    ignore_eos: bool = False


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

    @model_validator(mode="after")
    def _stop_strings(self) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise FieldError("stop", "at most 16 non-empty strings")
        return self

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


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


class ChatCompletionRequest(Sampling):
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


class CompletionRequest(Sampling):
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


class GenerateRequest(Knobs):
    """The native ``/generate`` body: text or raw token ids, and every knob."""

    prompt: str | None = None
    prompt_tokens: list[TokenId] | None = None
    max_tokens: int = Field(64, ge=1)
    temperature: Float = Field(0.0, ge=0, le=2)
    top_p: Float = Field(1.0, gt=0, le=1)
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    sample_seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=16)
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise FieldError("prompt", "give exactly one of prompt (text) or prompt_tokens (ids)")
        if self.prompt_tokens is not None and not self.prompt_tokens:
            raise FieldError("prompt_tokens", "prompt_tokens must not be empty")
        return self


class SpeculativeRequest(GenerateRequest):
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
