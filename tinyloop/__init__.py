"""TinyLoop: an inference runtime and HTTP server for looped (recurrent-depth) transformers.

Every public name is listed in ``__all__`` and imported on first use (PEP 562), so importing a
light part of the package (``tinyloop.errors``, ``tinyloop.policy``) loads neither torch nor
trio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Runtime": "tinyloop.actors.runtime",
    "RuntimeStatistics": "tinyloop.actors.runtime",
    "open_runtime": "tinyloop.actors.runtime",
    "RequestStream": "tinyloop.actors.stream",
    "EnginePort": "tinyloop.actors.port",
    "Engine": "tinyloop.engine.engine",
    "load_artifact": "tinyloop.model.artifact",
    "save_artifact": "tinyloop.model.artifact",
    "ModelConfig": "tinyloop.model.config",
    "ExitRule": "tinyloop.vocabulary",
    "KVMode": "tinyloop.vocabulary",
    "GenerationChunk": "tinyloop.requests",
    "GenerationRequest": "tinyloop.requests",
    "GenerationResult": "tinyloop.requests",
    "RequestState": "tinyloop.requests",
    "SamplingParams": "tinyloop.requests",
    "TokenLogprob": "tinyloop.requests",
    "Settings": "tinyloop.settings",
    "Tokenizer": "tinyloop.tokenizer",
    **{name: "tinyloop.errors" for name in (
        "AdmissionRejected", "ArtifactError", "ChatTemplateError", "ConfigError", "EngineBroken", "EngineError",
        "KVCacheExhausted", "PromptTooLongError", "QueueFullError", "RequestError", "SchedulerError",
        "SchedulerShutdown", "TinyLoopError", "TokenizerError")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed package's (tinyloop.version), read on first use
        from tinyloop.version import package_version

        globals()[name] = version = package_version()
        return version
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tinyloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, "__version__"})


if TYPE_CHECKING:
    __version__: str
    from tinyloop.actors.port import EnginePort as EnginePort
    from tinyloop.actors.runtime import Runtime as Runtime
    from tinyloop.actors.runtime import RuntimeStatistics as RuntimeStatistics
    from tinyloop.actors.runtime import open_runtime as open_runtime
    from tinyloop.actors.stream import RequestStream as RequestStream
    from tinyloop.engine.engine import Engine as Engine
    from tinyloop.errors import AdmissionRejected as AdmissionRejected
    from tinyloop.errors import ArtifactError as ArtifactError
    from tinyloop.errors import ChatTemplateError as ChatTemplateError
    from tinyloop.errors import ConfigError as ConfigError
    from tinyloop.errors import EngineBroken as EngineBroken
    from tinyloop.errors import EngineError as EngineError
    from tinyloop.errors import KVCacheExhausted as KVCacheExhausted
    from tinyloop.errors import PromptTooLongError as PromptTooLongError
    from tinyloop.errors import QueueFullError as QueueFullError
    from tinyloop.errors import RequestError as RequestError
    from tinyloop.errors import SchedulerError as SchedulerError
    from tinyloop.errors import SchedulerShutdown as SchedulerShutdown
    from tinyloop.errors import TinyLoopError as TinyLoopError
    from tinyloop.errors import TokenizerError as TokenizerError
    from tinyloop.model.artifact import load_artifact as load_artifact
    from tinyloop.model.artifact import save_artifact as save_artifact
    from tinyloop.model.config import ModelConfig as ModelConfig
    from tinyloop.requests import GenerationChunk as GenerationChunk
    from tinyloop.requests import GenerationRequest as GenerationRequest
    from tinyloop.requests import GenerationResult as GenerationResult
    from tinyloop.requests import RequestState as RequestState
    from tinyloop.requests import SamplingParams as SamplingParams
    from tinyloop.requests import TokenLogprob as TokenLogprob
    from tinyloop.settings import Settings as Settings
    from tinyloop.tokenizer import Tokenizer as Tokenizer
    from tinyloop.vocabulary import ExitRule as ExitRule
    from tinyloop.vocabulary import KVMode as KVMode
