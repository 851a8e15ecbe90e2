"""What the playground is served from and told about the model (issue 16), without a browser:
one copy of the page (package data), its assets and favicon, and ``/ui/model.json``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import trio

from tests.http.conftest import running_server, tiny_engine
from tinyloop.http.service import ServedModel
from tinyloop.http.web import DEMO_CHAT_REASON, NO_TEMPLATE_REASON, page_info, web_root
from tinyloop.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_has_one_source_the_package_data() -> None:
    root = web_root()
    assert root is not None and root.resolve() == (ROOT / "tinyloop" / "web").resolve()
    assert not root.is_symlink() and not (ROOT / "web" / "index.html").exists()
    assert {"index.html", "app.js", "logic.js", "style.css", "favicon.svg"} <= {p.name for p in root.iterdir()}


async def test_assets_favicon_and_model_info_are_served() -> None:
    settings = Settings(port=0, max_batch_size=8, model_path="/models/tiny.tinyloop")
    with trio.fail_after(60):
        async with running_server(settings) as srv, httpx.AsyncClient(base_url=srv.url) as client:
            icon = await client.get("/favicon.ico")
            assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
            for name in ("app.js", "logic.js"):
                js = await client.get(f"/ui/{name}")
                assert js.status_code == 200 and "javascript" in js.headers["content-type"]
            info = (await client.get("/ui/model.json")).json()
    assert (info["id"], info["demo"], info["default_loops"]) == ("tiny", False, srv.model.default_loops)
    assert info["chat"]["usable"] and info["chat"]["reason"] is None and "im_start" in info["chat"]["template"]
    assert "kl" in info["exit_kinds"] and "gate" not in info["exit_kinds"]  # no exit gate in this model
    assert info["exit_thresholds"]["kl"] == 1e-3


def test_chat_is_greyed_out_for_the_demo_model_and_a_model_without_a_template() -> None:
    model = ServedModel.from_engine(tiny_engine(), Settings())
    demo = page_info(model, Settings())  # no model path: the bundled demo model
    assert demo["demo"] and demo["chat"] == {"usable": False, "reason": DEMO_CHAT_REASON,
                                             "template": model.chat_template.strip()}
    bare = page_info(dataclasses.replace(model, chat_template=" "), Settings(model_path="/m/x.tinyloop"))
    assert bare["chat"] == {"usable": False, "reason": NO_TEMPLATE_REASON, "template": None}
