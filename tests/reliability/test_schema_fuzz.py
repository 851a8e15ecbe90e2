"""Bad input: schemathesis fuzzes every operation of the server's own ``/openapi.json``, with
valid bodies (positive) and bodies the schema forbids (negative), a bounded, derandomized number
of examples each. No answer may be a 5xx, use an undocumented status, or break the response
schema (every error is the documented error object).

The server runs in a thread of its own (its own ``trio.run``) so that schemathesis and
hypothesis drive it synchronously with a ``requests`` session, as they are built to.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
import trio
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

import requests
from tests.http.conftest import running_server, tiny_engine
from tinyloop.settings import Settings

pytestmark = pytest.mark.slow

EXAMPLES = 25  # per operation and mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """A live server (a 32-token context keeps every generated request cheap) in a thread."""
    started = threading.Event()
    stop = threading.Event()
    url: list[str] = []
    failure: list[BaseException] = []

    async def host() -> None:
        async with running_server(Settings(port=0, max_batch_size=4), tiny_engine(max_seq_len=32)) as srv:
            url.append(srv.url)
            started.set()
            while not stop.is_set():
                await trio.sleep(0.02)

    def thread_main() -> None:
        try:
            trio.run(host)
        except BaseException as exc:  # reported by the fixture, not lost in the thread
            failure.append(exc)
            started.set()

    thread = threading.Thread(target=thread_main, name="schema-fuzz-server", daemon=True)
    thread.start()
    assert started.wait(60) and url, failure
    try:
        yield url[0]
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive() and not failure, failure


@pytest.fixture(scope="module")
def schema(server_url: str) -> schemathesis.BaseSchema:
    document = requests.get(f"{server_url}/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(document)


def cases() -> list[tuple[str, GenerationMode]]:
    """Every operation in positive mode; those with a body in negative mode too (a GET has no
    invalid request to make: its one parameter, the model id in the path, is any string)."""
    from tinyloop.http.openapi import openapi_document

    out = []
    for path, item in openapi_document()["paths"].items():
        for method, spec in item.items():
            out.append((f"{method.upper()} {path}", GenerationMode.POSITIVE))
            if "requestBody" in spec:
                out.append((f"{method.upper()} {path}", GenerationMode.NEGATIVE))
    return out


@pytest.mark.parametrize(("operation", "mode"), cases(), ids=lambda v: str(v))
def test_fuzzed_requests_get_documented_non_5xx_answers(
        schema: schemathesis.BaseSchema, server_url: str, operation: str, mode: GenerationMode) -> None:
    method, path = operation.split(" ", 1)
    op = schema[path][method]
    session = requests.Session()

    @hsettings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
               suppress_health_check=list(HealthCheck))
    @given(op.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:  # schemathesis.Case
        response = case.call(base_url=server_url, session=session, timeout=30)
        case.validate_response(response, checks=CHECKS)

    with session:
        check()


@pytest.mark.parametrize("temperature", [1.2e-239, 1e-45, 5e-324])
def test_a_temperature_below_float32_range_samples_greedily(server_url: str, temperature: float) -> None:
    """Found by the fuzzer: a positive temperature that rounds to 0 in float32 made the sampler
    divide 0 by 0 (a 500 "probability tensor contains nan"); its limit is greedy."""
    body: dict[str, Any] = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    greedy = requests.post(f"{server_url}/generate", json={**body, "temperature": 0}, timeout=30)
    tiny = requests.post(f"{server_url}/generate", json={**body, "temperature": temperature}, timeout=30)
    assert (greedy.status_code, tiny.status_code) == (200, 200), tiny.text
    assert tiny.json()["tokens"] == greedy.json()["tokens"]
