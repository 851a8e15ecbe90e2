"""The documentation: README.md (the front page) and the MkDocs site under docs/.

The site builds with ``mkdocs build --strict`` (a broken link, a missing anchor or a page left out
of the nav fails); the README stays a short front page whose links all resolve; the reference
pages keep up with the code: every ``tinyloop serve`` flag and every ``TINYLOOP_*`` variable the
sources read is on the configuration page, every route and metric on the HTTP page, every other
command's flags on the command-line page; and the examples cheap enough to run give what the
pages say they give.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# The two commands of the front page: `.ci/run` runs the second one.
SERVE_COMMAND = "pip install torch==2.13.0 -e . && tinyloop serve"
TEST_COMMAND = 'pip install torch==2.13.0 -e ".[dev]" && mypy && ruff check && python -m pytest'


def page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def subparsers() -> dict[str, argparse.ArgumentParser]:
    from tinyloop.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("tinyloop's parser has no subcommands")


def long_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings if o.startswith("--")}


# -- the site -------------------------------------------------------------------------------


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip('mkdocs or mkdocs-material is not installed (both are in the dev extra: pip install -e ".[dev]")')
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


# -- the front page -------------------------------------------------------------------------


def test_the_readme_is_a_short_front_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the reference into docs/"


def test_the_readme_keeps_the_two_commands_and_ci_runs_the_second() -> None:
    readme = README.read_text(encoding="utf-8")
    blocks = [b.strip() for b in code_blocks(readme, "bash")]
    assert SERVE_COMMAND in blocks and TEST_COMMAND in blocks
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert ci[-1] == TEST_COMMAND


def test_every_relative_link_of_the_readme_resolves() -> None:
    readme = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert relative, "no relative links found: the pattern is wrong"
    missing = [t for t in relative if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, missing


# -- the configuration page -----------------------------------------------------------------


def test_every_serve_flag_is_on_the_configuration_page() -> None:
    text = page("configuration.md")
    missing = sorted(f for f in long_flags(subparsers()["serve"]) if f"`{f}" not in text)
    assert not missing, f"tinyloop serve flags missing from docs/configuration.md: {missing}"


def tinyloop_variables() -> set[str]:
    """Every ``TINYLOOP_*`` name the package's sources use, but C include guards."""
    names: set[str] = set()
    for path in (ROOT / "tinyloop").rglob("*"):
        if not path.is_file() or path.suffix not in {".py", ".c", ".h", ".cu", ".cuh", ".js", ".html"}:
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if path.suffix in {".c", ".h", ".cu", ".cuh"} and re.match(r"\s*#\s*(ifndef|define|endif)\b", line):
                continue
            names.update(re.findall(r"\bTINYLOOP_[A-Z0-9_]*[A-Z0-9]\b", line))
    return names


def test_every_tinyloop_variable_is_on_the_configuration_page() -> None:
    names = tinyloop_variables()
    assert {"TINYLOOP_MODEL_PATH", "TINYLOOP_CC", "TINYLOOP_CUDA_CACHE"} <= names, names
    text = page("configuration.md")
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"variables missing from docs/configuration.md: {missing}"


def test_every_setting_has_a_row_with_its_variable_and_flag() -> None:
    from tinyloop.settings import Settings

    rows = [line for line in page("configuration.md").splitlines() if line.startswith("| `TINYLOOP_")]
    for f in Settings.fields():
        env, flag = f.metadata["env"], "--" + f.name.replace("_", "-")
        assert any(row.startswith(f"| `{env}` |") and f"`{flag}`" in row for row in rows), env


def test_the_access_log_is_documented() -> None:
    text = page("configuration.md")
    row = next(line for line in text.splitlines() if line.startswith("| `TINYLOOP_ACCESS_LOG` |"))
    assert "`--access-log`" in row and "one line per request" in row


# -- the command line -----------------------------------------------------------------------


def test_every_command_and_its_flags_are_on_the_command_line_page() -> None:
    from tinyloop.cli import build_parser

    text = page("cli.md")
    top = long_flags(build_parser()) - {"--help"}
    assert not sorted(f for f in top if f"tinyloop {f}" not in text)
    for name, parser in subparsers().items():
        assert f"`tinyloop {name}" in text, name
        if name == "serve":  # its flags are the configuration page's (above)
            continue
        missing = sorted(f for f in long_flags(parser) - {"--help"} if f"{f}" not in text)
        assert not missing, (name, missing)


# -- the HTTP page --------------------------------------------------------------------------


def test_every_route_is_on_the_http_page() -> None:
    from tinyloop.http.factory import create_app

    text = page("http-api.md")
    app = create_app(None)
    missing = []
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)  # /v1/models/<path:name> -> /v1/models/{name}
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            if f"`{method} {path}`" not in text:
                missing.append(f"{method} {path}")
    assert not missing, f"routes missing from docs/http-api.md's table: {missing}"


