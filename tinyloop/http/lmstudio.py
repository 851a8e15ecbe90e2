"""LM Studio's REST API v0: the OpenAI routes (``tinyloop.http.openai``) under ``/api/v0``, with
LM Studio's model card and ``stats``, ``model_info`` and ``runtime`` on each completion."""

from __future__ import annotations

from quart import Blueprint

from tinyloop.http.openai import install

__all__ = ["blueprint"]

blueprint = install(Blueprint("lmstudio", __name__, url_prefix="/api/v0"), lmstudio=True)
