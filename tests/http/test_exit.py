"""The per-request adaptive exit rule over HTTP: fewer loops per token, visible per request."""

from __future__ import annotations

import httpx
import trio

from tests.http.conftest import running_server


async def test_generate_with_an_exit_rule_reports_fewer_loops() -> None:
    body = {"prompt_tokens": list(range(40, 60)), "max_tokens": 6, "loops": 8, "ignore_eos": True}
    with trio.fail_after(60):
        async with running_server() as srv, httpx.AsyncClient(base_url=srv.url) as client:
            plain = (await client.post("/generate", json=body)).json()
            rule = {"kind": "latent_diff", "threshold": 10.0, "min_loops": 2}
            early = (await client.post("/generate", json={**body, "exit": rule})).json()
            assert plain["mean_loops"] == 8.0
            assert early["mean_loops"] == (8 + 2 * 5) / 6
            bad = await client.post("/generate", json={**body, "exit": {"kind": "gate", "threshold": 0.5}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "exit"
            for wrong in ({"kind": "entropy"}, {"kind": "kl", "threshold": 0},
                          {"kind": "kl", "min_loops": 2, "min_steps": 1}, {"kind": "kl", "check_every": 0}):
                worse = await client.post("/generate", json={**body, "exit": wrong})
                assert worse.status_code == 400 and worse.json()["error"]["param"].startswith("exit"), wrong
            default = await client.post("/generate", json={**body, "exit": {"kind": "minp-kl"}})
            assert default.status_code == 200, "the reference's name, and its default threshold"
            metrics = (await client.get("/metrics")).text
            assert 'tinyloop_loops_per_token_bucket{le="4.0"} 1.0' in metrics
