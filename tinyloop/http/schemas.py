"""Request bodies, validated by pydantic: a bad or unknown field is a 400 naming it.

``extra="forbid"`` everywhere: a parameter this server does not implement (``best_of`` above
``n``, ``suffix``, ``audio``, ...) is refused by name, never silently ignored; a request with
several is refused naming every one (``errors.from_validation``). An explicit ``null`` is the
field left out, as OpenAI takes it (``Strict._nulls_are_absent``), and values that change
nothing (``tools: []``, ``tool_choice: "none"``, ``response_format: {"type": "text"}``,
``logit_bias: {}``, ``store: false``, ``metadata``) are accepted. docs/openai-compatibility.md
lists every field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from tinyloop.requests import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MIN_REPETITION_PENALTY,
    Constraint,
)
from tinyloop.vocabulary import EXIT_KINDS

__all__ = [
    "FieldError", "Knobs", "ChatMessage", "Tool", "NamedTool", "OpenAIBase", "NativeConstraint",
    "ChatCompletionRequest", "CompletionRequest", "StreamOptions",
    "GenerateBase", "GenerateRequest", "SpeculativeRequest", "TreeSpeculativeRequest", "TokenizeRequest",
    "DetokenizeRequest",
]

Float = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0)]
MAX_PROMPTS = 64  # prompts in one completions request (lm-eval batches; each is a choice group)
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class FieldError(ValueError):
    """A cross-field check that failed, naming the field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Strict(BaseModel):
    """A body (or part of one) that refuses unknown fields and takes ``null`` as absent."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    NULLABLE: ClassVar[frozenset[str]] = frozenset()  # fields where null means something of its own

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        """``{"temperature": null}`` is ``{}``: the field's default, as OpenAI and vLLM read it."""
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items() if v is not None or k in cls.NULLABLE}
        return data


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
    top_k: int = Field(0, ge=-1, description="0 or -1 (vLLM's spelling): off")
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


def _logit_bias(value: dict[str, Float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as (id, bias) pairs, checked (ids as decimal strings,
    biases in [-100, 100], at most 1024 entries)."""
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise FieldError("logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens")
    out = []
    for key, bias in value.items():
        if not key.isdecimal() or len(key) > 12:
            raise FieldError("logit_bias", f"keys must be token ids (decimal strings); got {key!r}")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise FieldError("logit_bias", f"biases must be in [-100, 100]; got {bias} for token {key}")
        out.append((int(key), float(bias)))
    return tuple(out)


class Sampling(Knobs):
    """OpenAI's sampling fields plus the knobs, and vLLM's sampling extras."""

    temperature: Float = Field(1.0, ge=0, le=2)
    top_p: Float = Field(1.0, gt=0, le=1)
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    user: str | None = Field(None, max_length=256)
    speculation: Speculation | None = Field(None, description="self-speculative decoding (default: off)")
    logit_bias: dict[str, Float] = Field(default_factory=dict, description="token id -> bias in [-100, 100]")
    min_tokens: int = Field(0, ge=0, description="vLLM's: no EOS, stop token or stop string before this many")
    include_stop_str_in_output: bool = Field(False, description="vLLM's: keep a matched stop string in the text")
    # accepted and ignored: they change nothing here (docs/openai-compatibility.md says why)
    store: bool = False
    metadata: dict[str, str] | None = Field(None, max_length=16)
    service_tier: str | None = Field(None, max_length=32)
    prompt_cache_key: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    _bias: tuple[tuple[int, float], ...] = PrivateAttr(())

    @model_validator(mode="after")
    def _stop_strings(self) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 16 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise FieldError("stop", f"at most 16 non-empty strings of at most {MAX_STOP_CHARS} characters")
        self._bias = _logit_bias(self.logit_bias)
        return self

    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs."""
        return self._bias

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
    continuous_usage_stats: bool = Field(False, description="vLLM's: usage on every chunk")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field("", description="the call's arguments as a JSON string")


class ToolCall(Strict):
    id: str = Field("", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    """One turn of the history: an agent's replayed ``tool_calls`` and ``tool`` results included."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, max_length=256)
    reasoning_content: str | None = None  # a reply's reasoning sent back (ignored by most templates)

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise FieldError("messages", "only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise FieldError("messages", "a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""

    def turn(self) -> dict[str, Any]:
        """The message as chat templates get it (transformers' ``apply_chat_template``): text
        content, and ``tool_calls``, ``tool_call_id``, ``name`` where present."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionSpec(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = Field(None, max_length=16_384)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedTool(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedTool


class JsonSchemaSpec(Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class Structured(Strict):
    """``response_format`` (both OpenAI routes)."""

    response_format: ResponseFormat | None = None

    def constraint(self) -> Constraint | None:
        """The output constraint ``response_format`` asks for (None: free text)."""
        match self.response_format:
            case JsonObjectFormat():
                return Constraint("json_object")
            case JsonSchemaFormat(json_schema=spec):
                schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
                return Constraint("json_schema", json.dumps(schema))
        return None


class OpenAIBase(Sampling, RouterDefaults, Structured):
    """What chat and text completions share beyond sampling."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM's: the prompt tokens' logprobs")
    best_of: int | None = Field(None, ge=1, le=16, description="accepted when it equals n (no extra choices)")

    @model_validator(mode="after")
    def _shared(self) -> OpenAIBase:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of > n (sampling extra choices to return the best) is not "
                             "supported; use n, or beam search on /generate (num_beams)")
        return self


class ChatCompletionRequest(OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=-1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's: extra template variables")
    add_generation_prompt: bool = Field(True, description="vLLM's: open the assistant's turn")

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        if isinstance(self.tool_choice, NamedTool) and not self.tools:
            raise FieldError("tool_choice", "tool_choice names a function but no tools are given")
        if self.tool_choice == "required" and not self.tools:
            raise FieldError("tool_choice", "tool_choice 'required' needs tools")
        return self

    def active_tools(self) -> list[Tool]:
        """The tools the model is offered: none when ``tool_choice`` is ``none``."""
        return [] if self.tool_choice == "none" else list(self.tools or ())


class CompletionRequest(OpenAIBase):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="text, texts, token ids, or lists of token ids: one choice group per prompt")
    max_tokens: int | None = Field(16, ge=-1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"max_tokens"})  # null: no limit but the context

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        prompts = self.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise FieldError("prompt", "prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise FieldError("prompt", f"at most {MAX_PROMPTS} prompts a request")
        if self.echo and self.stream and self.logprobs is not None:
            raise FieldError("echo", "echo with logprobs is not supported when streaming; "
                             "send stream: false to score a prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [[int(x) for x in p]]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class NativeConstraint(Strict):
    """Structured output on the native routes: at most one of a JSON schema, a regular
    expression or a grammar (the dialect ``tinyloop.grammar`` documents)."""

    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _at_most_one(self) -> NativeConstraint:
        given = [k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None]
        if len(given) > 1:
            raise FieldError(given[1], f"give at most one of json_schema, regex, grammar; got {', '.join(given)}")
        return self

    def constraint(self) -> Constraint | None:
        if self.json_schema is not None:
            return Constraint("json_schema", json.dumps(self.json_schema))
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.grammar is not None:
            return Constraint("grammar", self.grammar)
        return None

    def constraint_param(self) -> str:
        """The field a bad constraint is blamed on."""
        return next((k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None),
                    "json_schema")


class GenerateBase(Knobs, NativeConstraint):
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
