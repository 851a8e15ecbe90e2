"""Two engines behind one server: the same answers as one engine, /healthz per engine, the
engine="i" series adding up to the totals; ``load_engines`` for ``--engines``."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.http.conftest import running_server, tiny_engine
from tinyloop import settings as settings_module
from tinyloop.cpu import kernels
from tinyloop.errors import ConfigError
from tinyloop.http.service import ServedModel
from tinyloop.server import load_engines
from tinyloop.settings import Settings, usable_cores

PROMPTS = [f"Story {i}: once upon a time" for i in range(6)]


def samples(text: str, name: str) -> dict[str, float]:
    """``name``'s samples by their ``engine`` label ('' for the unlabelled one)."""
    return {s.labels.get("engine", ""): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


async def completions(url: str) -> list[list[str]]:
    out: dict[int, list[str]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one(i: int) -> None:
            body = {"prompt": PROMPTS[i], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            out[i] = resp.json()["choices"][0]["logprobs"]["tokens"]

        async with trio.open_nursery() as n:
            for i in range(len(PROMPTS)):
                n.start_soon(one, i)
    return [out[i] for i in range(len(PROMPTS))]


async def test_two_engines_serve_what_one_serves() -> None:
    settings = Settings(port=0, max_batch_size=2)
    with trio.fail_after(120):
        async with running_server(settings) as one:
            alone = await completions(one.url)
        engine = tiny_engine()
        model = ServedModel.from_engine(engine, settings)
        async with running_server(settings, engine=[engine, engine.replica()], model=model) as two:
            assert await completions(two.url) == alone
            async with httpx.AsyncClient(base_url=two.url) as client:
                health = await client.get("/healthz")
                metrics = (await client.get("/metrics")).text
    assert health.status_code == 200 and health.text == "ok\nengine 0: ok\nengine 1: ok\n"
    per_engine = samples(metrics, "tinyloop_engine_tokens_generated_total")
    total = samples(metrics, "tinyloop_tokens_generated_total")[""]
    assert set(per_engine) == {"0", "1"} and all(v > 0 for v in per_engine.values())  # both engines worked
    assert sum(per_engine.values()) == total
    assert samples(metrics, "tinyloop_engine_healthy") == {"0": 1.0, "1": 1.0}


def test_load_engines_shares_one_model_and_splits_the_threads(tiny_artifact: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    try:
        for cores, engines_n, each, kernel_each in ((2, 1, 1, 2), (16, 1, 15, 16), (16, 3, 5, 5), (2, 3, 1, 1)):
            monkeypatch.setattr(settings_module, "usable_cores", lambda n=cores: n)
            settings = Settings(model_path=str(tiny_artifact), engines=engines_n)
            assert settings.cpu_threads == each  # the cores but one (the event loop's), split
            assert settings.cpu_kernel_threads == kernel_each  # every core, split
            if engines_n == 3 and cores == 16:
                engines = load_engines(settings)
                assert len(engines) == 3 and len({id(e.model) for e in engines}) == 1
                assert len({id(e.pool) for e in engines}) == 3
                assert torch.get_num_threads() == 5
                assert not kernels.available() or kernels.threads() == 5
        load_engines(Settings(model_path=str(tiny_artifact), threads=2, kernel_threads=3))  # set: taken as it is
        assert torch.get_num_threads() == 2
        assert not kernels.available() or kernels.threads() == 3
        with pytest.raises(ConfigError):
            Settings(threads=0)
        with pytest.raises(ConfigError):
            Settings(kernel_threads=0)
    finally:
        torch.set_num_threads(threads)


def test_usable_cores_is_the_affinity_capped_by_a_cgroup_quota(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert usable_cores(tmp_path / "none") == 16  # no cgroup files: the affinity
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert usable_cores(v2) == 16  # unlimited
    (v2 / "cpu.max").write_text("250000 100000\n")  # docker --cpus 2.5: 2 whole cores
    assert usable_cores(v2) == 2
    (v2 / "cpu.max").write_text("50000 100000\n")  # half a core: still 1
    assert usable_cores(v2) == 1
    (v2 / "cpu.max").write_text("6400000 100000\n")  # 64 CPUs' quota on 16 cores: the affinity
    assert usable_cores(v2) == 16
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cores(v1.parent) == 16
    (v1 / "cpu.cfs_quota_us").write_text("400000\n")  # a Kubernetes limit of 4 CPUs
    assert usable_cores(v1.parent) == 4
    (v1 / "cpu.cfs_quota_us").write_text("garbage\n")
    assert usable_cores(v1.parent) == 16
