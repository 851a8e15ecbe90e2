"""An ``n`` the server can never admit is the request's fault: 400 naming ``n``, not 503.

The ``n`` choices of a request are admitted all or none, one by one, and each must find the
queue below ``max_queue_depth``. More choices than the queue holds were refused with 503 "queue
is full" and ``Retry-After: 1`` (on an idle server too), so a client that obeys it retried
forever. Now such an ``n`` is refused before anything is admitted; ``n`` up to the queue depth
runs.
"""

from __future__ import annotations

import httpx
import trio

from tests.http.conftest import running_server
from tests.http.test_errors import Case, problems_with
from tests.reliability.conftest import assert_drained, counter
from tinyloop.settings import Settings

DEPTH = 2
ROUTES = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
          "/api/v0/completions": {"prompt": "hi", "max_tokens": 2},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          "/api/v0/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


async def test_an_n_past_the_queue_depth_is_a_400_naming_n_on_an_idle_server() -> None:
    settings = Settings(port=0, max_queue_depth=DEPTH, max_batch_size=2)
    problems: list[str] = []
    with trio.fail_after(60):
        async with running_server(settings) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            for path, body in ROUTES.items():
                for n in (DEPTH + 1, DEPTH + 2, 16):
                    for stream in (False, True):
                        case = Case(f"n={n} stream={stream} on {path}", path, 400, "n", code="invalid_value")
                        resp = await client.post(path, json={**body, "n": n, "stream": stream})
                        problems += problems_with(case, resp)
                        if "retry-after" in resp.headers:
                            problems.append(f"{case.name}: Retry-After on a 400")
            submitted, rejected = counter(srv, "submitted"), counter(srv, "rejected")
            fits = [await client.post(path, json={**body, "n": DEPTH}) for path, body in ROUTES.items()]
            assert_drained(srv)
    assert not problems, "\n".join(problems)
    assert (submitted, rejected) == (0, 0)  # refused before anything reached admission
    for resp in fits:
        assert resp.status_code == 200, resp.text[:200]
        assert len(resp.json()["choices"]) == DEPTH
