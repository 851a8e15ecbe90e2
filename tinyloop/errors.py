"""Every exception TinyLoop raises.

The tree::

    TinyLoopError
    ├── ConfigError              a model config or setting is invalid
    ├── ArtifactError            a .tinyloop file is missing, truncated or inconsistent
    ├── TokenizerError           a tokenizer cannot be built or used
    │   └── ChatTemplateError    the model's chat template fails or overruns its limits
    ├── RequestError             a request is invalid before any work is done
    │   └── PromptTooLongError   prompt + max_tokens exceeds max_seq_len
    ├── EngineError              model work failed while running a request
    │   ├── KVCacheExhausted     no free KV blocks for a sequence
    │   └── EngineBroken         the engine cannot run any more work (runtime unhealthy)
    └── SchedulerError           the runtime refused or lost a request
        ├── QueueFullError       the queue is at max_queue_depth
        ├── AdmissionRejected    the SLO cannot be met (carries predicted_wait_ms)
        └── SchedulerShutdown    submitted after shutdown began

HTTP maps RequestError to 400, SchedulerError to 503, and EngineError and ChatTemplateError (the
model's fault, not the request's) to 500.
"""

from __future__ import annotations

__all__ = [
    "TinyLoopError",
    "ConfigError",
    "ArtifactError",
    "TokenizerError",
    "ChatTemplateError",
    "RequestError",
    "PromptTooLongError",
    "EngineError",
    "KVCacheExhausted",
    "EngineBroken",
    "SchedulerError",
    "QueueFullError",
    "AdmissionRejected",
    "SchedulerShutdown",
]


class TinyLoopError(Exception):
    """Root of every TinyLoop exception."""


class ConfigError(TinyLoopError, ValueError):
    """Raised when a model config or a setting has an invalid value; the message names the field."""


class ArtifactError(TinyLoopError):
    """Raised when a .tinyloop artifact cannot be loaded or written.

    The message names the file and what is wrong with it: missing, truncated, wrong format
    version, a missing or misshapen tensor, or metadata that does not parse.
    """


class TokenizerError(TinyLoopError):
    """Raised when a tokenizer cannot be built, or a token id is outside its vocabulary."""


class ChatTemplateError(TokenizerError):
    """Raised when the model's chat template cannot make a prompt: it is too big or does not
    compile, fails while rendering, or overruns its ``RenderLimits`` (output, one value, work,
    time). The template's fault, not the request's: HTTP answers 500. A template refusing
    the messages with its own ``raise_exception`` is a plain ``TokenizerError`` instead."""


class RequestError(TinyLoopError, ValueError):
    """Raised when a request is invalid before any model work; ``param`` names the field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(RequestError):
    """Raised when ``len(prompt_tokens) + max_tokens > max_seq_len``."""

    def __init__(self, prompt_len: int, max_tokens: int, max_seq_len: int) -> None:
        super().__init__(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
            f"max_seq_len ({max_seq_len})",
            param="max_tokens",
        )
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_seq_len = max_seq_len


class EngineError(TinyLoopError):
    """Raised when model work fails while a request runs (a kernel error, out of memory)."""


class KVCacheExhausted(EngineError):
    """Raised when the KV cache has no free block left for a sequence that needs one."""


class EngineBroken(EngineError):
    """Raised when the engine is unusable (its state may be corrupt): the runtime fails the
    requests in flight, turns unhealthy and refuses new work."""


class SchedulerError(TinyLoopError):
    """Root of the runtime's refusals; HTTP answers each with 503."""


class QueueFullError(SchedulerError):
    """Raised by submit when the queue already holds ``max_queue_depth`` requests."""


class AdmissionRejected(SchedulerError):
    """Raised by submit when the predicted queue wait exceeds the request's SLO."""

    def __init__(self, reason: str, predicted_wait_ms: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.predicted_wait_ms = predicted_wait_ms


class SchedulerShutdown(SchedulerError):
    """Raised by submit once shutdown has begun."""
