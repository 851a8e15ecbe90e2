"""TinyLoop: an inference runtime and HTTP server for looped (recurrent-depth) transformers."""

from __future__ import annotations

from tinyloop.actors.runtime import (
    Runtime as Runtime,
    RuntimeStatistics as RuntimeStatistics,
    open_runtime as open_runtime,
)
from tinyloop.actors.stream import RequestStream as RequestStream
from tinyloop.engine.engine import Engine as Engine
from tinyloop.errors import (
    AdmissionRejected as AdmissionRejected,
    ArtifactError as ArtifactError,
    ConfigError as ConfigError,
    EngineBroken as EngineBroken,
    EngineError as EngineError,
    KVCacheExhausted as KVCacheExhausted,
    PromptTooLongError as PromptTooLongError,
    QueueFullError as QueueFullError,
    RequestError as RequestError,
    SchedulerError as SchedulerError,
    SchedulerShutdown as SchedulerShutdown,
    TinyLoopError as TinyLoopError,
    TokenizerError as TokenizerError,
)
from tinyloop.model.artifact import load_artifact as load_artifact, save_artifact as save_artifact
from tinyloop.model.config import ExitRule as ExitRule, ModelConfig as ModelConfig
from tinyloop.requests import (
    GenerationChunk as GenerationChunk,
    GenerationRequest as GenerationRequest,
    GenerationResult as GenerationResult,
    RequestState as RequestState,
    SamplingParams as SamplingParams,
    TokenLogprob as TokenLogprob,
)
from tinyloop.settings import Settings as Settings
from tinyloop.tokenizer import Tokenizer as Tokenizer

__version__ = "0.1.0"