def test_every_metric_is_on_the_http_page() -> None:
    from tinyloop.metrics import Metrics

    metrics = Metrics()
    metrics.engine_series()  # the engine="i" series exist only with several engines
    text = page("http-api.md")
    names = []
    for family in metrics.registry.collect():
        names.append(family.name + "_total" if family.type == "counter" else family.name)
    assert "tinyloop_engine_healthy" in names and "tinyloop_requests_completed_total" in names, names
    missing = sorted(n for n in names if f"| `{n}` |" not in text)
    assert not missing, f"metrics missing from docs/http-api.md's table: {missing}"


def test_the_http_page_states_the_max_tokens_defaults() -> None:
    """A request without ``max_tokens`` runs to the model's own context (the demo's figure as its
    artifact says), or the route's own default where smaller: the figures the page gives are the
    artifact's and the schemas'."""
    from tinyloop.http.schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest
    from tinyloop.model.artifact import read_config

    text = " ".join(page("http-api.md").split())
    demo = read_config(ROOT / "tinyloop" / "data" / "demo.tinyloop").max_position
    completions = CompletionRequest.model_fields["max_tokens"].default
    native = GenerateRequest.model_fields["max_tokens"].default
    assert ChatCompletionRequest.model_fields["max_tokens"].default is None  # "none on chat"
    assert "A request that sets no `max_tokens` gets what is left of the model's own context" in text
    assert f"`max_position`: {demo} for the demo model" in text, demo
    assert f"({completions} on `/v1/completions` and `/api/v0/completions`, {native} on `/generate`" in text
    assert f"the demo model's {demo}" in " ".join(page("configuration.md").split())
    assert f"`max_position`: {demo} for the demo model" in page("openai-compatibility.md")


def test_the_tokenize_example_gives_the_ids_shown() -> None:
    from tinyloop.tokenizer import default_tokenizer

    text = page("http-api.md")
    prompt = json.loads(re.search(r"localhost:8000/tokenize .*? -d '(\{.*?\})'", text)[1])["prompt"]  # type: ignore[index]
    shown = json.loads(re.search(r"localhost:8000/detokenize .*? -d '(\{.*?\})'", text)[1])["tokens"]  # type: ignore[index]
    tokenizer = default_tokenizer()
    assert tokenizer.encode(prompt) == shown
    assert tokenizer.decode(shown) == prompt
    prose = re.search(r'`/tokenize` of `"(.*?)"` above answers `"tokens": (\[[\d,\s]*\])`', text)
    assert prose is not None and prose[1] == prompt and json.loads(prose[2]) == shown
    assert f"`/detokenize` of those ids gives back\n`\"text\": \"{prompt}\"`" in text


# -- examples that run ----------------------------------------------------------------------


def test_the_loops_dial_tour_gives_what_the_readme_says() -> None:
    """The front page's two `tinyloop generate` lines, run as the command runs them."""
    from tinyloop.requests import GenerationRequest, SamplingParams
    from tinyloop.server import load_engine
    from tinyloop.settings import Settings

    readme = README.read_text(encoding="utf-8")
    claims = re.findall(r"tinyloop generate --prompt \$'\\n(\d+\+\d+=)' --max-tokens (\d+) --loops (\d+) +# (\d+)",
                        readme)
    assert len(claims) == 2, claims
    engine = load_engine(Settings())
    for prompt, max_tokens, loops, expected in claims:
        request = GenerationRequest(prompt_tokens=tuple(engine.tokenizer.encode("\n" + prompt)),
                                    max_tokens=int(max_tokens), loops=int(loops),
                                    sampling=SamplingParams(temperature=0.0))  # the command's default: greedy
        assert engine.generate(request).text.split("\n")[0] == expected, (loops, expected)
    assert "| 4 (default) |" in readme and engine.default_loops == 4


def test_the_python_embedding_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    source = code_blocks(page("python.md"), "python")[0]
    demo = ROOT / "tinyloop" / "data" / "demo.tinyloop"
    assert '"model.tinyloop"' in source
    code = compile(ast.parse(source.replace('"model.tinyloop"', repr(str(demo)))), "docs/python.md", "exec")
    exec(code, {})  # the page's own example, on the demo model
    assert capsys.readouterr().out.strip()


def test_a_newcomer_learns_the_cpu_wheel_and_the_packages_the_suite_drives() -> None:
    """On an ordinary Linux machine plain ``pip install torch`` is the CUDA build: the front page
    and the install page give PyTorch's CPU index; both name the Debian packages the full suite
    drives, which ``.ci/run`` installs."""
    ci = (ROOT / ".ci" / "run").read_text()
    for text in (README.read_text(), page("install.md")):
        assert "https://download.pytorch.org/whl/cpu" in text
        for package in ("chromium", "haproxy"):
            assert package in text and package in ci
