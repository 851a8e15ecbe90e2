"""bench/RESULTS.md as ``run_all.py`` writes it: the table part of a bench's output, sections
parsed back by their markers and merged so that a run of some benches (``--only``) keeps the
others', and the headline plot drawn from the tables (valid SVG, one bar per ratio). Small
fixture strings; no bench runs.
"""

from __future__ import annotations

import datetime as dt
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.bench_scripts import load

ROOT = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"

results = load("results")
plot = load("plot_headlines")
run_all = load("run_all")

DEMO_OUTPUT = """model: demo.tinyloop; 1+2xloops+1 layers, hidden 256
  loops 1: 14.5s
  loops 4: 33.5s

### Text validation loss (125 windows)

| loops | loss (nats/token) |
|---|---|
| 1 | 2.4416 |

loops=4, stop:
```python
def f(): pass
```
"""

ENGINE_VS_HF = """base100m: 2+4xloops+2 layers, hidden 768; float32, 2 threads
loops HF layers batch ours tok/s  HF tok/s ours/HF  MB/tok ours GB/s  HF GB/s
    1         8     1       56.6      28.5    1.99     389      23.0     11.5
    1         8     8      316.3     130.3    2.43     389

weight-only quantised, batch 1, against HF float32
loops weights ours tok/s HF f32 tok/s ours/HF  MB/tok ours GB/s      top-1
    1    int8       97.6         29.2    3.35      97      10.0      0.969
    4    int4       72.0         14.5    4.98     131       9.9      0.750

copy bandwidth (512 MiB tensor, read + write): 34.5 GB/s (94 s)"""

VS_LLAMACPP = """base100m: 2+4xloops+2 layers; 2 threads, 3 rounds
loops | measure | TinyLoop | llama.cpp   |         TinyLoop tok/s |        llama.cpp tok/s | ratio | GB/s ours / llama
    1 | tg b1   | int8     | q8_0        |    200.7 [180.4-234.1] |    223.5 [195.4-225.5] |  0.90 | 20.5 / 23.9
    1 | tg b1   | int4     | q4_0 --pure |    277.1 [241.1-315.3] |    450.4 [400.8-485.2] |  0.62 | 17.7 / 25.5
    1 | tg b8   | int8     | q8_0        |    605.8 [509.0-606.6] |    451.4 [414.1-457.3] |  1.34 |
    1 | pp      | bf16     | f16         | 1129.3 [1006.3-1242.9] |   964.4 [962.5-1073.7] |  1.17 |
    4 | pp      | int8     | q8_0        |    472.1 [460.6-474.8] |    327.3 [326.3-342.4] |  1.44 |

copy bandwidth (512 MiB tensor, read + write): 31.2 GB/s"""

OVERHEAD = """Requests (closed loop)
path                                    req/s   vs bare
HTTP /generate (serve_http)               939      118%

ours / bare: requests 118%, server CPU per request 1.0x; SSE events 101%, server CPU per event 1.0x"""


def section(name: str, table: str, note: str = "1 s, exit 0; 2026-12-02 10:00 UTC, commit abc1234") -> str:
    return str(results.render_section(name, f"python bench/{name}.py", note, table))


def test_the_table_part_leaves_out_a_benchs_progress_lines_only() -> None:
    table = results.table_part("\n" + DEMO_OUTPUT + "\n\n", run_all.PROGRESS["demo_model"])
    assert "loops 1: 14.5s" not in table and "loops 4: 33.5s" not in table
    assert table.startswith("model: demo.tinyloop") and table.endswith("```")
    assert "| 1 | 2.4416 |" in table and "loops=4, stop:" in table
    assert results.table_part(DEMO_OUTPUT) == DEMO_OUTPUT.strip("\n")  # no rule: everything


def test_llamacpp_build_lines_are_progress_and_its_rows_are_not() -> None:
    progress = run_all.PROGRESS["vs_llamacpp"]
    output = ("building llama.cpp into /c/build (12-20 min on 2 cores; log /c/build.log) ...\n"
              "llama.cpp built in 14.2 min\n  wrote base100m-l1-f32.gguf (380 MiB, 3 s)\n"
              "  quantised base100m-l1-q8_0.gguf (101 MiB)\nllama.cpp: /c/build/bin\n" + VS_LLAMACPP)
    assert results.table_part(output, progress) == VS_LLAMACPP


def test_structureds_tokenizer_training_is_progress() -> None:
    output = "(trained a 65536-token BPE in 12 s: /tmp/bpe.json)\n\n## Engine: 16 streams\n\n| free tok/s |"
    assert results.table_part(output, run_all.PROGRESS["structured"]) == "## Engine: 16 streams\n\n| free tok/s |"


def test_a_fence_outgrows_the_tildes_inside_it() -> None:
    assert results.fenced("a\nb") == "~~~\na\nb\n~~~"
    assert results.fenced("x\n~~~~\ny") == "~~~~~\nx\n~~~~\ny\n~~~~~"


def test_sections_parse_back_whole_with_headings_and_fences_inside() -> None:
    sections = [section("overhead", OVERHEAD), section("demo_model", DEMO_OUTPUT.strip())]
    text = results.render_file("# Benchmark results\n\nheader", sections)
    parsed = results.parse_sections(text)
    assert list(parsed) == ["overhead", "demo_model"]
    assert parsed["demo_model"] == sections[1]
    assert results.section_table(parsed["demo_model"]) == DEMO_OUTPUT.strip()
    assert results.section_note(parsed["overhead"]).startswith("`python bench/overhead.py`: 1 s, exit 0;")


