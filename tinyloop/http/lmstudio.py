"""LM Studio's REST API v0: the OpenAI objects plus ``stats``, ``model_info`` and ``runtime``."""

from __future__ import annotations

from quart import Blueprint, Response, jsonify

from tinyloop.http.formats import model_card
from tinyloop.http.openai import chat_completions, completions
from tinyloop.http.service import served

__all__ = ["blueprint"]

blueprint = Blueprint("lmstudio", __name__, url_prefix="/api/v0")


@blueprint.get("/models")
async def list_models() -> Response:
    return jsonify({"object": "list", "data": [model_card(served().model, lmstudio=True)]})


@blueprint.get("/models/<path:name>")
async def get_model(name: str) -> Response:
    model = served().model
    model.check_name(name)
    return jsonify(model_card(model, lmstudio=True))


@blueprint.post("/chat/completions")
async def chat_route() -> Response:
    return await chat_completions(lmstudio=True)


@blueprint.post("/completions")
async def completions_route() -> Response:
    return await completions(lmstudio=True)
