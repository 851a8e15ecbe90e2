"""The OpenAPI 3.1 document of the server, built from the pydantic request schemas."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel

import tinyloop
from tinyloop.http.native import TokenizeBody
from tinyloop.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    SpeculativeRequest,
    TreeSpeculativeRequest,
)

__all__ = ["openapi_document"]

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

_POSTS: dict[str, tuple[type[BaseModel], str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, "OpenAI chat completion (SSE when stream)"),
    "/v1/completions": (CompletionRequest, "OpenAI text completion (SSE when stream)"),
    "/api/v0/chat/completions": (ChatCompletionRequest, "LM Studio chat completion with stats"),
    "/api/v0/completions": (CompletionRequest, "LM Studio completion with stats"),
    "/generate": (GenerateRequest, "Native generation with every loop knob (SSE when stream)"),
    "/generate/speculative": (SpeculativeRequest, "Chain self-speculative decoding"),
    "/generate/tree_speculative": (TreeSpeculativeRequest, "Tree self-speculative decoding"),
    "/tokenize": (TokenizeBody, "Text or chat messages to token ids"),
    "/detokenize": (DetokenizeRequest, "Token ids to text"),
}
_GETS = {"/v1/models": "List models", "/v1/models/{model}": "One model",
         "/api/v0/models": "List models (LM Studio shape)", "/api/v0/models/{model}": "One model (LM Studio)",
         "/healthz": "Health probe (text)", "/health": "Health probe (text), vLLM's path",
         "/metrics": "Prometheus metrics (text)",
         "/version": "The server's version (as tinyloop --version), torch's and the engines' devices",
         "/tokenizer_info": "The tokenizer's tokenizer_config.json (vLLM's route, lm-eval's remote tokenizer)",
         "/v1/tokenizer_info": "The tokenizer's tokenizer_config.json, under /v1"}


def _errors() -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {str(code): {"description": desc, **ref} for code, desc in
            ((400, "invalid request"), (401, "missing API key"), (404, "unknown model or route"),
             (413, "body too large"), (500, "engine error"), (503, "overloaded or shutting down"))}


@cache
def openapi_document() -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": _ERROR}
    paths: dict[str, Any] = {}
    for path, (model, summary) in _POSTS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        paths[path] = {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {"200": {"description": "OK", "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}}}}, **_errors()}}}
    for path, summary in _GETS.items():
        params = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}] \
            if "{model}" in path else []
        paths[path] = {"get": {"summary": summary, "parameters": params,
                               "responses": {"200": {"description": "OK"}, **_errors()}}}
    return {"openapi": "3.1.0",
            "info": {"title": "TinyLoop", "version": tinyloop.__version__,
                     "description": "Serving looped (recurrent-depth) transformer language models."},
            "paths": paths, "components": {"schemas": schemas}}