def test_a_run_of_some_benches_replaces_theirs_and_keeps_the_others() -> None:
    old = {"overhead": "old overhead", "batching": "old batching", "gone": "a bench since removed"}
    new = {"batching": "new batching", "prefix": "new prefix"}
    merged = results.merge(old, new, ["overhead", "engine_vs_hf", "batching", "prefix"])
    assert merged == ["old overhead", "new batching", "new prefix"]


def test_rewriting_the_file_keeps_the_other_sections_verbatim_under_a_new_header(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    kept = section("overhead", OVERHEAD, "16 s, exit 0; 2026-11-29 12:41 UTC, commit 7d32dfb")
    path.write_text(results.render_file("# Benchmark results\n\nLast written 2026-11-29", [
        kept, section("sampling", "old table")]))
    run_all.write_results(path, "# Benchmark results\n\nLast written 2026-12-02", {"sampling": section(
        "sampling", "new table")})
    text = path.read_text()
    assert "Last written 2026-12-02" in text and "2026-11-29 12:41" in text and "Last written 2026-11-29" not in text
    parsed = results.parse_sections(text)
    assert parsed["overhead"] == kept and results.section_table(parsed["sampling"]) == "new table"
    assert "old table" not in text


def test_the_header_and_the_log_entry_name_the_run() -> None:
    run = run_all.Run(dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC), "abc1234", "AMD EPYC (nproc 2)",
                      ["- CPU: AMD EPYC; nproc 2"], "python bench/run_all.py --threads 2")
    header = run.header(quick=False)
    assert header.startswith("# Benchmark results\n") and "2026-12-02 10:00 UTC, commit abc1234" in header
    assert "`python bench/run_all.py --threads 2`" in header and "- CPU: AMD EPYC; nproc 2" in header
    assert "SMOKE RUN" in run.header(quick=True)
    entry = run.log_entry({"overhead": (16.2, 0), "batching": (75.0, 1)})
    assert entry.startswith("\n## 2026-12-02 10:00 UTC, commit abc1234")
    assert "| overhead | 16 | 0 |" in entry and "| batching | 75 | 1 |" in entry


def test_the_peer_bench_is_opt_in() -> None:
    assert "vs_llamacpp" in run_all.PEERS and "vs_llamacpp" not in run_all.BENCHES


def fixture_results() -> str:
    return str(results.render_file("# Benchmark results", [
        section("overhead", OVERHEAD), section("engine_vs_hf", ENGINE_VS_HF), section("vs_llamacpp", VS_LLAMACPP)]))


def test_the_headlines_are_the_ratios_of_the_three_peers() -> None:
    groups = plot.headlines(fixture_results())
    bars = {(g.title, b.label): b.ratio for g in groups for b in g.bars}
    assert [g.title for g in groups] == [
        "against transformers (same model, threads and dtype)", "against llama.cpp: decode, batch 1",
        "against llama.cpp: decode, batch 8", "against llama.cpp: prefill",
        "the runtime against the bare HTTP stack (Quart-trio on hypercorn)"]
    transformers, tg1, tg8, pp, http = (g.title for g in groups)
    assert bars[transformers, "float32, loops 1, batch 8"] == 2.43
    assert bars[transformers, "int4 (HF float32), loops 4, batch 1"] == 4.98
    assert bars[tg1, "int8 / q8_0, loops 1"] == 0.90  # q4_0 --pure: not the same format, left out
    assert bars[tg8, "int8 / q8_0, loops 1"] == 1.34
    assert bars[pp, "int8 / q8_0, loops 4"] == 1.44 and (pp, "bf16 / f16, loops 1") not in bars
    assert bars[http, "HTTP /generate, requests/s"] == 1.18 and bars[http, "SSE on one connection, events/s"] == 1.01
    assert len(bars) == 4 + 1 + 1 + 1 + 2
    assert groups[0].source.startswith("`python bench/engine_vs_hf.py`")


def test_the_svg_is_valid_xml_with_one_bar_per_ratio() -> None:
    groups = plot.headlines(fixture_results())
    root = ET.fromstring(plot.svg(groups))
    assert root.tag == f"{SVG}svg"
    bars = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"]
    assert len(bars) == sum(len(g.bars) for g in groups) == 9
    assert all(float(r.get("width", "0")) > 0 for r in bars)
    tips = [r.findtext(f"{SVG}title") for r in bars]
    assert "float32, loops 1, batch 8: 2.43x" in tips
    assert len([line for line in root.iter(f"{SVG}line") if line.get("class") == "one"]) == len(groups)
    empty = ET.fromstring(plot.svg([]))
    assert not [r for r in empty.iter(f"{SVG}rect") if r.get("class") == "bar"]


def test_the_committed_plot_is_drawn_from_the_committed_results() -> None:
    text = (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    assert set(results.parse_sections(text)) == {*run_all.BENCHES, *run_all.PEERS}
    drawn = plot.svg(plot.headlines(text))
    assert (ROOT / "docs" / "img" / "headlines.svg").read_text(encoding="utf-8") == drawn, \
        "python bench/plot_headlines.py"
