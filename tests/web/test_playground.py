"""The playground at ``/`` in a real headless browser (issue 16): Playwright for Python driving
Debian's chromium against a real ``tinyloop serve`` of the bundled demo model on 127.0.0.1.

Skipped, with the reason, where playwright or chromium is missing (``.ci/run`` installs
chromium). Screenshots go to ``$TINYLOOP_SCREENSHOTS`` when set (the README's are made with
``TINYLOOP_SCREENSHOTS=docs/screenshots``), else to a temporary folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.test_serve import ROOT, STARTUP_S, clean_env, free_port

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip("chromium is not installed: apt-get install chromium (never `playwright install`)",
                allow_module_level=True)

pytestmark = pytest.mark.slow

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
WAIT_MS = 30_000  # any one wait in the page (a loaded 2-core machine)
SUM = "4175208+3869901="


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``tinyloop serve`` with the bundled demo model, in its own process, for the module."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tinyloop.cli", "serve", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=clean_env(OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"server exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not healthy after {STARTUP_S} s:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        # launch() gives each run a fresh, temporary user-data-dir
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("TINYLOOP_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:
    """A fresh context (no stored settings or history) on the playground, connected."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=server)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server)
    context.set_default_timeout(WAIT_MS)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto("/")
    pg.wait_for_selector("#conn[data-state=online]")
    pg.wait_for_selector(".examples button.example")
    try:
        yield pg
    finally:
        context.close()
    assert not errors, errors  # no uncaught exception in the page


def completions(pg: Any) -> list[dict[str, Any]]:
    """The bodies of the completion requests the page sends from now on."""
    bodies: list[dict[str, Any]] = []

    def seen(request: Any) -> None:
        if request.url.endswith("/api/v0/completions") and request.method == "POST":
            bodies.append(json.loads(request.post_data))

    pg.on("request", seen)
    return bodies


def column(pg: Any, title: str) -> Any:
    return pg.locator(".column", has=pg.locator("h3", has_text=title))


def cancelled(server: str) -> float:
    for line in httpx.get(f"{server}/metrics", timeout=10).text.splitlines():
        if line.startswith("tinyloop_requests_cancelled_total "):
            return float(line.split()[1])
    raise AssertionError("no tinyloop_requests_cancelled_total in /metrics")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_landing_page_states_the_model_labels_every_input_and_fits_390px(page: Any, shots: Path) -> None:
    assert "demo" in page.inner_text("#model")
    assert "Python" in page.inner_text("#capabilities") and "a+b=" in page.inner_text("#capabilities")
    # chat greyed out with the reason
    assert page.is_disabled("#modeChat")
    assert "not" in page.inner_text("#chatReason") or "never" in page.inner_text("#chatReason")
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea')]
        .filter(e => !e.labels.length && !e.getAttribute('aria-label')).map(e => e.id || e.name)""")
    assert unlabelled == []
    assert page.get_attribute("#results", "aria-live") == "polite"
    assert page.request.get("/favicon.ico").status == 200
    # visible focus: the focused control draws an outline
    page.focus("#run")
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Tab")
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"
    page.screenshot(path=str(shots / "landing.png"))
    light = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.emulate_media(color_scheme="dark")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") != light
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390


def test_the_page_logic(page: Any) -> None:
    """logic.js's pure functions, imported in the page: the sum checker, the settings' checks
    and request body, the SSE splitter, the /metrics parser, highlighting."""
    out = page.evaluate('''async () => {
      const L = await import('/ui/logic.js');
      const m = {max_loops: 32, default_loops: 4, context_length: 2048};
      const bad = (over, prompt = 'x') => L.validate({...L.DEFAULTS, ...over}, m, prompt).map(e => e.field);
      const metrics = L.parseMetrics(`# HELP x\\n# TYPE tinyloop_queue_depth gauge\\ntinyloop_queue_depth 2.0
tinyloop_requests_in_flight 3.0\\ntinyloop_kv_blocks_used 5.0\\ntinyloop_kv_blocks_total 40.0
tinyloop_batch_size_bucket{le="+Inf"} 10.0\\ntinyloop_batch_size_count 10.0\\ntinyloop_batch_size_sum 30.0
tinyloop_tokens_generated_total 100.0\\ntinyloop_prefix_cache_hit_tokens_total 1.0
tinyloop_prefix_cache_queried_tokens_total 4.0\\ntinyloop_requests_cancelled_total 7.0\\n`);
      const before = {...metrics, tinyloop_batch_size_count: 6, tinyloop_batch_size_sum: 18,
                      tinyloop_tokens_generated_total: 40};
      const body = L.buildBody({...L.DEFAULTS, seed: '7', stop: 'END\\n\\\\n', warm_start: 'normed',
                                exit_kind: 'kl', exit_threshold: '0.01', speculation: true, draft_loops: '2'},
                               {prompt: 'p', loops: 8});
      const sum = L.parseSum('123+456=');
      return {
        sum, spaced: L.parseSum(' \\n 1 + 2 = '), notSum: [L.parseSum('x+1='), L.parseSum('1+2=3')],
        right: L.checkSum(sum, '579\\n'), wrong: L.checkSum(sum, '1133'), empty: L.checkSum(sum, '\\n'),
        ok: bad({}), temp: bad({temperature: '5'}), topP: bad({top_p: '0'}), loops: bad({loops: '33'}),
        draft: bad({speculation: true, draft_loops: '5', loops: '4'}), prompt: bad({}, '  '),
        specMix: bad({speculation: true, warm_start: 'raw', exit_kind: 'kl', cache_window: '2'}),
        minLoops: bad({exit_kind: 'cosine', exit_min_loops: '9', loops: '8'}),
        compare: bad({compare_loops: '1,x'}), maxTok: bad({max_tokens: '5000'}),
        body, sumBody: L.buildBody(L.DEFAULTS, {prompt: sum.prompt, sum}),
        raw: L.buildBody({...L.DEFAULTS, warm_start: 'raw'}, {prompt: 'p'}).warm_start,
        sse: L.sseEvents('data: {"a":1}\\n\\ndata: [DONE]\\n\\ndata: {"b"'),
        metrics: metrics.tinyloop_requests_cancelled_total, inf: metrics['tinyloop_batch_size_bucket{le="+Inf"}'],
        live: L.liveStats(before, metrics, 2), first: L.liveStats(null, metrics, 0),
        html: L.renderText('def f(x):', '\\n    return "<a>"  # hi', true),
        plain: L.renderText('\\n1+2=', '3', false),
        covers: L.highlight('class A:\\n    s = """x\\ny"""  # c\\n').map(t => t[1]).join(''),
        reason: [L.stopReason('userStopped'), L.stopReason('maxPredictedTokensReached')],
        spark: L.sparkline([0, 5, 10], 120, 24),
      };
    }''')
    assert out["sum"] == {"a": "123", "b": "456", "expected": "579", "prompt": "\n123+456=", "stop": ["\n"],
                          "maxTokens": 5}
    assert out["spaced"]["prompt"] == "\n1+2=" and out["notSum"] == [None, None]
    assert out["right"]["right"] and not out["wrong"]["right"] and out["wrong"]["got"] == "1133"
    assert not out["empty"]["right"]
    assert out["ok"] == [] and out["temp"] == ["temperature"] and out["topP"] == ["top_p"]
    assert out["loops"] == ["loops"] and out["draft"] == ["draft_loops"] and out["prompt"] == ["prompt"]
    assert out["compare"] == ["compare_loops"] and out["maxTok"] == ["max_tokens"]
    assert out["specMix"] == ["warm_start", "exit_kind", "cache_window"] and out["minLoops"] == ["exit_min_loops"]
    body = out["body"]
    assert body["seed"] == 7 and body["loops"] == 8 and body["stop"] == ["END", "\n"]
    assert body["warm_start"] == "normed" and out["raw"] is True
    assert body["exit"] == {"kind": "kl", "check_every": 1, "exited_kv": "copy_latest", "threshold": 0.01}
    assert body["speculation"] == {"draft_loops": 2, "draft_ahead": 4, "branches": 1}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    sum_body = out["sumBody"]
    assert sum_body["prompt"] == "\n123+456=" and sum_body["stop"] == ["\n"] and sum_body["max_tokens"] == 5
    assert "loops" not in sum_body and "seed" not in sum_body and "exit" not in sum_body
    assert out["sse"] == {"events": ['{"a":1}', "[DONE]"], "rest": 'data: {"b"'}
    assert out["metrics"] == 7 and out["inf"] == 10  # a labelled sample keeps its labels in the key
    assert out["live"] == {"queue": 2, "inFlight": 3, "batch": 3, "kvUsed": 5, "kvTotal": 40, "hitRate": 0.25,
                           "tokensPerSecond": 30, "cancelled": 7}
    assert out["first"]["tokensPerSecond"] is None and out["first"]["batch"] is None
    html = out["html"]
    assert '<span class="t-k prompt">def</span>' in html and '<span class="t-k">return</span>' in html
    assert "&lt;a&gt;" in html and "<a>" not in html and '<span class="t-c"># hi</span>' in html
    assert out["plain"] == '<span class="prompt">\n1+2=</span>3'
    assert out["covers"] == 'class A:\n    s = """x\ny"""  # c\n'
    assert out["reason"] == ["stopped", "max tokens"]
    assert out["spark"].startswith("0.0,23.0") and out["spark"].endswith("120.0,1.0")


def test_an_example_runs_on_click_with_its_prompt_dimmed_highlighted_and_copyable(page: Any) -> None:
    page.get_by_role("button", name="def fibonacci(n):").click()
    col = page.locator(".column")
    page.wait_for_selector(".column[data-state=finished]")
    assert col.locator(".state").inner_text().startswith("finished · ")
    assert "tokens" in col.locator(".state").inner_text()
    assert col.locator(".prompt").first.inner_text() == "def"  # the prompt, dimmed (and highlighted)
    assert col.locator(".t-k").count() >= 1
    stats = col.locator(".stats").inner_text()
    assert "tok/s" in stats and "first token" in stats and "mean loops 4.00" in stats
    text = page.evaluate("document.querySelector('.column pre').textContent")
    assert text.startswith("def fibonacci(n):") and len(text) > len("def fibonacci(n):")
    col.locator("[data-role=copy]").click()
    wait_until(lambda: page.evaluate("navigator.clipboard.readText()") == text[len("def fibonacci(n):"):])
    # a second run, then the first one re-opened from the history
    page.get_by_role("button", name="class Stack:").click()
    page.wait_for_selector(".column[data-state=finished]")
    assert page.locator("#history li").count() == 2
    page.locator("#history li button").nth(1).click()
    assert page.input_value("#prompt") == "def fibonacci(n):"
    assert page.evaluate("document.querySelector('.column pre').textContent") == text


def test_compare_loops_streams_the_columns_together_and_marks_the_sum(page: Any, shots: Path) -> None:
    bodies = completions(page)
    order: list[str] = []
    page.on("request", lambda r: order.append("sent") if r.url.endswith("/completions") else None)
    page.on("requestfinished", lambda r: order.append("done") if r.url.endswith("/completions") else None)
    page.get_by_role("button", name=f"{SUM} (compare loops)").click()
    page.wait_for_function("document.querySelectorAll('.column[data-state=finished]').length === 4")
    assert [b["loops"] for b in bodies] == [1, 2, 4, 8]
    assert {b["prompt"] for b in bodies} == {"\n" + SUM} and all(b["stop"] == ["\n"] for b in bodies)
    assert order[:4] == ["sent"] * 4  # all four stream at once
    assert column(page, "loops 4").locator(".mark").inner_text() == "✓ right"  # the default loops
    assert "mean loops 4.00" in column(page, "loops 4").locator(".stats").inner_text()
    assert column(page, "loops 1").locator(".mark").inner_text().startswith("✗ wrong")  # 43015209
    page.screenshot(path=str(shots / "compare.png"), full_page=True)
    # a typed sum, sent with Ctrl+Enter: the page adds the newline the model expects
    del bodies[:]
    page.fill("#prompt", "123+456=")
    page.keyboard.press("Control+Enter")
    page.wait_for_selector(".column[data-state=finished]")
    assert bodies[-1]["prompt"] == "\n123+456=" and bodies[-1]["stop"] == ["\n"]
    assert page.locator(".column .mark").inner_text() == "✓ right"


def test_settings_reach_the_request_body_and_bad_ones_are_not_sent(page: Any, shots: Path) -> None:
    bodies = completions(page)
    page.click("#settings summary")
    page.fill("[name=top_k]", "5")
    page.fill("[name=seed]", "7")
    page.fill("[name=loops]", "2")
    page.select_option("[name=warm_start]", "normed")
    page.select_option("[name=exit_kind]", "kl")
    page.fill("[name=exit_threshold]", "0.01")
    page.screenshot(path=str(shots / "settings.png"), full_page=True)
    page.fill("#prompt", "def add(a, b):")
    page.click("#run")
    page.wait_for_selector(".column[data-state=finished]")
    body = bodies[-1]
    assert (body["top_k"], body["seed"], body["loops"], body["warm_start"]) == (5, 7, 2, "normed")
    assert body["exit"]["kind"] == "kl" and body["exit"]["threshold"] == 0.01 and "speculation" not in body
    # speculation with warm start is refused before sending, naming the field
    page.check("[name=speculation]")
    page.click("#run")
    assert page.get_attribute("[name=warm_start]", "aria-invalid") == "true"
    assert "warm start" in page.inner_text("#banner") and page.is_visible("#banner")
    assert len(bodies) == 1
    page.select_option("[name=warm_start]", "off")
    page.select_option("[name=exit_kind]", "")
    page.click("#run")
    page.wait_for_selector(".column[data-state=finished]")
    assert bodies[-1]["speculation"] == {"draft_loops": 1, "draft_ahead": 4, "branches": 1}
    assert "drafted " in page.locator(".column .stats").inner_text()  # the reply's draft counts
    assert page.is_hidden("#banner")


def test_escape_stops_mid_stream_and_the_server_counts_a_cancellation(page: Any, server: str) -> None:
    page.click("#settings summary")
    page.fill("[name=max_tokens]", "1500")
    page.check("[name=ignore_eos]")
    page.fill("[name=loops]", "32")
    before = cancelled(server)
    page.fill("#prompt", "def fibonacci(n):")
    page.click("#run")
    streaming = "/running · ([3-9]|\\d\\d+) tokens/.test(document.querySelector('.column .state').textContent)"
    page.wait_for_function(streaming)  # a few tokens in
    page.keyboard.press("Escape")
    page.wait_for_selector(".column[data-state=stopped]")
    assert page.locator(".column .state").inner_text().startswith("stopped after ")
    wait_until(lambda: cancelled(server) > before)
    page.wait_for_function(f"Number(document.getElementById('liveCancelled').textContent) > {before}")


def test_errors_show_in_the_banner_with_the_field_and_a_dead_server_is_said(page: Any) -> None:
    page.fill("#prompt", " ".join(str(i) for i in range(3000)))  # past the 2048-token context
    page.keyboard.press("Control+Enter")
    page.wait_for_selector(".column[data-state=error]")
    banner = page.inner_text("#banner")
    assert "(400)" in banner and "2048" in banner and "field prompt" in banner
    assert page.get_attribute("#prompt", "aria-invalid") == "true"
    assert not page.locator(".column pre").inner_text().count("error")  # not shown as model output
    page.route("**/api/v0/completions", lambda route: route.abort())
    page.route("**/metrics", lambda route: route.abort())
    page.fill("#prompt", "def f():")
    page.click("#run")
    page.wait_for_selector(".column[data-state=error]")
    assert "Cannot reach the server" in page.inner_text("#banner")
    page.wait_for_selector("#conn[data-state=offline]")


def test_chat_mode_sends_the_conversation_when_the_model_has_a_template(page: Any) -> None:
    """The demo model greys chat out (first test); a model with a usable template (its
    /ui/model.json answered here as for one) gets chat mode, sent to the chat route."""
    info = page.request.get("/ui/model.json").json()
    info.update(demo=False, chat={**info["chat"], "usable": True, "reason": None})
    page.route("**/ui/model.json", lambda route: route.fulfill(json=info))
    page.reload()
    page.wait_for_selector("#conn[data-state=online]")
    page.check("#modeChat")
    assert page.is_visible("#system") and "im_start" in (page.text_content("#templateText") or "")
    page.fill("#system", "be brief")
    page.fill("#prompt", "hello")
    with page.expect_request("**/api/v0/chat/completions") as sent:
        page.keyboard.press("Control+Enter")
    assert json.loads(sent.value.post_data)["messages"] == [{"role": "system", "content": "be brief"},
                                                            {"role": "user", "content": "hello"}]
    page.wait_for_selector(".column[data-state=finished]")
    assert page.locator(".column .prompt").first.inner_text().startswith("hello")
